"""DistributedOptimizer and the parameter/state helpers, against single-process references."""
import copy
import os
import warnings

import pytest
import torch

import stella_mpi as hvd
from stella_mpi.optim.tuning import auto_outer_of
from reference import rank_batch, small_model


_model = small_model
_batch = rank_batch


def _reference_train(steps, n, lr, momentum, passes=1):
    """Plain torch on one process: the gradient is the mean of every rank's gradient."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    for step in range(steps):
        opt.zero_grad()
        for r in range(n):
            for k in range(passes):
                x, y = _batch(r, step * passes + k)
                (torch.nn.functional.cross_entropy(model(x), y) / n).backward()
        opt.step()
    return model


def _train(steps, lr, momentum, passes=1, **kwargs):
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum),
                                   named_parameters=model.named_parameters(), backward_passes_per_step=passes,
                                   **kwargs)
    for step in range(steps):
        opt.zero_grad()
        for k in range(passes):
            x, y = _batch(hvd.rank(), step * passes + k)
            torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model, opt


def _assert_same_everywhere(model):
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = hvd.allgather(flat.unsqueeze(0))
    for r in range(hvd.size()):
        assert torch.equal(everyone[r], flat), "parameters differ between rank %d and rank %d" % (hvd.rank(), r)


@pytest.mark.parametrize("groups", [None, 2], ids=["buckets", "groups2"])
def test_matches_single_process_sgd(groups):
    model, _ = _train(5, 0.1, 0.9, groups=groups)
    ref = _reference_train(5, hvd.size(), 0.1, 0.9)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    _assert_same_everywhere(model)


def test_backward_passes_per_step_accumulates():
    model, _ = _train(3, 0.05, 0.0, passes=2)
    ref = _reference_train(3, hvd.size(), 0.05, 0.0, passes=2)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_fp16_compression_trains_close_to_fp32():
    model, _ = _train(3, 0.1, 0.0, compression=hvd.Compression.fp16)
    ref = _reference_train(3, hvd.size(), 0.1, 0.0)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=5e-3, atol=5e-3)
    _assert_same_everywhere(model)


def test_small_fusion_buckets_and_sum_op(monkeypatch):
    monkeypatch.setenv("STELLA_FUSION_THRESHOLD", "64")  # one bucket per parameter, read at wrap time
    from stella_mpi.core import state
    old = state.current().config
    state.current().config = type(old).from_env()
    try:
        model, opt = _train(2, 0.1, 0.0)
        assert len(opt._buckets) == 4
    finally:
        state.current().config = old
    ref = _reference_train(2, hvd.size(), 0.1, 0.0)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_gradients_reduced_during_backward():
    """Buckets go out from the hooks, before backward returns (not all at step time)."""
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), groups=4)
    x, y = _batch(hvd.rank(), 0)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    launched = [b.handle is not None for b in opt._buckets]
    assert all(launched), launched
    opt.step()


def test_synchronize_and_skip_synchronize():
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    x, y = _batch(hvd.rank(), 0)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(AssertionError, match="zero_grad"):
        opt.zero_grad()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with opt.skip_synchronize():
        opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    _assert_same_everywhere(model)


def test_named_parameters_errors():
    model = _model()
    params = list(model.named_parameters())
    with pytest.raises(ValueError, match="unique"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=[("same", p) for _, p in params])
    with pytest.raises(ValueError, match="not named"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=params[:1])
    with pytest.raises(ValueError, match="tuples"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=[p for _, p in params])


def test_broadcast_parameters_and_optimizer_state():
    torch.manual_seed(100 + hvd.rank())  # every rank starts different
    model = torch.nn.Linear(5, 4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2 * (hvd.rank() + 1))
    if hvd.rank() == 0:
        model(torch.randn(3, 5)).sum().backward()
        opt.step()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    _assert_same_everywhere(model)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2)
    state = opt.state_dict()["state"]
    steps = hvd.allgather(torch.tensor([float(state[0]["step"])]))
    assert steps.eq(steps[0]).all()
    avg = hvd.allgather(state[0]["exp_avg"].reshape(1, -1))
    assert (avg == avg[0]).all()
    named = [(n, p.detach() + hvd.rank()) for n, p in model.named_parameters()]  # differ per rank
    hvd.broadcast_parameters(named, root_rank=hvd.size() - 1)
    for (n, p), q in zip(named, model.parameters()):
        assert torch.equal(p, q.detach() + (hvd.size() - 1)), n


def _corrected_against_torch(make, steps, **kwargs):
    """Train with momentum correction at density 1 and with ``make(model)``'s torch optimizer on
    the mean gradient of every rank's batch; the parameters must agree. Returns (model, opt)."""
    n = hvd.size()
    ref = _model()
    ref_opt = make(ref)
    model = _model()
    opt = hvd.DistributedOptimizer(make(model), named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.topk(density=1.0), momentum_correction=True, **kwargs)
    for step in range(steps):
        ref_opt.zero_grad()
        for r in range(n):
            x, y = _batch(r, step)
            (torch.nn.functional.cross_entropy(ref(x), y) / n).backward()
        ref_opt.step()
        opt.zero_grad()
        x, y = _batch(hvd.rank(), step)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    return model, opt


@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_correction_at_density_one_is_dense_momentum_sgd(nesterov):
    """DGC's momentum correction: ranks keep the velocity and the sparse route carries it; at
    density 1 (everything sent) the result is dense momentum SGD's (the average of velocities is
    the velocity of the average), with weight decay and nesterov."""
    model, opt = _corrected_against_torch(
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3, nesterov=nesterov), 6)
    _assert_same_everywhere(model)
    assert opt.param_groups[0]["momentum"] == 0.9 and "momentum_buffer" not in opt.state.get(
        next(model.parameters()), {})
    saved = opt.state_dict()["stella_momentum_correction"]
    assert set(saved["velocity"]) == {name for name, _ in model.named_parameters()}


def test_momentum_correction_goes_on_after_a_checkpoint_is_loaded():
    """A checkpoint loaded mid-training (torch replaces the param-group dicts): the correction
    still finds its groups, so SGD keeps stepping without its own momentum and the run equals
    dense momentum SGD at density 1 (the previous release stepped the loaded groups with
    momentum on top of the carried velocities)."""
    n = hvd.size()
    ref = _model()
    ref_opt = _sgd(ref)
    model = _model()
    opt = hvd.DistributedOptimizer(_sgd(model), named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.topk(density=1.0))
    assert opt._mc is not None   # on by default: SGD with momentum on a sparse route
    for step in range(6):
        if step == 3:   # a new process would restore the model and the optimizer from the checkpoint
            saved = copy.deepcopy(opt.state_dict())
            restored = _model()
            restored.load_state_dict(model.state_dict())
            model = restored
            opt = hvd.DistributedOptimizer(_sgd(model), named_parameters=model.named_parameters(),
                                           compression=hvd.Compression.topk(density=1.0))
            opt.load_state_dict(saved)
        ref_opt.zero_grad()
        for r in range(n):
            x, y = _batch(r, step)
            (torch.nn.functional.cross_entropy(ref(x), y) / n).backward()
        ref_opt.step()
        _steps(model, opt, [step])
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    _assert_same_everywhere(model)


def test_momentum_correction_is_refused_where_it_means_nothing():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=emb.named_parameters(), compression=hvd.Compression.topk(0.5),
                                   momentum_correction=True)
    if hvd.size() > 1:   # raised where the bucket launches: in backward's hook, or at synchronize()
        with pytest.raises(ValueError, match="'weight' has a sparse gradient"):
            emb(torch.tensor([1, 2])).sum().backward()
            opt.synchronize()
    model = _model()
    with pytest.raises(ValueError, match="corrects SGD's momentum"):
        hvd.DistributedOptimizer(torch.optim.Adam(model.parameters()), named_parameters=model.named_parameters(),
                                 compression=hvd.Compression.topk(0.1), momentum_correction=True)
    with pytest.raises(ValueError, match="needs a sparse compression"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                 named_parameters=model.named_parameters(), momentum_correction=True)


