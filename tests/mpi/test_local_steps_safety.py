"""Local steps agree or refuse (two clusters or more):

* settings that must match (every, overlap, the outer optimizer and its parameters, the
  pseudo-gradient's compression, the fragments and their delay, local steps on or off) are compared when the optimizer is
  built: a mismatch raises on every rank, naming each rank's value;
* a skipped step does not move a cluster's period count (GradScaler's pattern: a step whose
  gradient held an Inf never reaches ``step()``), so the clusters still meet at the same steps;
* a non-finite value in one cluster's parameters never reaches another cluster: the exchange is
  refused on every rank and every rank goes back to the agreed parameters (``skip``), or every
  rank raises NonFiniteGradientError (``raise``), whatever the pseudo-gradient's compression."""
import dataclasses
import logging

import pytest
import torch

import stella_mpi as hvd
from reference import nonfinite_policy, rank_batch, small_model
from stella_mpi.base.errors import NonFiniteGradientError
from stella_mpi.core import state
from stella_mpi.core.process_sets import global_process_set


def _clusters():
    return global_process_set.topology.num_clusters


@pytest.fixture(autouse=True)
def two_clusters(hvd_session):
    if _clusters() < 2:
        pytest.skip("needs two clusters or more")


def _cluster():
    return global_process_set.topology.cluster_id


def _last_cluster():
    return _cluster() == _clusters() - 1


def _optimizer(model, **local_steps):
    return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                    named_parameters=model.named_parameters(),
                                    local_steps=hvd.LocalSteps(**local_steps))


def _same_everywhere(model):
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = hvd.allgather(flat.unsqueeze(0))
    return all(torch.equal(everyone[r], flat) for r in range(hvd.size()))


def _counts(opt):
    return hvd.allgather_object((opt._outer.progress.exchanges, opt._outer.progress.local_steps))


# ---------------------------------------------------------------- settings

def _by_cluster(a, b):
    return a if _cluster() == 0 else b


MISMATCHES = {
    # name: (the LocalSteps of this rank, or None for none; what the message must name)
    "every": (lambda: dict(every=_by_cluster(4, 8)), "local_steps.every"),
    "outer": (lambda: dict(every=4, outer=_by_cluster("average", "nesterov")), "local_steps.outer"),
    "outer_lr": (lambda: dict(every=4, outer="nesterov", outer_lr=_by_cluster(0.7, 0.5)), "local_steps.outer"),
    "outer_callable": (lambda: dict(every=4, outer=lambda ps: torch.optim.Adam(ps, lr=_by_cluster(1e-2, 1e-3))),
                       "local_steps.outer"),
    "overlap_by_rank": (lambda: dict(every=4, overlap=hvd.rank() == hvd.size() - 1), "local_steps.overlap"),
    "compression": (lambda: dict(every=4, compression=hvd.Compression.thc(bits=_by_cluster(4, 2))),
                    "local_steps.compression"),
    "on_some_ranks": (lambda: None if hvd.rank() == hvd.size() - 1 else dict(every=4), "local_steps"),
    "fragments": (lambda: dict(every=4, fragments=_by_cluster(1, 2)), "local_steps.fragments"),
    "delay": (lambda: dict(every=4, fragments=2, delay=_by_cluster(0, 1)), "local_steps.fragments"),
    "inner": (lambda: dict(every=4, inner=_by_cluster("cluster", "rank")), "local_steps.inner"),
}


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_settings_that_differ_are_refused_on_every_rank(case):
    mine, field = MISMATCHES[case]
    ls = mine()
    model = small_model()
    with pytest.raises(ValueError) as err:
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                 named_parameters=model.named_parameters(),
                                 local_steps=None if ls is None else hvd.LocalSteps(**ls))
    text = str(err.value)
    assert "the ranks were given different settings" in text, text
    line = [x for x in text.splitlines() if x.strip().startswith(field + ":")]
    assert line, text
    assert "rank %d" % (hvd.size() - 1) in line[0] or "ranks" in line[0], text
    # every rank saw the same message (the decision is taken from the same gathered values)
    assert len(set(hvd.allgather_object(text))) == 1