def test_dense_below_sends_small_tensors_dense_within_the_budget():
    """dense_below: tensors smaller than it are reduced densely beside the sparse route; the others'
    density is lowered so that a step's bytes stay the compressor's budget. At density 1 the result
    is the dense one; a budget the small tensors alone exceed is refused."""
    ref, _ = _train(3, 0.1, 0.9)
    model, opt = _train(3, 0.1, 0.9, compression=hvd.Compression.topk(density=1.0), dense_below=20,
                        momentum_correction=True)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    _assert_same_everywhere(model)
    m = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
                                   compression=hvd.Compression.cacheaware(density=0.2), dense_below=20)
    # biases (16 + 3 elements) go dense; the weights (96 + 48) share what is left of the budget:
    # (0.2 * 163 * 4.25 - 19 * 4) / (144 * 4.25) bytes per entry
    assert abs(opt._route.compression.density - (0.2 * 163 * 4.25 - 19 * 4) / (144 * 4.25)) < 1e-9
    with pytest.raises(ValueError, match="cost more than the byte budget"):
        hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
                                 compression=hvd.Compression.cacheaware(density=0.01), dense_below=20)


def test_momentum_correction_keeps_uncorrected_groups_and_skipped_steps_as_they_are():
    """A group without momentum keeps its own weight decay (only corrected groups are stepped
    without it); a step skipped for a NaN on one rank leaves every velocity as it was, also those
    of buckets that went through."""
    def make(model):
        return torch.optim.SGD([{"params": [model[0].weight, model[2].weight], "momentum": 0.9},
                                {"params": [model[0].bias, model[2].bias], "momentum": 0.0, "weight_decay": 0.5}],
                               lr=0.1)
    model, opt = _corrected_against_torch(make, 3, groups=2)
    if hvd.size() < 2:
        return
    velocity = {k: v.clone() for k, v in opt._mc.velocity.items()}
    weights = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    x, y = _batch(hvd.rank(), 9)
    # the NaN enters through a tensor hook, before the bucket launches in backward (writing into
    # .grad after backward raced with a bucket already on its way)
    hook = model[2].weight.register_hook(
        lambda g: g.index_fill(0, torch.tensor([0]), float("nan")) if hvd.rank() == 1 else g)
    torch.nn.functional.cross_entropy(model(x), y).backward()   # one bucket refused; the other goes through
    hook.remove()
    opt.step()   # skipped on every rank (STELLA_NONFINITE=skip), with a warning in the log
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert set(opt._mc.velocity) == set(velocity)
    for k, v in velocity.items():
        assert torch.equal(opt._mc.velocity[k], v), k


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)


def _steps(model, opt, steps):
    """One training step of ``model`` per step number in ``steps`` (each rank its own batches)."""
    for step in steps:
        opt.zero_grad()
        x, y = _batch(hvd.rank(), step)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _train_with(make_opt, steps, after_step=None):
    model = _model()
    opt = make_opt(model)
    for step in range(steps):
        opt.zero_grad()
        x, y = _batch(hvd.rank(), step)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if after_step is not None:
            after_step(step, model, opt)
    return model, opt


@pytest.mark.parametrize("compression", ["none", "topk1", "topk1-in-LocalSteps"])
def test_local_steps_every_step_averaged_is_synchronous_training(compression):
    """hvd.LocalSteps(every=1, outer="average") with no loss in the exchange (none, or a sparse
    compressor at density 1, given to the optimizer or as LocalSteps(compression=...)) is
    synchronous momentum SGD: the mean of the clusters' velocities is the velocity of the mean
    gradient."""
    comp = hvd.Compression.none if compression == "none" else hvd.Compression.topk(density=1.0)
    own = compression.endswith("in-LocalSteps")
    ref, _ = _train_with(lambda m: hvd.DistributedOptimizer(_sgd(m), named_parameters=m.named_parameters()), 6)
    model, opt = _train_with(lambda m: hvd.DistributedOptimizer(
        _sgd(m), named_parameters=m.named_parameters(), compression=hvd.Compression.none if own else comp,
        local_steps=hvd.LocalSteps(every=1, outer="average", compression=comp if own else None)), 6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    _assert_same_everywhere(model)
    assert opt._outer.progress.exchanges == 6


@pytest.mark.parametrize("outer", ["average", "nesterov"])
def test_local_steps_clusters_drift_apart_and_meet_every_h_steps(outer):
    topo = hvd.global_process_set.topology
    seen = []

    def check(step, model, opt):
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        everyone = hvd.allgather(flat.unsqueeze(0))
        mates = topo.cluster_members[topo.cluster_id]
        assert all(torch.equal(everyone[r], flat) for r in mates)   # one model per cluster, always
        if (step + 1) % 3 == 0:
            assert all(torch.equal(everyone[r], flat) for r in range(hvd.size())), step   # met
        else:
            seen.append(any(not torch.equal(everyone[r], flat) for r in range(hvd.size())))

    model, opt = _train_with(lambda m: hvd.DistributedOptimizer(
        _sgd(m), named_parameters=m.named_parameters(), compression=hvd.Compression.topk(density=0.3),
        local_steps=hvd.LocalSteps(every=3, outer=outer, outer_lr=0.7, outer_momentum=0.9)), 7, check)
    if topo.num_clusters > 1:
        assert any(seen), "the clusters never trained apart between exchanges"
    saved = opt.state_dict()["stella_local_steps"]
    assert saved["exchanges"] == 2 and saved["local_steps"] == 1
    assert set(saved["anchor"]) == {n for n, _ in model.named_parameters()}
    assert bool(saved["outer"]["state"]) == (outer == "nesterov")   # the outer SGD's momentum buffers
    # a fresh optimizer restored from the checkpoint holds the same local-steps state
    fresh = hvd.DistributedOptimizer(_sgd(model), named_parameters=model.named_parameters(),
                                     local_steps=hvd.LocalSteps(every=3, outer=outer))
    fresh.load_state_dict(opt.state_dict())
    assert fresh._outer.progress.exchanges == 2 and fresh._outer.progress.local_steps == 1
    for name, t in saved["anchor"].items():
        assert torch.equal(fresh._outer.anchor[name], t)


def test_local_steps_state_follows_broadcast_optimizer_state():
    """Horovod's resume pattern: rank 0 loads a checkpoint and broadcasts; the local-steps
    counters, anchor and outer momentum come along (else the clusters would meet at different
    steps)."""
    model = _model()
    opt = hvd.DistributedOptimizer(_sgd(model), named_parameters=model.named_parameters(),
                                   local_steps=hvd.LocalSteps(every=4, outer="nesterov"))
    if hvd.rank() == 0:
        opt._outer.progress.local_steps, opt._outer.progress.exchanges = 2, 7
        opt._outer.anchor = {n: torch.full_like(p, 0.5) for n, p in model.named_parameters()}
        for p in model.parameters():
            opt.outer_optimizer.state[p]["momentum_buffer"] = torch.full_like(p, 0.25)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert (opt._outer.progress.local_steps, opt._outer.progress.exchanges) == (2, 7)
    assert all(bool((t == 0.5).all()) for t in opt._outer.anchor.values())
    assert all(bool((opt.outer_optimizer.state[p]["momentum_buffer"] == 0.25).all()) for p in model.parameters())


def test_local_steps_resume_after_sync_clusters_with_overlap():
    """sync_clusters(), then rank 0 loads its checkpoint and broadcasts it (Horovod's resume
    pattern): every rank forgets that it was in sync, so the next sync_clusters() runs on every
    rank (rank 0 alone would wait for the others until the deadline), and the training goes on
    with the clusters meeting at the same steps and one model after the last sync."""
    model, opt = _train_with(lambda m: hvd.DistributedOptimizer(
        _sgd(m), named_parameters=m.named_parameters(), local_steps=hvd.LocalSteps(every=2, overlap=True)), 5)
    opt.sync_clusters()
    saved = copy.deepcopy(opt.state_dict())
    if hvd.rank() == 0:
        opt.load_state_dict(saved)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    _steps(model, opt, range(5, 8))
    opt.sync_clusters()
    assert all(x == (opt._outer.progress.exchanges, opt._outer.progress.local_steps) for x in
               hvd.allgather_object((opt._outer.progress.exchanges, opt._outer.progress.local_steps)))
    _assert_same_everywhere(model)


def test_local_steps_nesterov_matches_a_reference():
    """DiLoCo's outer step against its formula. Averaging and Nesterov runs share their local
    steps, so the averaging run's result gives the exchanged mean: avg = anchor - p_average; after
    the first period m = avg and p = anchor - lr (avg + mu m)."""
    lr, mu = 0.7, 0.9
    anchor = [p.detach().clone() for p in _model().parameters()]

    def run(outer, steps):
        return _train_with(lambda m: hvd.DistributedOptimizer(
            _sgd(m), named_parameters=m.named_parameters(),
            local_steps=hvd.LocalSteps(every=2, outer=outer, outer_lr=lr, outer_momentum=mu)), steps)[0]

    avg_model, nes_model = run("average", 2), run("nesterov", 2)
    for a, pa, pn in zip(anchor, avg_model.parameters(), nes_model.parameters()):
        avg = a - pa.detach()
        torch.testing.assert_close(pn.detach(), a - lr * (avg + mu * avg), rtol=1e-5, atol=1e-6)
    _assert_same_everywhere(nes_model)


def test_local_steps_inner_rank_skips_a_non_finite_step_on_that_rank_alone():
    """A NaN in one rank's gradient (STELLA_NONFINITE=skip, the default) with each rank a replica:
    that rank's step is skipped, the other ranks step on theirs (nothing was reduced between
    them), the period's count goes on alike everywhere, and the clusters meet on finite
    parameters."""
    if hvd.size() < 2:
        pytest.skip("one rank: no other replica to go on")
    model = _model()
    opt = hvd.DistributedOptimizer(_sgd(model), named_parameters=model.named_parameters(),
                                   local_steps=hvd.LocalSteps(every=4, inner="rank"))
    _steps(model, opt, range(2))
    before = [p.detach().clone() for p in model.parameters()]
    skipped = hvd.stats()["total"]["skipped_nonfinite"]
    first = next(model.parameters())
    hook = first.register_hook(lambda g: torch.full_like(g, float("nan")) if hvd.rank() == 1 else g)
    _steps(model, opt, [2])
    hook.remove()
    moved = any(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert moved == (hvd.rank() != 1), "rank %d: step taken %s" % (hvd.rank(), moved)
    assert hvd.stats()["total"]["skipped_nonfinite"] == skipped + (hvd.rank() == 1)
    assert opt._outer.progress.local_steps == 3   # (the skipped step counted on rank 1 too)
    _steps(model, opt, [3])   # the period's end: every rank exchanges
    assert opt._outer.progress.exchanges == 1
    opt.sync_clusters()
    _assert_same_everywhere(model)
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def _outer_reference(anchor, avgs, momentum, outer, lr, mu):
    """The outer step from ``anchor`` with the mean pseudo-gradients ``avgs``: averaging, or
    DiLoCo's Nesterov (``momentum`` updated in place)."""
    new = []
    for i, (a, avg) in enumerate(zip(anchor, avgs)):
        if outer == "average":
            new.append(a - avg)
        else:
            momentum[i] = mu * momentum[i] + avg
            new.append(a - lr * (avg + mu * momentum[i]))
    return new


def _rank_replicas_reference(steps, every, outer, lr=0.7, mu=0.9):
    """LocalSteps(inner="rank") simulated in this process: one model per rank, each stepping
    on its own batch alone; every ``every`` steps the mean over all ranks of their
    pseudo-gradients goes through the outer step, and every rank takes the new anchor."""
    models = [_model() for _ in range(hvd.size())]
    opts = [_sgd(m) for m in models]
    anchor = [p.detach().clone() for p in models[0].parameters()]
    momentum = [torch.zeros_like(a) for a in anchor]
    for step in range(steps):
        for r, (m, o) in enumerate(zip(models, opts)):
            o.zero_grad()
            x, y = _batch(r, step)
            torch.nn.functional.cross_entropy(m(x), y).backward()
            o.step()
        if (step + 1) % every:
            continue
        avgs = [sum(a - list(m.parameters())[i].detach() for m in models) / hvd.size() for i, a in enumerate(anchor)]
        new = _outer_reference(anchor, avgs, momentum, outer, lr, mu)
        with torch.no_grad():
            for m in models:
                for p, nw in zip(m.parameters(), new):
                    p.copy_(nw)
        anchor = new
    return models


@pytest.mark.parametrize("outer", ["average", "nesterov"])
def test_local_steps_inner_rank_trains_each_rank_alone_and_meets_on_every_ranks_mean(outer):
    """LocalSteps(inner="rank"): no reduction at the inner steps (the ranks of a cluster drift
    apart too), and every exchange lands the outer step of the mean over all ranks, the same
    everywhere: each rank's parameters match a one-process simulation of one model per rank,
    between exchanges and after them."""
    topo = hvd.global_process_set.topology
    apart = []

    def check(step, model, opt):
        if (step + 1) % 3:
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            mates = hvd.allgather(flat.unsqueeze(0))[list(topo.cluster_members[topo.cluster_id])]
            apart.append(any(not torch.equal(m, flat) for m in mates))

    model, opt = _train_with(lambda m: hvd.DistributedOptimizer(
        _sgd(m), named_parameters=m.named_parameters(),
        local_steps=hvd.LocalSteps(every=3, outer=outer, inner="rank")), 7, check)
    assert opt.route == "rank" and opt._outer.progress.exchanges == 2
    if len(topo.cluster_members[topo.cluster_id]) > 1:   # (this rank's cluster: uneven layouts have one of one)
        assert any(apart), "the ranks of a cluster never trained apart between exchanges"
    ref = _rank_replicas_reference(7, 3, outer)[hvd.rank()]
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    opt.sync_clusters()
    _assert_same_everywhere(model)
    with pytest.raises(ValueError, match="inner='rank'"):
        hvd.DistributedOptimizer(_sgd(model), named_parameters=model.named_parameters(),
                                 adjuster=hvd.Adjuster(modes=("sync", "local")),
                                 compression=hvd.Compression.topk(0.1),
                                 local_steps=hvd.LocalSteps(every=2, inner="rank"))


def test_local_steps_inner_rank_with_delayed_fragments_meets_after_sync_clusters():
    """Streaming DiLoCo's schedule over replicas of one rank each: the delayed fragments land on
    every rank alike (checked at the end: sync_clusters() applies the exchange in flight and
    exchanges every fragment, after which every rank holds the same parameters), and the ranks of
    a cluster train apart in between."""
    topo = hvd.global_process_set.topology
    model, opt = _train_with(lambda m: hvd.DistributedOptimizer(
        _sgd(m), named_parameters=m.named_parameters(),
        local_steps=hvd.LocalSteps(every=4, outer="nesterov", fragments=2, delay=1, inner="rank")), 9)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    mates = hvd.allgather(flat.unsqueeze(0))[list(topo.cluster_members[topo.cluster_id])]
    if len(mates) > 1:
        assert any(not torch.equal(m, flat) for m in mates), "the ranks of a cluster never trained apart"
    assert opt.route == "rank"
    opt.sync_clusters()
    _assert_same_everywhere(model)


def _overlapped_reference(steps, every, outer, lr=0.7, mu=0.9):
    """LocalSteps(overlap=True) simulated in this process, one model per cluster: each steps on
    the mean gradient of its ranks' batches; at each period's end the exchange launched one
    period earlier is applied (new anchor; each cluster keeps its progress since the launch) and
    the next one is launched (optim/outer_sync.py)."""
    topo = hvd.global_process_set.topology
    clusters = topo.cluster_members
    models = [_model() for _ in clusters]
    opts = [_sgd(m) for m in models]
    anchor = [p.detach().clone() for p in models[0].parameters()]
    momentum = [torch.zeros_like(a) for a in anchor]
    pending = None
    for step in range(steps):
        for m, o, members in zip(models, opts, clusters):
            o.zero_grad()
            for r in members:
                x, y = _batch(r, step)
                (torch.nn.functional.cross_entropy(m(x), y) / len(members)).backward()
            o.step()
        if (step + 1) % every:
            continue
        if pending is not None:
            avgs = [sum(len(members) * d[i] for d, members in zip(pending, clusters)) / hvd.size()
                    for i in range(len(anchor))]
            new = _outer_reference(anchor, avgs, momentum, outer, lr, mu)
            with torch.no_grad():
                for m, d in zip(models, pending):
                    for p, a, nw, di in zip(m.parameters(), anchor, new, d):
                        p.add_(nw - a + di)
            anchor = new
        pending = [[a - p.detach().clone() for a, p in zip(anchor, m.parameters())] for m in models]
    return models, anchor


@pytest.mark.parametrize("outer", ["average", "nesterov"])
def test_local_steps_overlapped_exchange_is_applied_one_period_late(outer):
    """overlap=True against the one-process reference of its rule; the anchor is the same on
    every rank; sync_clusters() then leaves every rank with the same parameters."""
    topo = hvd.global_process_set.topology
    model, opt = _train_with(lambda m: hvd.DistributedOptimizer(
        _sgd(m), named_parameters=m.named_parameters(),
        local_steps=hvd.LocalSteps(every=2, outer=outer, outer_lr=0.7, outer_momentum=0.9, overlap=True)), 7)
    models, anchor = _overlapped_reference(7, 2, outer)
    for p, q in zip(model.parameters(), models[topo.cluster_id].parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
    for (name, _), a in zip(model.named_parameters(), anchor):
        torch.testing.assert_close(opt._outer.anchor[name], a, rtol=1e-5, atol=1e-6)
        everyone = hvd.allgather(opt._outer.anchor[name].unsqueeze(0), name="ls.anchor." + name)
        assert all(torch.equal(everyone[r], everyone[0]) for r in range(hvd.size()))
    assert opt._outer.progress.exchanges == 2 and opt._outer.channel.pending is not None   # launched at steps 2, 4, 6
    opt.sync_clusters()
    assert opt._outer.channel.pending is None and opt._outer.progress.exchanges == 4
    _assert_same_everywhere(model)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), opt._outer.anchor[name])
    before = [p.detach().clone() for p in model.parameters()]
    opt.sync_clusters()   # nothing trained since: no exchange, no outer step (Nesterov's momentum untouched)
    assert opt._outer.progress.exchanges == 4 and all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


@pytest.mark.parametrize("outer", ["average", "nesterov"])
def test_local_steps_overlap_sync_at_a_period_boundary_applies_only_what_is_in_flight(outer):
    """sync_clusters() right after a launch (nothing trained since) completes that exchange and
    runs no other: one outer step, as the reference's next application would make."""
    model, opt = _train_with(lambda m: hvd.DistributedOptimizer(
        _sgd(m), named_parameters=m.named_parameters(),
        local_steps=hvd.LocalSteps(every=2, outer=outer, overlap=True)), 4)
    assert opt._outer.progress.exchanges == 1 and opt._outer.progress.local_steps == 0 and opt._outer.channel.pending is not None
    opt.sync_clusters()
    assert opt._outer.progress.exchanges == 2 and opt._outer.channel.pending is None
    _assert_same_everywhere(model)
    consensus = opt.consensus_parameters()
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), consensus[name])