def test_the_same_settings_pass_and_the_job_goes_on():
    model = small_model()
    opt = _optimizer(model, every=2, outer=lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(4):
        opt.zero_grad()
        x, y = rank_batch(hvd.rank(), step)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    assert _same_everywhere(model)


# ---------------------------------------------------------------- GradScaler's skipped steps

BAD_STEPS = (3, 6)   # the last step of the first period (every=4) and a step inside the second


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlap"])
def test_gradscaler_skips_in_one_cluster_do_not_shift_the_exchanges(overlap):
    """Horovod's GradScaler pattern: synchronize(), unscale_, step() inside skip_synchronize();
    the last cluster's loss is Inf at two steps, so its reduced gradients are refused (skipped)
    and the scaler never calls step() there. Before this was fixed, that cluster's period count
    fell behind and the exchanges paired different steps until the deadline."""
    model = small_model()
    opt = _optimizer(model, every=4, overlap=overlap)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    stepped, history = 0, []
    for step in range(12):
        opt.zero_grad()
        x, y = rank_batch(hvd.rank(), step)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if step in BAD_STEPS and _last_cluster():
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        before = [p.detach().clone() for p in model.parameters()]
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        stepped += any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
        history.append(opt._outer.progress.exchanges)
    # the clusters met at the same steps (mispaired exchanges can still end with equal parameters)
    histories = hvd.allgather_object(history)
    assert all(h == histories[0] for h in histories), histories
    opt.sync_clusters()
    counts = _counts(opt)
    assert len(set(counts)) == 1, counts
    # (overlap: the exchange launched at step 11 is applied by sync_clusters, with nothing trained since)
    assert counts[0] == (12 // 4, 0), counts
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert _same_everywhere(model)
    # the last cluster really skipped (a boundary step skipped changes nothing before its exchange)
    skipped = hvd.allgather_object(12 - stepped)
    assert max(skipped) >= 1 and min(skipped) == 0, skipped


@pytest.mark.auto_route
@pytest.mark.parametrize("offset", [0, 1, 2])
def test_gradscaler_skips_on_the_automatic_route_keep_every_rank_at_the_same_step(offset):
    """The automatic route under Horovod's GradScaler pattern, the last cluster's loss Inf at every
    third step (from ``offset``: over the three cases, every step once), so its ranks call
    ``step()`` only at the others: the adjuster's decisions, the entry into local steps, each
    rank made a replica (forced: local steps win, the cluster's reductions take all of the time)
    and the exchanges still come at the same step on every rank, and the clusters meet on the
    same parameters."""
    model = small_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   adjuster=hvd.Adjuster(interval=1, window=1, local_steps=(4,)))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    tuner = opt._tuner
    tuner.rule.sync_score = lambda est: float("inf")   # local steps win at the first decision
    tuner.local.inner_busy = lambda: 1.0               # and each rank a replica after its first period
    tuner._predicted_inner_share = lambda: None        # (not already at entering)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    history, moved_in_synchronize = [], []
    close = opt._close_step

    def closing(outer, skipped):   # (whether the replicas were chosen inside synchronize())
        before = tuner.inner
        close(outer, skipped)
        moved_in_synchronize.append(before != tuner.inner)

    opt._close_step = closing
    for step in range(24):
        opt.zero_grad()
        x, y = rank_batch(hvd.rank(), step)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if step % 3 == offset and _last_cluster():
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        history.append((step, opt.mode, tuner.inner, opt._route.kind, opt._outer.progress.exchanges
                        if opt.mode == "local" else None))
    histories = hvd.allgather_object(history)
    assert all(h == histories[0] for h in histories), histories
    assert any(inner == "rank" for _, _, inner, _, _ in history), history
    if offset == 1:   # (the last cluster skips the first period's end: it moved inside synchronize())
        assert any(hvd.allgather_object(any(moved_in_synchronize))), history
    opt.sync_clusters()
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert _same_everywhere(model)


def test_inner_steps_reduce_their_gradients_without_the_collective_thread(monkeypatch):
    """Inner steps submit nothing to the collective thread (each submission cost a negotiation
    round with every rank of the job, across the WAN, and queued behind an outer exchange in
    flight): on a cluster of one rank the reduction is the rank's own gradient; on a cluster of
    several it runs on the cluster's channel, once per step. The exchanges go through the
    collective thread everywhere; and an Inf on one cluster is still refused there, never
    reaching the parameters."""
    thread = state.current().collective_thread
    names = []
    submit = thread.submit
    monkeypatch.setattr(thread, "submit", lambda op, post=None: (names.append(op.name), submit(op, post))[1])
    model = small_model()
    opt = _optimizer(model, every=4)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    names.clear()
    for step in range(8):
        opt.zero_grad()
        x, y = rank_batch(hvd.rank(), step)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if step == 5 and _last_cluster():
            loss = loss * float("inf")
        loss.backward()
        opt.step()
    buckets = [n for n in names if n.startswith("DistributedOptimizer.bucket")]
    assert buckets == [], buckets
    channel = opt._route.channel
    if global_process_set.topology.cluster_size == 1:
        assert channel is None
    else:   # one bucket (the model is small): one reduction per step
        assert len(opt._buckets) == 1 and channel.reductions == 8, (len(opt._buckets), channel.reductions)
    assert any(n.startswith("local_steps.") for n in names), names
    assert _counts(opt)[0][0] == 2
    assert _same_everywhere(model)
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


# ---------------------------------------------------------------- non-finite parameters

PSEUDO = {
    "none": lambda: dict(),
    "thc4": lambda: dict(compression=hvd.Compression.thc(bits=4)),
    "topk": lambda: dict(compression=hvd.Compression.topk(density=0.5)),
    "overlap": lambda: dict(overlap=True),
}


def _train_poisoned(opt, model, steps, poison_at, errors):
    """Train ``steps`` steps; after the update of step ``poison_at`` the last cluster's first
    weight gets a NaN (as an overflowing update would leave it). NonFiniteGradientError is
    caught and noted with its step (the program goes on, as the README allows)."""
    for step in range(steps):
        opt.zero_grad()
        x, y = rank_batch(hvd.rank(), step)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        try:
            opt.step()
        except NonFiniteGradientError as e:
            errors.append((step, str(e)))
        if step == poison_at and _last_cluster():
            with torch.no_grad():
                model[0].weight.view(-1)[2] = float("nan")


@pytest.mark.parametrize("pseudo", list(PSEUDO))
def test_a_nan_in_one_clusters_parameters_never_reaches_another(pseudo, caplog):
    """every=4; the NaN enters after step 4's update, in the second period. Its exchange (after
    step 7; with overlap, its application after step 11) is refused on every rank, each rank goes
    back to the anchor, and the later exchanges go on, finite and the same everywhere."""
    model = small_model()
    opt = _optimizer(model, every=4, **PSEUDO[pseudo]())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    errors = []
    with caplog.at_level(logging.WARNING, logger="stella_mpi"):
        _train_poisoned(opt, model, 16, 4, errors)
    assert errors == []
    refusals = hvd.allgather_object([n for n, _ in opt._outer.refusals])
    assert len(set(map(tuple, refusals))) == 1 and len(refusals[0]) == 1, refusals
    assert "refused on every rank" in caplog.text, caplog.text
    opt.sync_clusters()
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert _same_everywhere(model)
    assert len(set(_counts(opt))) == 1


@pytest.mark.parametrize("pseudo", ["none", "thc4", "overlap"])
def test_raise_policy_raises_the_refused_exchange_on_every_rank(pseudo):
    model = small_model()
    opt = _optimizer(model, every=4, **PSEUDO[pseudo]())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    errors = []
    with nonfinite_policy("raise"):
        _train_poisoned(opt, model, 16, 4, errors)
        exchange = [(step, e) for step, e in errors if "local steps: exchange" in e]
        # every rank raised for the exchange, at the same step (the NaN cluster's own inner steps may
        # raise too: its reduced gradients are not finite)
        steps = hvd.allgather_object([step for step, _ in exchange])
        assert len(set(map(tuple, steps))) == 1 and len(steps[0]) == 1, (steps, errors)
        opt.sync_clusters()
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert _same_everywhere(model)
    assert len(set(_counts(opt))) == 1


def test_a_refused_bucket_of_a_bucketed_exchange_is_raised_on_every_rank():
    """A fusion threshold of 64 bytes cuts the THC pseudo-gradient exchange into one bucket per
    parameter (optim/tuning.py): the NaN is in the first bucket only, and every rank raises the
    refusal at the same step, goes back to the anchor and stays in step."""
    from stella_mpi.core import state
    old = state.current().config
    state.current().config = dataclasses.replace(old, fusion_threshold=64)
    try:
        model = small_model()
        opt = _optimizer(model, every=4, compression=hvd.Compression.thc(bits=4))
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        errors = []
        with nonfinite_policy("raise"):
            _train_poisoned(opt, model, 16, 4, errors)
            exchange = [step for step, e in errors if "local steps: exchange" in e]
            steps = hvd.allgather_object(exchange)
            assert len(set(map(tuple, steps))) == 1 and len(steps[0]) == 1, (steps, errors)
            opt.sync_clusters()
    finally:
        state.current().config = old
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert _same_everywhere(model)
    assert len(set(_counts(opt))) == 1