def test_local_steps_overlap_checkpoints_without_waiting_on_the_others():
    """state_dict() on one rank alone (Horovod's checkpoint pattern) does not wait for the other
    ranks; a restored optimizer drops the exchange in flight (its period goes into the next one)
    and the clusters still meet at the same steps."""
    model, opt = _train_with(lambda m: hvd.DistributedOptimizer(
        _sgd(m), named_parameters=m.named_parameters(), local_steps=hvd.LocalSteps(every=2, overlap=True)), 4)
    assert opt._outer.channel.pending is not None
    saved = opt.state_dict() if hvd.rank() == 0 else None
    if hvd.rank() == 0:
        assert saved["stella_local_steps"]["exchanges"] == 1
    saved = hvd.broadcast_object(saved, root_rank=0, name="ls.overlap.ckpt")
    opt.load_state_dict(saved)
    assert opt._outer.channel.pending is None
    _steps(model, opt, range(4, 8))
    opt.sync_clusters()
    _assert_same_everywhere(model)


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlap"])
def test_local_steps_adjuster_chooses_h_the_same_on_every_rank(overlap):
    """adjuster=hvd.Adjuster(objective="step_time") with local steps chooses H: over a slow link
    (user-space pacing of the cross-cluster sends, 0.2 s per exchange, on every rank alike) an
    exchange costs far more than these small steps. The first period is not timed from its start
    (it begins inside step 0): no decision; at the second exchange H leaves 1 for the ladder's
    top, and keeps it at the third. Every rank follows the same H at the same step, and after
    sync_clusters() holds the same model. With overlap the same: the wire takes longer than 16
    of these steps, so even the ladder's top leaves most of it to wait for."""
    from stella_mpi.comm.pacing import Pacer
    if hvd.global_process_set.topology.num_clusters < 2:
        pytest.skip("one cluster: no exchange across clusters")
    hier = hvd.global_process_set.hierarchy
    seen = []
    old, hier.pacer = hier.pacer, Pacer(bps=1e5, delay_s=0.2)
    try:
        model, opt = _train_with(lambda m: hvd.DistributedOptimizer(
            _sgd(m), named_parameters=m.named_parameters(), local_steps=hvd.LocalSteps(every=1, overlap=overlap),
            adjuster=hvd.Adjuster(objective="step_time", target=1.2, local_steps=(1, 4, 16))), 20,
            lambda step, model, opt: seen.append((step, opt.local_steps_every)))
        opt.sync_clusters()
    finally:
        hier.pacer = old
    assert seen[:3] == [(0, 1), (1, 16), (2, 16)] and seen[-1] == (19, 16), (seen, opt.local_steps_reason)
    assert opt._outer.progress.exchanges == 4   # steps 0, 1 and 17, then sync_clusters
    assert opt.local_steps_reason.startswith(("even the longest period on the ladder cannot hide the exchange",
                                              "the exchange exceeds the budget", "steady"))
    assert all(x == seen for x in hvd.allgather_object(seen))
    assert opt.state_dict()["stella_local_steps"]["every"] == 16
    _assert_same_everywhere(model)


def test_local_steps_refusals():
    model = _model()
    ls = hvd.LocalSteps(every=2)
    for kw, match in ((dict(engine=hvd.CpuEngine()), "CPU engine"), (dict(op=hvd.Sum), "op must be"),
                      (dict(compression=hvd.Compression.topk(0.1), adjuster=hvd.Adjuster()), "step-time objective only"),
                      (dict(adjuster=hvd.Adjuster(objective="step_time", allow_accumulation=True)),
                       "apply to the gradient route")):
        with pytest.raises(ValueError, match=match):
            hvd.DistributedOptimizer(_sgd(model), named_parameters=model.named_parameters(), local_steps=ls, **kw)
    with pytest.raises(ValueError, match="overlap=True sends the pseudo-gradient"):
        hvd.DistributedOptimizer(_sgd(model), named_parameters=model.named_parameters(),
                                 compression=hvd.Compression.topk(0.1),
                                 local_steps=hvd.LocalSteps(every=2, overlap=True))
    for bad, match in ((dict(every=0), "every"), (dict(every=2, outer="adam"), "outer"),
                       (dict(every=2, outer_momentum=1.0), "outer_momentum"), (dict(every=2, overlap=1), "overlap")):
        with pytest.raises(ValueError, match=match):
            hvd.LocalSteps(**bad)


@pytest.mark.parametrize("compression", ["none", "topk1"])
def test_local_clip_clips_each_rank_before_the_reduction(compression):
    """DGC's local gradient clipping: each rank's gradient is clipped to norm C / sqrt(size)
    before the reduction; against a one-process reference doing exactly that."""
    n, clip, lr = hvd.size(), 0.05, 0.1
    ref = _model()
    for step in range(3):
        total = [torch.zeros_like(p) for p in ref.parameters()]
        for r in range(n):
            ref.zero_grad()
            x, y = _batch(r, step)
            torch.nn.functional.cross_entropy(ref(x), y).backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip / n ** 0.5)
            for t, p in zip(total, ref.parameters()):
                t.add_(p.grad)
        with torch.no_grad():
            for t, p in zip(total, ref.parameters()):
                p.sub_(lr * t / n)
    comp = hvd.Compression.none if compression == "none" else hvd.Compression.topk(density=1.0)
    model, _ = _train_with(lambda m: hvd.DistributedOptimizer(
        torch.optim.SGD(m.parameters(), lr=lr), named_parameters=m.named_parameters(), compression=comp,
        local_clip=clip), 3)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    _assert_same_everywhere(model)
    with pytest.raises(ValueError, match="local_clip"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr), named_parameters=model.named_parameters(),
                                 local_clip=-1.0)


def _switching(model, pseudo=None, overlap=False, ladder=(4,), inner=_sgd, outer="average", **adjuster):
    """The optimizer that moves between the synchronous route (top-k 10 %) and local steps."""
    return hvd.DistributedOptimizer(
        inner(model), named_parameters=model.named_parameters(), compression=hvd.Compression.topk(0.1),
        local_steps=hvd.LocalSteps(every=4, overlap=overlap, compression=pseudo, outer=outer),
        adjuster=hvd.Adjuster(modes=("sync", "local"), interval=1, window=1, min_density=0.1, max_density=0.1,
                              local_steps=ladder, **adjuster))


def _adam(model):
    return torch.optim.Adam(model.parameters(), lr=0.01)


def _clusters_apart(model):
    """True when ranks of one cluster hold the same parameters and the clusters differ."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = hvd.allgather(flat.unsqueeze(0))
    topo = hvd.global_process_set.topology
    mine = list(topo.cluster_members[topo.cluster_id])
    same = all(torch.equal(everyone[r], flat) for r in mine)
    return same and any(not torch.equal(everyone[r], flat) for r in range(hvd.size()) if r not in mine)


@pytest.mark.parametrize("overlap,inner", [(False, _sgd), (True, _sgd), (False, _adam)],
                         ids=["blocking", "overlap", "adam"])
def test_mode_switch_moves_every_rank_at_the_same_step(overlap, inner):
    """Adjuster(modes=("sync", "local")): the routes really change, on every rank at the same
    step. The mode rule's comparison is forced (its synchronous score made huge, then zero; the
    rule itself is unit-tested): synchronous steps keep every rank's parameters equal; local
    steps average inside each cluster only, so the clusters drift apart between exchanges; the
    way back waits for an exchange (with overlap, for sync_clusters) and then every rank holds
    the same parameters again, and stays so (the optimizer's state, SGD's momentum or Adam's
    moments, averaged over all ranks on the way)."""
    if hvd.global_process_set.topology.num_clusters < 2:
        pytest.skip("one cluster: no exchange across clusters, nothing to switch")
    pseudo = hvd.Compression.none if overlap else hvd.Compression.fp16
    log, apart = [], []

    def watch(step, model, opt):
        log.append((step, opt.mode, opt._route.process_set.size()))
        if opt.mode == "local" and opt._outer.progress.local_steps:
            apart.append(_clusters_apart(model))
        if step == 2:
            opt._tuner.rule.sync_score = lambda est: float("inf")   # local steps win from the next decision
        if opt.mode == "sync":
            _assert_same_everywhere(model)
        if step == 30:
            opt._tuner.rule.sync_score = lambda est: 0.0            # synchronous wins again

    model, opt = _train_with(lambda m: _switching(m, pseudo, overlap, inner=inner), 60, watch)
    assert apart and all(apart), apart
    modes = [m for _, m, _ in log]
    assert "local" in modes and modes[-1] == "sync", (log, opt.mode_reason)
    first = modes.index("local")
    back = first + modes[first:].index("sync")
    assert all(size == hvd.size() for _, m, size in log if m == "sync")
    assert all(size == hvd.global_process_set.topology.cluster_size for _, m, size in log if m == "local")
    # (inside local steps the rule may also take a schedule with a delay: a switch from local to local)
    kinds = [m for i, (_, m, _) in enumerate(opt.mode_switches) if i == 0 or opt.mode_switches[i - 1][1] != m]
    assert kinds == ["local", "sync"], opt.mode_switches
    everyone = hvd.allgather_object([(s, m) for s, m, _ in opt.mode_switches])
    assert all(x == everyone[0] for x in everyone), everyone
    assert back > first + 4, log   # at least one exchange (the second period is the first timed one)
    _assert_same_everywhere(model)
    assert opt.state_dict()["stella_mode"]["mode"] == "sync"


def test_mode_switch_to_local_steps_over_a_slow_link():
    """Over a slow link (user-space pacing of the cross-cluster sends, 0.2 s each, on every rank
    alike) a synchronous step waits for the wire every step, where local steps wait for it once
    per 16 steps: the mode rule (backlog_cost 0: time alone) moves to local steps after its
    dead band (window + 2 decisions), with H=16 predicted, on every rank at the same step."""
    from stella_mpi.comm.pacing import Pacer
    if hvd.global_process_set.topology.num_clusters < 2:
        pytest.skip("one cluster: no exchange across clusters, nothing to switch")
    hier = hvd.global_process_set.hierarchy
    old, hier.pacer = hier.pacer, Pacer(bps=1e5, delay_s=0.2)
    try:
        model, opt = _train_with(lambda m: _switching(m, hvd.Compression.fp16, ladder=(1, 4, 16), backlog_cost=0.0),
                                 24)
        opt.sync_clusters()
    finally:
        hier.pacer = old
    assert [m for _, m, _ in opt.mode_switches] == ["local"], (opt.mode_switches, opt.mode_reason)
    assert opt.mode_switches[0][2].startswith("local reaches the loss sooner: local steps H=16")
    assert opt.local_steps_every == 16
    everyone = hvd.allgather_object([(s, m) for s, m, _ in opt.mode_switches])
    assert all(x == everyone[0] for x in everyone), everyone
    _assert_same_everywhere(model)


def test_mode_switch_chooses_the_pseudo_rung_on_every_rank():
    """Adjuster(pseudo_rungs=...): entering local steps the rule's best rung is taken; in local
    mode a rung that wins twice running (forced here: the rule's scores are unit-tested) is
    taken from the next period, on every rank at the same step, at the H it predicts. The
    exchange keeps its collectives' names, so THC's residual goes on as SparseLoCo's; the
    clusters meet again and the checkpoint names the rung, which a new optimizer takes."""
    if hvd.global_process_set.topology.num_clusters < 2:
        pytest.skip("one cluster: nothing to switch")
    rungs = (hvd.Compression.thc(bits=4), hvd.Compression.sparseloco(density=0.05, chunk=64, bits=2))
    seen, keys, outers = [], {}, set()

    def make(model):
        opt = _switching(model, ladder=(2, 4), pseudo_rungs=rungs)
        # the automatic route's outer step per rung (its own build is unit-tested): Nesterov for THC,
        # the clusters' sum for SparseLoCo
        opt._tuner.rung_outers = [auto_outer_of(c, hvd.global_process_set.topology.num_clusters) for c in rungs]
        return opt

    def watch(step, model, opt):
        rule = opt._tuner.rule
        seen.append((step, opt.mode, opt._tuner.pseudo.name if opt.mode == "local" else None))
        local = opt.mode == "local"   # (H and the exchanges are those of a local phase, None outside)
        assert (opt.local_steps_every is not None) == local and (opt.local_steps_exchanges is not None) == local
        if step in (2, 12):
            rule.sync_score = lambda est: float("inf")
            best = int(step == 12)   # THC's rung scores best entering local steps, SparseLoCo's from step 12

            def score(est, step_s, exchange_s, every, rung=None, delay=0, entering=False, best=best):
                return 1.0 if (rule.pseudo_index if rung is None else rung) == best else 2.0
            rule.local_score = score
        if opt.mode == "local":
            groups = [g for o in opt.outer_optimizers for g in o.param_groups]
            outers.add((opt._tuner.pseudo.name, groups[0]["lr"], groups[0]["momentum"], groups[0]["nesterov"]))
        if step in (12, 39):   # the residuals' names, before the switch of rung and at the end
            keys[step] = {k: t.numel() for k, t in hvd.core.state.current().sparse_memory._res.items()
                          if k.startswith("local_steps.")}

    model, opt = _train_with(make, 40, watch)
    used = [name for _, mode, name in seen if mode == "local"]
    assert used and used[0] == "thc" and used[-1] == "sparseloco", seen
    assert opt._outer.exchange.comp is opt._tuner.rungs[1]
    c = float(hvd.global_process_set.topology.num_clusters)
    assert outers == {("thc", 0.7, 0.9, True), ("sparseloco", c, 0.0, False)}, outers
    switches = [(s, m) for s, m, _ in opt.mode_switches]
    assert [m for _, m in switches] == ["local", "local"], opt.mode_switches
    assert "local steps through sparseloco" in opt.mode_switches[1][2], opt.mode_switches
    everyone = hvd.allgather_object(switches)
    assert all(x == everyone[0] for x in everyone), everyone
    assert "sparseloco" in opt.route
    # the residuals THC left are SparseLoCo's: the same names and sizes, no new ones (a rank that
    # sends no shard, off the leader in uneven clusters, holds none)
    assert keys[12] == keys[39], keys
    assert any(hvd.allgather_object(bool(keys[12]))), keys
    saved = opt.state_dict()
    assert saved["stella_mode"]["pseudo"] == "sparseloco 5 % 2 bits", saved["stella_mode"]
    opt.sync_clusters()
    _assert_same_everywhere(model)
    other_model = _model()
    other = make(other_model)
    other.load_state_dict(saved)
    assert other.mode == "local" and other._tuner.pseudo is other._tuner.rungs[1]
    assert other._outer.exchange.comp is other._tuner.rungs[1]
    with pytest.raises(ValueError, match="not one of this optimizer's rungs"):
        other.load_state_dict(dict(saved, stella_mode=dict(saved["stella_mode"], pseudo="thc 2 bits")))
    for kw, match in ((dict(compression=hvd.Compression.topk(0.1)), "pass modes=\\('sync', 'local'\\)"),
                      (dict(compression=hvd.Compression.topk(0.1), local_steps=hvd.LocalSteps(
                          every=2, compression=hvd.Compression.fp16), adjuster_modes=True), "given twice")):
        modes = kw.pop("adjuster_modes", False)
        adjuster = hvd.Adjuster(modes=("sync", "local") if modes else (), pseudo_rungs=rungs)
        with pytest.raises(ValueError, match=match):
            hvd.DistributedOptimizer(_sgd(model), named_parameters=model.named_parameters(), adjuster=adjuster, **kw)


def test_mode_switch_runs_the_schedule_the_rule_chooses_on_every_rank():
    """The adjuster's schedule of local steps (Streaming DiLoCo's fragments with a delay): when
    the mode rule takes one (forced here at step 12: the rule itself is unit-tested), every rank
    synchronizes the clusters and starts a phase of 2 fragments, each landing 1 step after its
    launch; its cycles are measured and fed to the rule; a checkpoint carries the schedule into
    an optimizer that runs the blocking one, and sync_clusters ends both with the same
    parameters everywhere. The outer momentum (DiLoCo's Nesterov here) goes on into the new
    fragments. (Schedules are offered where no inner step reduces on the collective
    thread: a cluster of one rank reduces alone, one of several on its channel (CPU tensors), so
    they are offered in every layout here, clusters of several ranks included.)"""
    from stella_mpi.adjust.mode_rule import Schedule
    if hvd.global_process_set.topology.num_clusters < 2:
        pytest.skip("one cluster: no exchange across clusters, nothing to switch")
    seen = []

    def momenta(tuner):
        return {p: s["momentum_buffer"] for o in tuner.local.outers for p, s in o.state.items() if s}

    def watch(step, model, opt):
        tuner = opt._tuner
        if step == 2:
            tuner.rule.sync_score = lambda est: float("inf")   # local steps win from the next decision
        if step == 12:
            # (local steps entered with the schedule the rule predicted: blocking or delayed)
            assert opt.mode == "local" and "local reaches the loss sooner: local steps H=4%s" % (
                tuner.schedule.describe()) in opt.mode_switches[-1][2], opt.mode_switches
            before = momenta(tuner)
            assert len(before) == len(list(model.parameters())), "an outer step by step 12 holds a momentum"
            tuner.rule.predicted_schedule = Schedule(2, 1)
            tuner._take_rung(8)
            _assert_same_everywhere(model)   # (the phase starts from the clusters' agreed parameters)
            after = momenta(tuner)
            # every parameter's momentum kept (the exchange of sync_clusters stepped it once more)
            assert set(after) == set(before) and len(tuner.local.fragments) == 2
        if step > 12:
            seen.append((tuner.schedule, opt._outer.progress.local_steps, _clusters_apart(model)))

    def offered(m):
        opt = _switching(m, hvd.Compression.fp16, outer="nesterov")
        assert opt._tuner.rule.schedules and opt._tuner.local.schedules_chosen
        return opt

    model, opt = _train_with(offered, 30, watch)
    tuner = opt._tuner
    # a fragment holds at least one parameter: a model of 2 offers F=1 and 2 only
    tiny = torch.nn.Linear(4, 2)
    assert _switching(tiny, hvd.Compression.fp16)._tuner.rule.settings.fragments == (1, 2)
    assert all(sched == Schedule(2, 1) for sched, _, _ in seen) and any(apart for _, _, apart in seen), seen
    assert len(tuner.local.fragments) == 2
    assert tuner.local.settings.mix == "progress"
    assert any("2 fragments, delay 1" in why for _, _, why in tuner.votes), list(tuner.votes)
    everyone = hvd.allgather_object([(s, m) for s, m, _ in opt.mode_switches])
    assert all(x == everyone[0] for x in everyone), everyone
    saved = opt.state_dict()
    assert saved["stella_local_steps"]["fragments"] == 2 and saved["stella_local_steps"]["delay"] == 1
    other_model = _model()
    other_model.load_state_dict(model.state_dict())
    other = offered(other_model)
    # a checkpoint refused (an anchor of another shape) leaves the optimizer as it was
    bad = copy.deepcopy(saved)
    first = next(iter(bad["stella_local_steps"]["anchor"]))
    bad["stella_local_steps"]["anchor"][first] = torch.zeros(3)
    with pytest.raises(ValueError, match="anchor of parameter"):
        other.load_state_dict(bad)
    assert other._tuner.schedule == Schedule(1, 0) and len(other._tuner.local.fragments) == 1
    bad = copy.deepcopy(saved)
    bad["stella_local_steps"]["fragments"] = 99   # (more fragments than the model has parameters)
    with pytest.raises(ValueError, match="holds the schedule every=8, fragments=99, delay=1, which does not fit"):
        other.load_state_dict(bad)
    assert other._tuner.schedule == Schedule(1, 0)
    other.load_state_dict(saved)
    assert other.mode == "local" and other._tuner.schedule == Schedule(2, 1) and other.local_steps_every == 8
    assert other._tuner.rule.predicted_schedule == Schedule(2, 1)
    for m, o in ((model, opt), (other_model, other)):
        _steps(m, o, range(30, 36))
        o.sync_clusters()
        _assert_same_everywhere(m)


def test_mode_switch_checkpoint_keeps_the_mode_and_refusals():
    if hvd.global_process_set.topology.num_clusters < 2:
        pytest.skip("one cluster: nothing to switch")
    model = _model()
    opt = _switching(model, hvd.Compression.fp16)
    opt._tuner.rule.sync_score = lambda est: float("inf")
    _steps(model, opt, range(8))
    assert opt.mode == "local"
    saved = opt.state_dict()
    assert saved["stella_mode"]["mode"] == "local" and "stella_local_steps" in saved
    assert saved["stella_mode"]["sync_estimate"]["bandwidth_bps"] > 0
    other_model = _model()
    other = _switching(other_model, hvd.Compression.fp16)
    other.load_state_dict(saved)
    assert other.mode == "local" and other._route.process_set.size() == hvd.global_process_set.topology.cluster_size
    assert other._tuner.rule.sync_estimate == opt._tuner.rule.sync_estimate
    other._tuner.rule.sync_score = lambda est: 0.0   # it trains on after the load, and can come back
    _steps(other_model, other, range(8, 40))
    assert other.mode == "sync" and [m for _, m, _ in other.mode_switches] == ["sync"], other.mode_switches
    _assert_same_everywhere(other_model)
    opt.sync_clusters()
    # Horovod's pattern: the root loads, then broadcasts; here mid-window of a synchronous run
    # (interval 1: a telemetry gather is in flight after every step), which the way back completes
    third_model = _model()
    third = _switching(third_model, hvd.Compression.fp16)
    _steps(third_model, third, range(2))
    assert third.mode == "sync" and third._tuner.session._pending is not None
    if hvd.rank() == 0:
        third.load_state_dict(saved)
    hvd.broadcast_optimizer_state(third, root_rank=0)
    hvd.broadcast_parameters(third_model.state_dict(), root_rank=0)
    assert third.mode == "local" and third._route.process_set.size() == hvd.global_process_set.topology.cluster_size
    third._tuner.rule.sync_score = lambda est: 0.0
    _steps(third_model, third, range(2, 30))
    assert third.mode == "sync"
    decided = len(third.adjust_decisions)
    _steps(third_model, third, range(30, 36))   # the session, resumed, decides again
    assert len(third.adjust_decisions) > decided
    _assert_same_everywhere(third_model)
    with pytest.raises(ValueError, match="stella_mode must be"):
        other.load_state_dict(dict(saved, stella_mode="fast"))
    bad = dict(saved["stella_mode"]["sync_estimate"], bandwidth_bps=float("nan"))
    with pytest.raises(ValueError, match="sync_estimate must hold the numbers"):
        other.load_state_dict(dict(saved, stella_mode={"mode": "local", "sync_estimate": bad}))
    sparse = hvd.Compression.topk(0.1)
    modes = hvd.Adjuster(modes=("sync", "local"))
    for kw, match in ((dict(compression=hvd.Compression.thc(bits=4), local_steps=hvd.LocalSteps(every=2)),
                       "must be sparse"),
                      (dict(compression=sparse, local_steps=hvd.LocalSteps(every=2), momentum_correction="masking"),
                       "momentum_correction='masking' is not carried"),
                      (dict(compression=sparse, local_steps=hvd.LocalSteps(every=2, overlap=True)),
                       r"pass LocalSteps\(compression=hvd.Compression.none, overlap=True\)"),
                      (dict(compression=sparse, local_steps=hvd.LocalSteps(every=2), op=hvd.Sum), "op must be"),
                      (dict(compression=sparse, local_steps=2), "pass an hvd.LocalSteps")):
        with pytest.raises(ValueError, match=match):
            hvd.DistributedOptimizer(_sgd(model), named_parameters=model.named_parameters(), adjuster=modes, **kw)
    with pytest.raises(ValueError, match="allow_accumulation and batch_split are not carried"):
        hvd.DistributedOptimizer(_sgd(model), named_parameters=model.named_parameters(), compression=sparse,
                                 local_steps=hvd.LocalSteps(every=2),
                                 adjuster=hvd.Adjuster(modes=("sync", "local"), allow_accumulation=True))
    with pytest.raises(ValueError, match="LocalSteps: compression must be an hvd.Compression"):
        hvd.LocalSteps(every=2, compression="fp16")
    with pytest.raises(ValueError, match="pass one"):
        hvd.DistributedOptimizer(_sgd(model), named_parameters=model.named_parameters(),
                                 compression=hvd.Compression.fp16,
                                 local_steps=hvd.LocalSteps(every=2, compression=hvd.Compression.fp16))


def test_mode_switch_with_one_cluster_stays_synchronous():
    """One cluster: nothing crosses a WAN, so there is no adjuster session and nothing to
    switch: the optimizer is the synchronous one (every rank the same parameters)."""
    if hvd.global_process_set.topology.num_clusters > 1:
        pytest.skip("several clusters: the switching tests above")
    model, opt = _train_with(lambda m: _switching(m, hvd.Compression.fp16), 6)
    opt.sync_clusters()
    assert opt.mode == "sync" and opt.mode_switches == [] and opt.adjust_decisions == []
    assert opt.state_dict()["stella_mode"] == {"mode": "sync", "sync_estimate": None, "pseudo": "fp16",
                                               "inner": "cluster"}
    _assert_same_everywhere(model)


CHECKPOINTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "data", "checkpoints_0.1.0")


def _previous(name):
    """A checkpoint saved by stella_mpi 0.1.0's own code (tests/data/checkpoints_0.1.0/make.py):
    {"model": ..., "optimizer": ...} of rank 0 of a 2-cluster job."""
    return torch.load(os.path.join(CHECKPOINTS, name + ".pt"), weights_only=True)


def test_checkpoints_of_the_previous_release_load():
    """Horovod's resume pattern (every rank loads the file) with checkpoints of 0.1.0's layout:
    local steps' anchor and outer momentum by name (now the outer SGD's momentum buffers), the
    mode of the switching optimizer, momentum correction's velocities, the CPU engine's state;
    each trains on afterwards."""
    saved = _previous("local_steps_nesterov")
    model = _model()
    model.load_state_dict(saved["model"])
    opt = hvd.DistributedOptimizer(_sgd(model), named_parameters=model.named_parameters(),
                                   local_steps=hvd.LocalSteps(every=3, outer="nesterov"))
    opt.load_state_dict(saved["optimizer"])
    old = saved["optimizer"]["stella_local_steps"]
    assert (opt._outer.progress.exchanges, opt._outer.progress.local_steps) == (old["exchanges"], old["local_steps"])
    for name, p in model.named_parameters():
        assert torch.equal(opt._outer.anchor[name], old["anchor"][name])
        assert torch.equal(opt.outer_optimizer.state[p]["momentum_buffer"], old["momentum"][name])
    _steps(model, opt, range(4, 7))
    opt.sync_clusters()
    _assert_same_everywhere(model)

    saved = _previous("sparse_momentum_correction")
    model = _model()
    model.load_state_dict(saved["model"])
    opt = hvd.DistributedOptimizer(_sgd(model), named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.topk(0.3))
    opt.load_state_dict(saved["optimizer"])
    velocity = saved["optimizer"]["stella_momentum_correction"]["velocity"]
    assert set(opt._mc.velocity) == set(velocity) and all(torch.equal(opt._mc.velocity[n], v)
                                                          for n, v in velocity.items())
    _steps(model, opt, range(3, 5))
    _assert_same_everywhere(model)

    saved = _previous("mode_switch_local")
    model = _model()
    model.load_state_dict(saved["model"])
    opt = _switching(model, hvd.Compression.fp16)
    opt.load_state_dict(saved["optimizer"])
    clusters = hvd.global_process_set.topology.num_clusters
    assert opt.mode == ("local" if clusters > 1 else "sync")   # (one cluster: nothing to switch)
    if clusters > 1:
        assert opt._tuner.rule.sync_estimate.bandwidth_bps == \
            saved["optimizer"]["stella_mode"]["sync_estimate"]["bandwidth_bps"]
    _steps(model, opt, range(8, 12))
    opt.sync_clusters()

    if not hvd.global_process_set.topology.uniform_clusters:
        return   # (the CPU engine needs clusters of equal size)
    saved = _previous("cpu_engine")
    model = _model()
    opt = hvd.DistributedOptimizer(_sgd(model), named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.topk(0.5, momentum_correction=True),
                                   engine=hvd.CpuEngine(staleness=1, warmup=0, model=model))
    opt.load_state_dict(saved["optimizer"])
    for p, q in zip(model.parameters(), saved["model"].values()):
        assert torch.equal(p.detach(), q)   # the master weights are put in the model
    assert opt._route._steps == saved["optimizer"]["steps"]
    _steps(model, opt, range(3, 5))
    opt.drain()
    _assert_same_everywhere(model)


def test_local_steps_with_a_sparseloco_pseudo_gradient_meet_on_the_same_parameters():
    torch.manual_seed(0)
    model = small_model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    comp = hvd.Compression.sparseloco(density=0.05, chunk=64, bits=2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   local_steps=hvd.LocalSteps(every=3, outer="nesterov", compression=comp))
    for step in range(9):
        opt.zero_grad()
        x, y = rank_batch(hvd.rank(), step)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    assert opt._outer.progress.exchanges == 3
    opt.sync_clusters()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).unsqueeze(0)
    everyone = hvd.allgather(flat, name="chunked.local.check")
    assert all(torch.equal(everyone[0], everyone[r]) for r in range(hvd.size()))
    assert all(torch.isfinite(everyone[0]))


@pytest.mark.auto_route
@pytest.mark.parametrize("inner", ["sgd", "adam"])
def test_the_automatic_route_scores_h_with_the_outer_steps_period_cost(inner):
    """The automatic route's THC rung steps by DiLoCo's Nesterov under SGD, by averaging under
    Adam (optim/tuning.py's auto_outer_of): its rung carries that outer step's measured period
    cost (outer_period_cost, average_period_cost), SparseLoCo's (the clusters' sum) none, but
    under SGD their measured cost from scratch as local steps are entered (entry_period) and
    later in training in local mode (later_period); in
    local mode the local-steps rule chooses H by the mode rule's score of the rung in force, and
    the outer optimizers step with that rung's hyperparameters."""
    from stella_mpi.optim.tuning import SPARSE_SUM_LATER, average_period_cost, outer_period_cost, sparse_period_cost
    if hvd.global_process_set.topology.num_clusters < 2:
        pytest.skip("one cluster: no automatic route across clusters")
    seen, outers = [], set()

    def make(model):
        base = _sgd(model) if inner == "sgd" else torch.optim.Adam(model.parameters(), lr=1e-3)
        return hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                        adjuster=hvd.Adjuster(interval=1, window=1))

    def watch(step, model, opt):
        rule = opt._tuner.rule
        if step == 2:
            rule.sync_score = lambda est: float("inf")   # local steps win from the next decision
        if opt.mode == "local":
            score = opt._tuner.local.rule.score
            seen.append((opt._tuner.pseudo.name, score(0.05, 0.02, 16) == rule.local_score(
                rule.sync_estimate, 0.05, 0.02, 16)))
            outers.update((opt._tuner.pseudo.name, g["lr"], g["momentum"], g["nesterov"])
                          for o in opt.outer_optimizers for g in o.param_groups)

    model, opt = _train_with(make, 16, watch)
    rungs = opt._tuner.rule.pseudo
    thc_period = outer_period_cost if inner == "sgd" else average_period_cost
    assert [r.period for r in rungs] == [thc_period, None, None], rungs
    assert rungs[0].entry_period is None and rungs[0].later_period is None
    for r, density in zip(rungs[1:], (0.01, 0.03)):
        if inner == "sgd":
            assert [r.entry_period(h) for h in (2, 8, 64)] == [sparse_period_cost(density)(h) for h in (2, 8, 64)]
            assert [r.later_period(h) for h in (2, 8, 64)] == [sparse_period_cost(density, SPARSE_SUM_LATER)(h)
                                                                for h in (2, 8, 64)]
        else:
            assert r.entry_period is None and r.later_period is None, r
    assert seen and all(same for _, same in seen), seen
    thc = {"sgd": (0.7, 0.9, True), "adam": (1.0, 0.0, False)}[inner]
    clusters = float(hvd.global_process_set.topology.num_clusters)
    assert outers and all(tuple(hp) == (thc if name.startswith("thc") else (clusters, 0.0, False))
                          for name, *hp in outers), outers
    opt.sync_clusters()
    _assert_same_everywhere(model)


@pytest.mark.auto_route
@pytest.mark.parametrize("channel", [True, False], ids=["channel", "negotiated"])
def test_the_automatic_route_makes_each_rank_a_replica_where_the_clusters_reductions_cost(channel):
    """The automatic route's local steps measure the share of each rank's time spent in its
    cluster's reductions (the route's busy seconds over the wall time since the last gather,
    whether the cluster's channel or the negotiation carries them, as it does for CUDA tensors),
    gathered with the period's times, the first period of the phase included. Where the slowest
    rank's share passes the dead band (forced here on every rank alike: the share's threshold
    is the adjuster's hysteresis, unit-sized), every rank moves to its own replica at the same
    step, the end of the first period: inner steps reduce nothing from then on (the ranks of a
    cluster train apart), the clusters still meet on the same parameters, and the checkpoint
    carries the choice into a new optimizer."""
    if hvd.global_process_set.topology.num_clusters < 2:
        pytest.skip("one cluster: no automatic route across clusters")
    topo = hvd.global_process_set.topology
    log, busy, shares, apart, periods = [], [], [], [], []

    def make(model):
        opt = hvd.DistributedOptimizer(_sgd(model), named_parameters=model.named_parameters(),
                                       adjuster=hvd.Adjuster(interval=1, window=1, local_steps=(4,)))
        if not channel:   # (every rank alike) the cluster reduces through the negotiation
            opt._tuner._cluster_dense.channel = None
        return opt

    def watch(step, model, opt):
        tuner = opt._tuner
        if step == 2:
            tuner.rule.sync_score = lambda est: float("inf")   # local steps win from the next decision
            measure = tuner.local.inner_busy
            # the share each gather measured, then all of the time in the cluster's reductions
            tuner.local.inner_busy = lambda: (shares.append(measure()), 1.0)[1]
            tuner.local.inner_busy_share = 1.0   # a share left from an earlier phase: dropped at entering
            tuner._predicted_inner_share = lambda: None   # (not chosen at entering: the first period measures)
        if opt.mode == "local" and not periods:
            periods.append(opt._outer.progress.every)
        if opt.mode == "local" and tuner.inner == "cluster":
            busy.append(tuner._cluster_dense.busy_s)
        if tuner.inner == "rank" and opt._outer.progress.local_steps:
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            apart.append(any(not torch.equal(m, flat) for m in
                             hvd.allgather(flat.unsqueeze(0))[list(topo.cluster_members[topo.cluster_id])]))
        log.append((opt._step_count, opt.mode, tuner.inner, opt._route.kind))

    model, opt = _train_with(make, 30, watch)
    assert busy and shares, log
    if len(topo.cluster_members[topo.cluster_id]) > 1:   # (reductions only where this rank's cluster has several)
        assert busy[-1] > 0, busy
        assert 0 < shares[0] < 1, shares
        assert apart and any(apart), log
    first = [s for s, _, inner, _ in log if inner == "rank"]
    assert first, (log, opt.mode_reason)
    entered = [s for s, mode, _, _ in log if mode == "local"][0]   # (the step whose decision entered)
    assert first[0] == entered + periods[0], (entered, periods, first, log)   # the first period's gather decided
    assert all(kind == "rank" for _, mode, inner, kind in log if inner == "rank" and mode == "local"), log
    everyone = hvd.allgather_object(first[0])
    assert all(x == everyone[0] for x in everyone), everyone
    assert any("each rank a replica" in why for _, _, why in opt.route_changes), opt.route_changes
    opt.sync_clusters()
    _assert_same_everywhere(model)
    saved = opt.state_dict()
    assert saved["stella_mode"]["inner"] == "rank"
    fresh = make(_model())
    fresh.load_state_dict(saved)
    assert fresh._tuner.inner == "rank" and (fresh.mode != "local" or fresh._route.kind == "rank")
    # the share is measured from the load on (none carried over)
    assert fresh._tuner._busy_mark is not None and fresh._tuner.local.inner_busy_share is None
    with pytest.raises(ValueError, match="inner must be one of cluster, rank"):
        fresh.load_state_dict(dict(saved, stella_mode=dict(saved["stella_mode"], inner="node")))


@pytest.mark.auto_route
def test_the_automatic_route_makes_each_rank_a_replica_as_it_enters_from_the_synchronous_steps():
    """The synchronous steps time the hierarchy's stages inside each cluster (the ``intra_s``
    counter), and the adjuster's gathered telemetry carries them: the slowest rank's, the same
    on every rank. Where they take the dead band's share of a local step's predicted time
    (forced here: no dead band), every rank is a replica from the first local step, with no
    period of local steps spent measuring it; the clusters still meet on the same parameters."""
    if hvd.global_process_set.topology.num_clusters < 2:
        pytest.skip("one cluster: no automatic route across clusters")
    topo = hvd.global_process_set.topology
    log = []

    def make(model):
        return hvd.DistributedOptimizer(_sgd(model), named_parameters=model.named_parameters(),
                                        adjuster=hvd.Adjuster(interval=1, window=1, local_steps=(4,), hysteresis=0.0))

    def watch(step, model, opt):
        if step == 2:
            opt._tuner.rule.sync_score = lambda est: float("inf")   # local steps win from the next decision
        log.append((opt._step_count, opt.mode, opt._tuner.inner, opt._route.kind))

    model, opt = _train_with(make, 16, watch)
    entered = [s for s, mode, _, _ in log if mode == "local"]
    assert entered, log
    assert all(inner == "rank" and kind == "rank" for _, mode, inner, kind in log if mode == "local"), log
    est = opt._tuner.rule.sync_estimate
    everyone = hvd.allgather_object((entered[0], est.intra_s))
    assert all(x == everyone[0] for x in everyone), everyone
    if max(len(m) for m in topo.cluster_members) > 1:   # (a cluster of several ranks reduced inside)
        assert est.intra_s > 0, est
    why = [why for s, _, why in opt.route_changes if s == entered[0]]
    assert why and "each rank a replica" in why[0] and "in the synchronous steps" in why[0], opt.route_changes
    if len(topo.cluster_members[topo.cluster_id]) > 1:   # (this rank's own counter: hvd.stats())
        assert hvd.stats()["total"]["intra_s"] > 0
    opt.sync_clusters()
    _assert_same_everywhere(model)
