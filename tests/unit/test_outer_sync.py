"""The outer synchronization of local steps (stella_mpi/optim/outer_sync.py) as a strategy, in
one process: two clusters simulated by two models trained in two threads, their pseudo-gradient
exchange the mean of both clusters' deltas (a barrier between the threads: what the allreduce
over all ranks computes for two clusters of equal size). Checked against the formulas of model
averaging and DiLoCo, with any torch optimizer as the outer step, its state_dict and an LR
scheduler, the checkpoint of the previous layout, and the refusals."""
import copy
import threading

import pytest
import torch

from stella_mpi.base.errors import NonFiniteGradientError
from stella_mpi.optim import outer_sync
from stella_mpi.optim.outer_sync import LocalSteps, LocalStepsSync, NoOuterSync


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def _batch(cluster, step):
    g = torch.Generator().manual_seed(1000 * cluster + step)
    x = torch.randn(16, 5, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


class _Exchange:
    """One cluster's side of the simulated exchange as optim/tuning.py's PseudoGradientExchange
    is used: ``launch`` notes (step, "launch", fragment) and keeps the deltas, ``wait`` notes
    (step, "land", fragment) and meets the other cluster (the mean); ``fragment(i)`` is
    fragment i's."""

    def __init__(self, two, cluster, index=None):
        self.two, self.cluster, self.index = two, cluster, index

    def fragment(self, index, count=None):
        return _Exchange(self.two, self.cluster, index)

    def __call__(self, deltas):
        return self.wait(self.launch(deltas))

    def launch(self, deltas):
        self.two.events[self.cluster].append((self.two.step[self.cluster], "launch", self.index))
        return deltas

    def wait(self, pending):
        self.two.events[self.cluster].append((self.two.step[self.cluster], "land", self.index))
        return self.two.exchange(self.cluster, pending)

    def drop(self, pending):
        self.two.events[self.cluster].append((self.two.step[self.cluster], "drop", self.index))


class TwoClusters:
    """Two clusters, each one model with its inner SGD and its LocalStepsSync; ``exchange`` is
    the mean of the two clusters' pseudo-gradients (threads meet at a barrier)."""

    def __init__(self, settings, inner=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)):
        self.models = [_model(), _model()]
        self.inner = [inner(m.parameters()) for m in self.models]
        self.barrier = threading.Barrier(2)
        self.sent = [None, None]
        self.step = [None, None]        # the step each cluster is at
        self.events = [[], []]          # [(step, "launch" | "land" | "drop", fragment)] of each cluster
        self.changed = [{}, {}]         # {step: names of the parameters its boundary (after_step) changed}
        self.syncs = [LocalStepsSync(settings, list(m.named_parameters()), _Exchange(self, c),
                                     drop_nonfinite_state=self._dropper(c))
                      for c, m in enumerate(self.models)]

    def _dropper(self, cluster):
        def drop():   # what the optimizer's does (optim/tuning.py): the inner state that is not finite
            opt, dropped = self.inner[cluster], []
            for p in list(opt.state):
                if any(torch.is_tensor(t) and not bool(torch.isfinite(t).all()) for t in opt.state[p].values()):
                    opt.state[p] = {}
                    dropped.append("a parameter of shape %s" % list(p.shape))
            return dropped
        return drop

    def exchange(self, cluster, deltas):
        self.sent[cluster] = [d.clone() for d in deltas]
        self.barrier.wait()
        mean = [(a + b) / 2 for a, b in zip(*self.sent)]
        finite = all(bool(torch.isfinite(d).all()) for sent in self.sent for d in sent)
        self.barrier.wait()   # both read before the next exchange overwrites
        if not finite:   # what the allreduce's agreement does: refused on every rank
            raise NonFiniteGradientError("rank %d: a non-finite gradient (NaN or Inf) in the exchange" % cluster)
        return mean

    def train(self, steps, start=0, skip=(), poison=(), skip_nonfinite=False, poisoned=lambda m: m[0].weight):
        """``skip``: (cluster, step) pairs whose step is skipped and never reaches ``step()``
        (GradScaler's pattern); ``poison``: (cluster, step) pairs after whose update the
        cluster's ``poisoned`` parameter (the first weight) gets a NaN; ``skip_nonfinite``: a
        step whose gradients are not finite is skipped too (what the cluster's reduction does
        under STELLA_NONFINITE=skip)."""
        def run(c):
            model, opt, sync = self.models[c], self.inner[c], self.syncs[c]
            for step in range(start, start + steps):
                self.step[c] = step
                sync.before_synchronize()
                opt.zero_grad()
                x, y = _batch(c, step)
                torch.nn.functional.cross_entropy(model(x), y).backward()
                skipped = (c, step) in skip or (skip_nonfinite and not all(
                    bool(torch.isfinite(p.grad).all()) for p in model.parameters()))
                sync.step_closed(skipped=skipped)
                if skipped:
                    continue
                sync.before_step()
                opt.step()
                if (c, step) in poison:
                    with torch.no_grad():
                        poisoned(model).view(-1)[0] = float("nan")
                before = {n: p.detach().clone() for n, p in model.named_parameters()}
                sync.after_step()
                self.changed[c][step] = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
        threads = [threading.Thread(target=run, args=(c,)) for c in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads)


def _inner_steps(model, opt, cluster, steps):
    for step in steps:
        opt.zero_grad()
        x, y = _batch(cluster, step)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _reference(outer_update, every, periods):
    """The same training written out: each cluster's inner steps from the anchor, then
    ``outer_update(anchor, mean delta, state)`` for the new anchor, both clusters from it."""
    models = [_model(), _model()]
    inners = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    anchor = [p.detach().clone() for p in models[0].parameters()]
    state = {}
    for k in range(periods):
        for c in (0, 1):
            _inner_steps(models[c], inners[c], c, range(k * every, (k + 1) * every))
        deltas = [[a - p.detach() for a, p in zip(anchor, m.parameters())] for m in models]
        mean = [(x + y) / 2 for x, y in zip(*deltas)]
        anchor = outer_update(anchor, mean, state)
        for m in models:
            with torch.no_grad():
                for p, a in zip(m.parameters(), anchor):
                    p.copy_(a)
    return anchor


def test_average_is_model_averaging_every_h_steps():
    two = TwoClusters(LocalSteps(every=3))
    two.train(9)
    want = _reference(lambda anchor, mean, state: [a - m for a, m in zip(anchor, mean)], 3, 3)
    for model in two.models:
        for p, w in zip(model.parameters(), want):
            torch.testing.assert_close(p.detach(), w, rtol=1e-6, atol=1e-7)
    assert [s.progress.exchanges for s in two.syncs] == [3, 3]
    assert all(s.progress.local_steps == 0 for s in two.syncs)


def test_the_clusters_train_apart_between_exchanges():
    two = TwoClusters(LocalSteps(every=4))
    two.train(2)
    a, b = (torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in two.models)
    assert not torch.equal(a, b)
    assert all(s.progress.local_steps == 2 for s in two.syncs)
    threads = [threading.Thread(target=s.sync_clusters) for s in two.syncs]   # the steps since the last exchange
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    a, b = (torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in two.models)
    assert torch.equal(a, b) and all(s.progress.exchanges == 1 for s in two.syncs)


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_a_skipped_step_counts_and_a_skipped_last_step_exchanges_at_once():
    """Cluster 1 skips step 1 (inside the first period) and step 3 (the last of the second) and
    never calls step() there: both clusters still exchange after steps 1 and 3."""
    two = TwoClusters(LocalSteps(every=2))
    two.train(4, skip={(1, 1), (1, 3)})
    assert [s.progress.exchanges for s in two.syncs] == [2, 2]
    assert all(s.progress.local_steps == 0 and not s.due for s in two.syncs)
    assert torch.equal(_flat(two.models[0]), _flat(two.models[1]))


def test_a_nan_in_one_cluster_is_refused_by_both_and_both_go_back_to_the_anchor(monkeypatch):
    monkeypatch.setattr(outer_sync, "_policy", lambda: "skip")
    monkeypatch.setattr(outer_sync, "_count_skip", lambda: None)
    two = TwoClusters(LocalSteps(every=2))
    two.train(2)
    agreed = _flat(two.models[0])
    two.train(2, start=2, poison={(1, 2)})
    for model, sync in zip(two.models, two.syncs):
        assert torch.equal(_flat(model), agreed)   # back at the anchor, the same on both
        assert [n for n, _ in sync.refusals] == [1] and sync.progress.exchanges == 1
    two.train(2, start=4)
    assert [s.progress.exchanges for s in two.syncs] == [2, 2]
    assert all(bool(torch.isfinite(_flat(m)).all()) for m in two.models)
    monkeypatch.setattr(outer_sync, "_policy", lambda: "raise")
    with pytest.raises(NonFiniteGradientError, match="refused on every rank"):
        two.syncs[0].drop_nonfinite_state = None
        two.syncs[0]._refused("rank 1: a NaN")


def test_nesterov_preset_is_diloco():
    lr, mu = 0.7, 0.9
    two = TwoClusters(LocalSteps(every=2, outer="nesterov", outer_lr=lr, outer_momentum=mu))
    two.train(6)

    def nesterov(anchor, mean, state):
        m = state.setdefault("m", [torch.zeros_like(a) for a in anchor])
        for i, g in enumerate(mean):
            m[i] = mu * m[i] + g
        return [a - lr * (g + mu * mi) for a, g, mi in zip(anchor, mean, m)]
    want = _reference(nesterov, 2, 3)
    for p, w in zip(two.models[0].parameters(), want):
        torch.testing.assert_close(p.detach(), w, rtol=1e-5, atol=1e-6)
    sd = two.syncs[0].state_dict()
    assert set(sd) == {"every", "local_steps", "exchanges", "anchor", "outer"}
    assert len(sd["outer"]["state"]) == 4   # one momentum buffer per parameter


def test_any_torch_optimizer_is_the_outer_step_with_its_scheduler_and_state_dict():
    """LocalSteps(outer=callable): Adam as the outer optimizer, stepped on the mean
    pseudo-gradient from the anchor; an LR scheduler on it changes the outer step; its state
    round-trips through the checkpoint."""
    two = TwoClusters(LocalSteps(every=2, outer=lambda ps: torch.optim.Adam(ps, lr=0.05)))
    scheds = [torch.optim.lr_scheduler.StepLR(s.outer, step_size=1, gamma=0.5) for s in two.syncs]
    two.train(2)
    for sch in scheds:
        sch.step()
    two.train(2, start=2)
    assert [s.outer.param_groups[0]["lr"] for s in two.syncs] == [0.025, 0.025]

    # the reference: Adam over the anchor's tensors, fed the mean pseudo-gradient, lr halved after one step
    anchor_model = _model()
    adam = torch.optim.Adam(anchor_model.parameters(), lr=0.05)

    def adam_outer(anchor, mean, state):
        with torch.no_grad():
            for p, a in zip(anchor_model.parameters(), anchor):
                p.copy_(a)
        for p, g in zip(anchor_model.parameters(), mean):
            p.grad = g.clone()
        adam.step()
        state["k"] = state.get("k", 0) + 1
        if state["k"] == 1:
            adam.param_groups[0]["lr"] = 0.025
        return [p.detach().clone() for p in anchor_model.parameters()]
    want = _reference(adam_outer, 2, 2)
    for p, w in zip(two.models[1].parameters(), want):
        torch.testing.assert_close(p.detach(), w, rtol=1e-5, atol=1e-6)
    # the outer optimizer's state_dict goes with the checkpoint and comes back
    saved = copy.deepcopy(two.syncs[0].state_dict())
    fresh = LocalStepsSync(LocalSteps(every=2, outer=lambda ps: torch.optim.Adam(ps, lr=0.05)),
                           list(two.models[0].named_parameters()), exchange=None)
    fresh.load_state_dict(saved)
    assert fresh.outer.state_dict()["state"][0]["step"] == saved["outer"]["state"][0]["step"] == 2
    assert fresh.outer.param_groups[0]["lr"] == 0.025 and fresh.progress.exchanges == 2


def test_an_optimizer_instance_over_the_models_parameters():
    model = _model()
    outer = torch.optim.SGD(model.parameters(), lr=1.0)
    sync = LocalStepsSync(LocalSteps(every=1, outer=outer), list(model.named_parameters()), exchange=None)
    assert sync.outer is outer
    other = _model()
    with pytest.raises(ValueError, match="it lacks 0.bias, 0.weight"):
        LocalStepsSync(LocalSteps(every=1, outer=torch.optim.SGD(list(other[2].parameters()) +
                                                                 list(model[2].parameters()), lr=1.0)),
                       list(model.named_parameters()), exchange=None)
    with pytest.raises(ValueError, match="must return a torch.optim.Optimizer"):
        LocalStepsSync(LocalSteps(every=1, outer=lambda ps: "sgd"), list(model.named_parameters()), exchange=None)


def test_the_sum_preset_steps_by_the_number_of_clusters():
    """outer="sum": SGD at lr C, so the mean pseudo-gradient of C equal clusters moves the
    anchor by their sum (an entry one cluster's sparse selection sent is not halved)."""
    model = _model()
    named = list(model.named_parameters())
    for clusters in (1, 2, 3):
        sync = LocalStepsSync(LocalSteps(every=2, outer="sum", fragments=2), named, exchange=None, clusters=clusters)
        assert [g["lr"] for o in sync.outers for g in o.param_groups] == [float(clusters)] * 2
        assert all(g["momentum"] == 0 for o in sync.outers for g in o.param_groups)
    # the presets' hyperparameters, one source for the outer optimizers and the automatic route
    assert LocalSteps(every=1, outer="sum").preset_hyperparameters(3) == {"lr": 3.0, "momentum": 0.0,
                                                                           "nesterov": False}
    assert LocalSteps(every=1, outer="nesterov", outer_lr=0.5).preset_hyperparameters(3) == {
        "lr": 0.5, "momentum": 0.9, "nesterov": True}
    assert LocalSteps(every=1, outer=lambda ps: torch.optim.Adam(ps)).preset_hyperparameters() is None


def test_a_checkpoint_of_the_previous_layout_loads():
    """The previous release saved the Nesterov preset's momentum by parameter name; it becomes
    the outer SGD's momentum buffers."""
    model = _model()
    named = list(model.named_parameters())
    sync = LocalStepsSync(LocalSteps(every=4, outer="nesterov"), named, exchange=None)
    old = {"every": 4, "local_steps": 1, "exchanges": 3,
           "anchor": {n: torch.full_like(p, 0.5) for n, p in named},
           "momentum": {n: torch.full_like(p, 0.25) for n, p in named}}
    sync.load_state_dict(old)
    assert (sync.progress.local_steps, sync.progress.exchanges) == (1, 3)
    assert all(bool((sync.outer.state[p]["momentum_buffer"] == 0.25).all()) for _, p in named)
    assert all(bool((sync.anchor[n] == 0.5).all()) for n, _ in named)


def test_checkpoints_that_do_not_fit_are_refused_naming_the_parameter():
    model = _model()
    named = list(model.named_parameters())
    sync = LocalStepsSync(LocalSteps(every=4), named, exchange=None)
    good = {"every": 4, "local_steps": 0, "exchanges": 0, "anchor": {n: p.detach().clone() for n, p in named}}
    with pytest.raises(ValueError, match=r"anchor names \['body.weight'\]"):
        sync.load_state_dict(dict(good, anchor=dict(good["anchor"], **{"body.weight": torch.zeros(1)})))
    with pytest.raises(ValueError, match=r"anchor of parameter '0.weight' has shape \[3\], the parameter \[7, 5\]"):
        sync.load_state_dict(dict(good, anchor=dict(good["anchor"], **{"0.weight": torch.zeros(3)})))
    with pytest.raises(ValueError, match="has no 'exchanges'"):
        sync.load_state_dict({k: v for k, v in good.items() if k != "exchanges"})
    sync.load_state_dict(good)


def test_settings_are_checked_where_they_are_given():
    for bad, match in ((dict(every=0), "every"), (dict(every=2, outer="adam"), "outer must be one of"),
                       (dict(every=2, outer_momentum=1.0), "outer_momentum"), (dict(every=2, overlap=1), "overlap"),
                       (dict(every=2, compression="fp16"), "compression must be an hvd.Compression")):
        with pytest.raises(ValueError, match=match):
            LocalSteps(**bad)
    assert NoOuterSync().after_step() is None and NoOuterSync().kind == "none"


# ---------------------------------------------------------------- fragments (Streaming DiLoCo)

# _model's parameters in order: 0.weight (35 elements), 0.bias (7), 2.weight (21), 2.bias (3)
NAMES = ["0.weight", "0.bias", "2.weight", "2.bias"]
CUTS = {2: [["0.weight"], ["0.bias", "2.weight", "2.bias"]], 4: [[n] for n in NAMES]}


def _exact_reference(outer, every, periods):
    """LocalSteps(every) written out with the very operations of the exchange of before
    fragments: each cluster's pseudo-gradient anchor - params, their mean (a + b) / 2, the outer
    torch optimizer stepped from the anchor with the mean as its gradient, both clusters from it."""
    models = [_model(), _model()]
    inners = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    anchor_model = _model()
    opt = outer(list(anchor_model.parameters()))
    for k in range(periods):
        for c in (0, 1):
            _inner_steps(models[c], inners[c], c, range(k * every, (k + 1) * every))
        deltas = [[(a - p.detach()).contiguous() for a, p in zip(anchor_model.parameters(), m.parameters())]
                  for m in models]
        with torch.no_grad():
            for a, d0, d1 in zip(anchor_model.parameters(), *deltas):
                a.grad = (d0 + d1) / 2
            opt.step()
            for m in models:
                for p, a in zip(m.parameters(), anchor_model.parameters()):
                    p.copy_(a)
    return [p.detach() for p in anchor_model.parameters()]


@pytest.mark.parametrize("outer", ["average", "nesterov"])
def test_one_fragment_without_a_delay_is_the_whole_model_exchange_bit_for_bit(outer):
    two = TwoClusters(LocalSteps(every=3, outer=outer, fragments=1, delay=0, mix=0.0))
    two.train(9)
    presets = {"average": lambda ps: torch.optim.SGD(ps, lr=1.0),
               "nesterov": lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True)}
    want = _exact_reference(presets[outer], 3, 3)
    for model in two.models:
        assert all(torch.equal(p.detach(), w) for p, w in zip(model.parameters(), want))
    assert two.events[0] == [(s, what, None) for s in (2, 5, 8) for what in ("launch", "land")]
    assert set(two.syncs[0].state_dict()) == {"every", "local_steps", "exchanges", "anchor", "outer"}


def test_fragments_are_cut_balanced_in_the_optimizers_order_or_by_name():
    from stella_mpi.optim.fragments import balanced_cut, plan_fragments
    assert balanced_cut([1] * 10, 3) == [3, 7]            # 3, 4, 3
    assert balanced_cut([10, 1, 1, 1, 10], 2) == [2]     # 11 and 12
    assert balanced_cut([100, 1, 1], 3) == [1, 2]         # each fragment holds a parameter
    named = list(_model().named_parameters())
    for f, want in CUTS.items():
        assert [[n for n, _ in part] for part in plan_fragments(named, f)] == want
    # named groups: in the optimizer's order inside each fragment
    parts = plan_fragments(named, 2, [["2.bias", "0.weight"], ["2.weight", "0.bias"]])
    assert [[n for n, _ in part] for part in parts] == [["0.weight", "2.bias"], ["0.bias", "2.weight"]]
    sync = LocalStepsSync(LocalSteps(every=4, fragments=2), named, exchange=None)
    assert [f.describe() for f in sync.fragments] == ["fragment 0 of 2 (0.weight)",
                                                     "fragment 1 of 2 (0.bias to 2.bias)"]
    with pytest.raises(ValueError, match="one outer optimizer per fragment: use outers"):
        sync.outer


def _schedule(every, fragments, delay, steps):
    """[(step, "launch" | "land", fragment)]: fragment f launched at the end of local step t
    (counted from 1) where (t - f*H/F) % H == 0, landed ``delay`` steps later."""
    slot, out = every // fragments, []
    for s in range(steps):
        out += [(s, "land", f) for s0, what, f in list(out) if what == "launch" and s0 + delay == s and delay]
        if (s + 1) % slot == 0:
            f = ((s + 1) % every) // slot
            out += [(s, "launch", f)] + ([(s, "land", f)] if delay == 0 else [])
    return out


@pytest.mark.parametrize("fragments,every,delay", [(2, 4, 0), (2, 4, 1), (4, 8, 0), (4, 8, 1)])
def test_each_fragment_is_exchanged_at_its_offsets_and_the_rest_untouched(fragments, every, delay):
    steps = 2 * every + delay
    two = TwoClusters(LocalSteps(every=every, fragments=fragments, delay=delay))
    two.train(steps)
    want = _schedule(every, fragments, delay, steps)
    if (fragments, every, delay) == (2, 4, 1):
        assert want == [(1, "launch", 1), (2, "land", 1), (3, "launch", 0), (4, "land", 0),
                        (5, "launch", 1), (6, "land", 1), (7, "launch", 0), (8, "land", 0)]
    assert two.events[0] == two.events[1] == want
    landed = {s: f for s, what, f in want if what == "land"}
    for c in (0, 1):   # a boundary changes the parameters of the fragment that lands there, and no other
        for s, names in two.changed[c].items():
            assert names == (set(CUTS[fragments][landed[s]]) if s in landed else set()), (c, s, names)
    sync = two.syncs[0]
    assert [f.exchanges for f in sync.fragments] == [2] * fragments and sync.progress.exchanges == 2 * fragments
    assert sync.pending is None and sync.progress.local_steps == steps % every


def _streaming_reference(every, fragments, delay, mix, steps, outer_update):
    """LocalSteps(every, fragments, delay, mix) written out: at the end of step t fragment f
    = (t % H) / (H/F) is launched where t % (H/F) == 0 (its mean pseudo-gradient taken now) and
    lands ``delay`` steps later: global = outer_update(f, anchor_f, mean, state_f), params_f =
    mix * params_f + (1 - mix) * global (mix "progress": global + params_f - params_f at the
    launch), anchor_f = global."""
    models = [_model(), _model()]
    inners = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    params = [list(m.parameters()) for m in models]
    groups = [[NAMES.index(n) for n in names] for names in CUTS[fragments]]
    anchor = [p.detach().clone() for p in params[0]]
    states, slot, flight = [{} for _ in groups], every // fragments, None

    def land(f, mean, kept):
        new = outer_update([anchor[i] for i in groups[f]], mean, states[f])
        with torch.no_grad():
            for i, g in zip(groups[f], new):
                for c in (0, 1):
                    if mix == "progress":
                        params[c][i].copy_(g + (params[c][i] - kept[c][i]))
                    else:
                        params[c][i].copy_(mix * params[c][i] + (1 - mix) * g)
                anchor[i] = g
    for s in range(steps):
        for c in (0, 1):
            _inner_steps(models[c], inners[c], c, [s])
        if flight is not None and flight[0] == s:
            land(*flight[1:])
            flight = None
        if (s + 1) % slot == 0:
            f = ((s + 1) % every) // slot
            mean = [(anchor[i] - params[0][i].detach() + anchor[i] - params[1][i].detach()) / 2 for i in groups[f]]
            kept = [{i: params[c][i].detach().clone() for i in groups[f]} for c in (0, 1)]
            if delay == 0:
                land(f, mean, kept)
            else:
                flight = (s + delay, f, mean, kept)
    return [[p.detach() for p in ps] for ps in params], anchor


def _average(anchor, mean, state):
    return [a - m for a, m in zip(anchor, mean)]


def _nesterov(anchor, mean, state, lr=0.7, mu=0.9):
    m = state.setdefault("m", [torch.zeros_like(a) for a in anchor])
    for i, g in enumerate(mean):
        m[i] = mu * m[i] + g
    return [a - lr * (g + mu * mi) for a, g, mi in zip(anchor, mean, m)]


@pytest.mark.parametrize("mix,outer,delay", [(0.0, "average", 1), (0.5, "nesterov", 1), (0.5, "average", 0),
                                             ("progress", "nesterov", 1), ("progress", "average", 0)])
def test_a_landing_fragment_takes_mix_of_its_own_and_the_outer_step(mix, outer, delay):
    steps = 13
    two = TwoClusters(LocalSteps(every=4, fragments=2, delay=delay, mix=mix, outer=outer))
    two.train(steps)
    params, anchor = _streaming_reference(4, 2, delay, mix, steps, _average if outer == "average" else _nesterov)
    for c in (0, 1):
        for p, w in zip(two.models[c].parameters(), params[c]):
            torch.testing.assert_close(p.detach(), w, rtol=1e-5, atol=1e-6)
    for n, a in zip(NAMES, anchor):
        torch.testing.assert_close(two.syncs[0].anchor[n], a, rtol=1e-5, atol=1e-6)
        assert torch.equal(two.syncs[0].anchor[n], two.syncs[1].anchor[n])
    if mix == 0.0 and delay:   # what just landed is the same everywhere: fragment 0 landed at step 12
        assert torch.equal(two.models[0][0].weight, two.models[1][0].weight)
    assert not torch.equal(two.models[0][2].weight, two.models[1][2].weight)   # fragment 1 trained since step 10
    # the outer state is each fragment's own: one momentum buffer per parameter of the fragment
    if outer == "nesterov":
        assert [len(o.state) for o in two.syncs[0].outers] == [1, 3]


def _both(two, method):
    threads = [threading.Thread(target=getattr(s, method)) for s in two.syncs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)


def test_sync_clusters_lands_the_fragment_in_flight_and_exchanges_every_fragment():
    two = TwoClusters(LocalSteps(every=4, fragments=2, delay=1, mix=0.5))
    two.train(6)   # fragment 1 launched at step 5, in flight
    assert two.syncs[0].pending is not None and not torch.equal(_flat(two.models[0]), _flat(two.models[1]))
    _both(two, "sync_clusters")
    assert two.events[0][-5:] == [(5, "land", 1), (5, "launch", 0), (5, "launch", 1), (5, "land", 0), (5, "land", 1)]
    assert torch.equal(_flat(two.models[0]), _flat(two.models[1]))
    assert all(torch.equal(p, two.syncs[0].anchor[n]) for n, p in two.models[0].named_parameters())
    _both(two, "sync_clusters")   # nothing trained since: nothing to exchange
    assert len(two.events[0]) == 10
    two.train(2, start=6)   # the schedule goes on: fragment 0 at step 7
    assert two.events[0][-1] == (7, "launch", 0)


def test_a_nan_in_one_fragment_refuses_that_fragment_only(monkeypatch):
    monkeypatch.setattr(outer_sync, "_policy", lambda: "skip")
    monkeypatch.setattr(outer_sync, "_count_skip", lambda: None)
    two = TwoClusters(LocalSteps(every=4, fragments=2))
    two.train(3)   # fragment 1 exchanged at step 1
    two.train(1, start=3, poison={(1, 3)})   # cluster 1's 0.weight (fragment 0) gets a NaN before its exchange
    agreed = two.syncs[0].anchor["0.weight"]
    for model, sync in zip(two.models, two.syncs):
        assert torch.equal(model[0].weight, agreed)   # fragment 0 back at its anchor, the same on both
        assert [n for n, _ in sync.refusals] == [1] and sync.refusals[0][1].startswith("fragment 0 of 2 (0.weight)")
        assert [f.exchanges for f in sync.fragments] == [0, 1]
    assert two.changed[0][3] == {"0.weight"}   # fragment 1 was left as each cluster trained it
    assert not torch.equal(two.models[0][2].weight, two.models[1][2].weight)
    two.train(4, start=4)   # both fragments go on
    assert [f.exchanges for f in two.syncs[0].fragments] == [1, 2]
    assert all(bool(torch.isfinite(_flat(m)).all()) for m in two.models)
    monkeypatch.setattr(outer_sync, "_policy", lambda: "raise")
    sync = two.syncs[0]
    sync.drop_nonfinite_state = None
    with pytest.raises(NonFiniteGradientError, match=r"exchange 3 of fragment 1 of 2 \(0.bias to 2.bias\) across "
                                                     r"clusters refused on every rank: a NaN; .* for this fragment"):
        sync._refused("rank 1: a NaN", sync.fragments[1])


def test_a_nan_in_a_delayed_fragment_is_refused_when_it_lands(monkeypatch):
    """delay=1: fragment 0 is launched at step 3 with a NaN in cluster 1; that cluster's step 4
    is skipped (its gradients are not finite) and the exchange lands, refused, at once; the
    other fragment goes on, and sync_clusters brings every rank to the anchor."""
    monkeypatch.setattr(outer_sync, "_policy", lambda: "skip")
    monkeypatch.setattr(outer_sync, "_count_skip", lambda: None)
    two = TwoClusters(LocalSteps(every=4, fragments=2, delay=1))
    two.train(3)
    two.train(3, start=3, poison={(1, 3)}, skip_nonfinite=True)
    for sync in two.syncs:
        assert [r.split(":")[0] for _, r in sync.refusals] == ["fragment 0 of 2 (0.weight)"]
        assert [f.exchanges for f in sync.fragments] == [0, 1] and sync.pending.fragment.index == 1
    assert 4 not in two.changed[1]   # cluster 1 skipped step 4 and refused there, before any update
    assert all(bool(torch.isfinite(_flat(m)).all()) for m in two.models)
    _both(two, "sync_clusters")
    assert torch.equal(_flat(two.models[0]), _flat(two.models[1]))
    assert [f.exchanges for f in two.syncs[1].fragments] == [1, 3]


def test_a_failed_collective_propagates_naming_its_fragment():
    from stella_mpi.compression import Compression
    from stella_mpi.optim.tuning import pseudo_gradient_exchange
    assert pseudo_gradient_exchange(Compression.none, "local_steps.0.delta").fragment(1).name == "local_steps.0.delta.f1"
    # the adjuster's schedules name F too: its residuals are a cut's own
    assert pseudo_gradient_exchange(Compression.none, "local_steps.0.delta").fragment(1, 4).name == \
        "local_steps.0.delta.f1of4"

    class Failing:
        def __init__(self, name):
            self.name = name

        def fragment(self, index):
            return Failing("%s.f%d" % (self.name, index))

        def launch(self, deltas):
            return deltas

        def wait(self, pending):
            raise RuntimeError("collective %s failed: rank 3 ended" % self.name)
    model = _model()
    sync = LocalStepsSync(LocalSteps(every=2, fragments=2), list(model.named_parameters()),
                          Failing("local_steps.0.delta"))
    sync.before_synchronize()
    sync.step_closed(skipped=False)   # step 1: fragment 1's launch
    with pytest.raises(RuntimeError, match=r"collective local_steps\.0\.delta\.f1 failed"):
        sync.after_step()
    assert sync.refusals == [] and sync.progress.exchanges == 0


def _state(two):
    return [copy.deepcopy((m.state_dict(), o.state_dict(), s.state_dict())) for m, o, s in
            zip(two.models, two.inner, two.syncs)]


def _load(two, saved):
    for (m, o, s), (msd, osd, ssd) in zip(zip(two.models, two.inner, two.syncs), saved):
        m.load_state_dict(msd)
        o.load_state_dict(osd)
        s.load_state_dict(ssd)


def test_a_checkpoint_of_fragments_round_trips_mid_period():
    settings = LocalSteps(every=4, fragments=2, delay=1, outer="nesterov")
    two = TwoClusters(settings)
    two.train(5)   # fragments exchanged at steps 1 and 3, landed at 2 and 4: nothing in flight, step 1 of the cycle
    saved = _state(two)
    sd = saved[0][2]
    assert set(sd) == {"every", "local_steps", "exchanges", "anchor", "outer", "fragments", "fragment_names",
                       "fragment_exchanges", "delay"}
    assert (sd["fragments"], sd["fragment_names"], sd["fragment_exchanges"], sd["local_steps"], sd["delay"]) == (
        2, CUTS[2], [1, 1], 1, 1)
    assert [len(o["state"]) for o in sd["outer"]] == [1, 3]
    two.train(7, start=5)
    again = TwoClusters(settings)
    _load(again, saved)
    again.train(7, start=5)
    for a, b in zip(two.models, again.models):
        assert torch.equal(_flat(a), _flat(b))
    assert again.events[0] == two.events[0][-len(again.events[0]):]


def test_a_checkpoint_taken_in_flight_leaves_the_exchange_out():
    """The exchange launched at step 5 is not in the checkpoint: loading it completes and forgets
    the one in flight, and fragment 1's progress since its anchor goes into its next exchange."""
    two = TwoClusters(LocalSteps(every=4, fragments=2, delay=1))
    two.train(6)
    saved = _state(two)
    assert two.syncs[0].pending is not None and saved[0][2]["local_steps"] == 2
    _load(two, saved)
    assert two.events[0][-1] == (5, "drop", 1) and two.syncs[0].pending is None
    two.train(4, start=6)   # fragment 0 at step 7, landed at 8; fragment 1 next at step 9
    assert [e for e in two.events[0] if e[0] >= 6] == [(7, "launch", 0), (8, "land", 0), (9, "launch", 1)]
    _both(two, "sync_clusters")
    assert torch.equal(_flat(two.models[0]), _flat(two.models[1]))


def test_a_checkpoint_of_other_fragments_is_refused_naming_both():
    named = list(_model().named_parameters())
    two = TwoClusters(LocalSteps(every=4, fragments=2))
    two.train(2)
    sd = two.syncs[0].state_dict()
    for fragments, every in ((4, 4), (1, 4)):
        with pytest.raises(ValueError, match="saved with fragments=2, this optimizer has fragments=%d" % fragments):
            LocalStepsSync(LocalSteps(every=every, fragments=fragments), named, exchange=None).load_state_dict(sd)
    one = LocalStepsSync(LocalSteps(every=4), named, exchange=None)
    with pytest.raises(ValueError, match="saved with fragments=1, this optimizer has fragments=2"):
        LocalStepsSync(LocalSteps(every=4, fragments=2), named, exchange=None).load_state_dict(one.state_dict())
    other = LocalStepsSync(LocalSteps(every=4, fragments=2, fragment_groups=[["0.weight", "0.bias"], ["2.weight", "2.bias"]]),
                           named, exchange=None)
    with pytest.raises(ValueError, match="fragment 0 of the checkpoint holds 0.weight, this optimizer's holds "
                                         "0.weight, 0.bias: pass the fragment_groups"):
        other.load_state_dict(sd)


def test_fragment_settings_are_checked_where_they_are_given():
    for bad, match in (
            (dict(every=4, fragments=0), "fragments must be an int >= 1"),
            (dict(every=4, fragments=2.0), "fragments must be an int >= 1"),
            (dict(every=4, fragments=True), "fragments must be an int >= 1"),
            (dict(every=6, fragments=4), r"every=6, fragments=4\): the offset schedule f\*H/F does not fit H.*every=8"),
            (dict(every=4, fragments=2, delay=2), r"delay=2\): delay must be an int in \[0, every/fragments\) = \[0, 2\)"),
            (dict(every=4, delay=-1), "delay must be an int in"),
            (dict(every=4, delay=0.5), "delay must be an int in"),
            (dict(every=4, mix=1.5), r"mix must be a number in \[0, 1\].*got 1.5"),
            (dict(every=4, mix=-0.1), r"mix must be a number in \[0, 1\]"),
            (dict(every=4, mix=True), r"mix must be a number in \[0, 1\]"),
            (dict(every=4, fragments=2, overlap=True), r"overlap=True, fragments=2, delay=0\).*use delay="),
            (dict(every=4, delay=1, overlap=True), r"overlap=True, fragments=1, delay=1\).*use delay="),
            (dict(every=4, mix=0.5, overlap=True), r"overlap=True, mix=0.5\).*or mix=0.0"),
            (dict(every=4, fragments=2, outer=torch.optim.SGD(_model().parameters(), lr=1.0)),
             r"fragments=2, outer=SGD\(...\)\).*called once per fragment"),
            (dict(every=4, fragments=2, fragment_groups=[["0.weight"]]), "has 1 groups and fragments=2: pass fragments=1"),
            (dict(every=4, fragments=2, fragment_groups=[["0.weight"], ["0.weight", "2.bias"]]),
             "names 0.weight more than once"),
            (dict(every=4, fragments=2, fragment_groups=[["0.weight"], []]), "group 1 is empty"),
            (dict(every=4, fragments=2, fragment_groups="0.weight"), "must be a list of lists of parameter names")):
        with pytest.raises(ValueError, match=match):
            LocalSteps(**bad)
    # with the model: the names, and at most one fragment per parameter
    named = list(_model().named_parameters())
    groups = {"unknown": [["0.weight", "body.weight"], ["0.bias", "2.weight", "2.bias"]],
              "missing": [["0.weight"], ["0.bias", "2.weight"]]}
    with pytest.raises(ValueError, match=r"body.weight is not among the optimizer's trainable parameters \(0.weight, "):
        LocalStepsSync(LocalSteps(every=4, fragments=2, fragment_groups=groups["unknown"]), named, exchange=None)
    with pytest.raises(ValueError, match="2.bias is in no fragment"):
        LocalStepsSync(LocalSteps(every=4, fragments=2, fragment_groups=groups["missing"]), named, exchange=None)
    with pytest.raises(ValueError, match="fragments=5\\): the optimizer has 4 trainable parameters.*fragments <= 4"):
        LocalStepsSync(LocalSteps(every=5, fragments=5), named, exchange=None)
    # the adjuster does not choose H with fragments; a callable outer is called once per fragment
    calls = []

    def outer(params):
        calls.append(list(params))
        return torch.optim.SGD(calls[-1], lr=1.0)
    sync = LocalStepsSync(LocalSteps(every=4, fragments=2, outer=outer), named, exchange=None, rule=object())
    assert sync.rule is None and [len(c) for c in calls] == [1, 3]
    assert LocalSteps(every=4, fragments=2, fragment_groups=[["0.weight"], ["0.bias"]]).fragment_groups == \
        (("0.weight",), ("0.bias",))
    # overlap keeps the progress since the launch by itself: mix "progress" says the same, and is taken
    assert LocalSteps(every=4, overlap=True, mix="progress").mix == "progress"


def test_sync_clusters_takes_the_exchange_whole_whatever_mix():
    """mix weighs the clusters' result with each cluster's parameters at every exchange, so the
    clusters hold different parameters after one; sync_clusters takes it whole (one fragment
    and blocking, or fragments)."""
    for settings in (LocalSteps(every=2, mix=0.5), LocalSteps(every=4, fragments=2, mix=0.5)):
        two = TwoClusters(settings)
        two.train(4)
        assert not torch.equal(_flat(two.models[0]), _flat(two.models[1]))
        two.train(1, start=4)
        _both(two, "sync_clusters")
        assert torch.equal(_flat(two.models[0]), _flat(two.models[1]))
        assert all(torch.equal(p, two.syncs[0].anchor[n]) for n, p in two.models[0].named_parameters())


def test_a_refusal_in_sync_clusters_raises_after_every_fragment(monkeypatch):
    """STELLA_NONFINITE=raise: sync_clusters exchanges every fragment, refuses the one with a
    NaN (back to its anchor), applies the other, and only then raises, on both clusters."""
    monkeypatch.setattr(outer_sync, "_policy", lambda: "raise")
    two = TwoClusters(LocalSteps(every=4, fragments=2, delay=1))
    two.train(2)   # fragment 1 landed at step 2
    with torch.no_grad():
        two.models[1][0].weight.view(-1)[0] = float("nan")   # fragment 0
    errors = [None, None]

    def sync(c):
        try:
            two.syncs[c].sync_clusters()
        except NonFiniteGradientError as e:
            errors[c] = str(e)
    threads = [threading.Thread(target=sync, args=(c,)) for c in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(e is not None and "of fragment 0 of 2 (0.weight)" in e for e in errors), errors
    assert [f.exchanges for f in two.syncs[0].fragments] == [0, 2]
    assert torch.equal(_flat(two.models[0]), _flat(two.models[1]))


class PacedClusters:
    """Two single-rank clusters under LocalSteps(pace="time"), each step costing ``costs[c]``
    seconds on the cluster's own clock (simulated time: the test does not depend on this
    machine's speed); the exchange is the plain mean of what both send, the gather both rows."""

    def __init__(self, every, costs):
        self.models = [_model(), _model()]
        self.inner = [torch.optim.SGD(m.parameters(), lr=0.1) for m in self.models]
        self.now, self.costs = [0.0, 0.0], costs
        self.barrier = threading.Barrier(2)
        self.slots = [None, None]
        self.periods = [[], []]     # steps each cluster took in each period
        self.raw = [[], []]         # each cluster's unweighted pseudo-gradient at each exchange
        self.after = [[], []]       # each cluster's parameters after each exchange
        settings = LocalSteps(every=every, pace="time")
        self.syncs = [LocalStepsSync(settings, list(m.named_parameters()), self._exchange(c), gather=self._gather(c),
                                     clock=lambda c=c: self.now[c]) for c, m in enumerate(self.models)]

    def _meet(self, c, value):
        self.slots[c] = value
        self.barrier.wait()
        both = list(self.slots)
        self.barrier.wait()
        return both

    def _gather(self, c):
        return lambda row: torch.cat(self._meet(c, row))

    def _exchange(self, c):
        return lambda deltas: [(a + b) / 2 for a, b in zip(*self._meet(c, [d.clone() for d in deltas]))]

    def train(self, exchanges):
        def run(c):
            model, opt, sync = self.models[c], self.inner[c], self.syncs[c]
            step = 0
            while sync.progress.exchanges < exchanges:
                sync.before_synchronize()
                opt.zero_grad()
                x, y = _batch(c, step)
                torch.nn.functional.cross_entropy(model(x), y).backward()
                self.now[c] += self.costs[c]
                sync.step_closed(skipped=False)
                sync.before_step()
                opt.step()
                if sync.due:
                    self.periods[c].append(sync.progress.local_steps)
                    self.raw[c].append([d.clone() for d in sync.deltas()])
                sync.after_step()
                if not sync.due and len(self.after[c]) < len(self.periods[c]):
                    self.after[c].append([p.detach().clone() for p in model.parameters()])
                step += 1
        threads = [threading.Thread(target=run, args=(c,)) for c in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def test_pace_time_each_cluster_takes_the_steps_that_fit_and_the_mean_is_weighted_by_samples():
    """every=4, steps of 1 s and 3 s: the first period is 4 steps everywhere; then a period
    lasts 4 of the fast cluster's steps (4 s), the slow cluster takes the one step that fits,
    and the outer mean is the sample-weighted one, 4/5 and 1/5."""
    two = PacedClusters(every=4, costs=(1.0, 3.0))
    anchor = [p.detach().clone() for p in two.models[0].parameters()]
    two.train(exchanges=3)
    assert two.periods == [[4, 4, 4], [4, 1, 1]]
    assert two.syncs[0].period_s == two.syncs[1].period_s == 4.0
    for e, (w_fast, w_slow) in enumerate([(0.5, 0.5), (0.8, 0.2), (0.8, 0.2)]):
        mean = [w_fast * a + w_slow * b for a, b in zip(two.raw[0][e], two.raw[1][e])]
        want = [a - m for a, m in zip(anchor, mean)]   # outer "average": SGD(lr=1) from the anchor
        for c in (0, 1):
            for got, w in zip(two.after[c][e], want):
                torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-6)
        anchor = want
    assert two.syncs[0].state_dict()["period_s"] == 4.0


def test_pace_is_checked():
    with pytest.raises(ValueError, match="pace must be one of steps, time"):
        LocalSteps(every=4, pace="seconds")
    with pytest.raises(ValueError, match="pace='time', fragments=2"):
        LocalSteps(every=4, pace="time", fragments=2)
    with pytest.raises(ValueError, match="overlap=True"):
        LocalSteps(every=4, pace="time", overlap=True)


def test_inner_is_checked():
    assert LocalSteps(every=4).inner == "cluster" and LocalSteps(every=4, inner="rank").inner == "rank"
    with pytest.raises(ValueError, match="inner must be one of cluster, rank.*'node'"):
        LocalSteps(every=4, inner="node")
    with pytest.raises(ValueError, match="inner='rank', overlap=True.*one shard per rank"):
        LocalSteps(every=4, inner="rank", overlap=True)
    with pytest.raises(ValueError, match="inner='rank', overlap=False, pace='time'.*pass inner='cluster', or pace='steps'"):
        LocalSteps(every=4, inner="rank", pace="time")
    LocalSteps(every=4, inner="rank", fragments=2, delay=1)   # fragments and delays: the same collectives


# ---------------- the adjuster's schedules (optim/tuning.py's ModeSwitch replans between phases)

def _restart_both(two, every, schedule):
    for s in two.syncs:
        s.restart(every, schedule)


def test_a_new_phase_runs_the_schedule_it_is_given_and_back():
    """restart(H, (F, delay)) between phases: the fragments of the balanced cut with new outer
    optimizers, their offsets counted from the phase's start, each landing a delay after its
    launch; back to (1, 0), the whole model's blocking exchange."""
    two = TwoClusters(LocalSteps(every=4, outer="nesterov", mix="progress"))
    two.train(4)   # one exchange at step 3: every rank holds the anchor
    assert torch.equal(_flat(two.models[0]), _flat(two.models[1]))
    before = two.syncs[0].outers[0]
    _restart_both(two, 8, (2, 1))
    sync = two.syncs[0]
    assert sync.schedule == (2, 1) and sync.every == 8 and sync.streaming
    assert [f.names for f in sync.fragments] == CUTS[2] and before not in sync.outers
    assert all(torch.equal(sync.anchor[n], p) for n, p in two.models[0].named_parameters())
    two.events = [[], []]
    anchored = sync.anchor["2.weight"].clone()
    two.train(8, start=4)
    assert two.events[0] == [(7, "launch", 1), (8, "land", 1), (11, "launch", 0)]
    assert two.events[0] == two.events[1]
    # the fragment that landed: its anchor moved (by the mean of both clusters' deltas), and the
    # parameters trained on from it
    assert not torch.equal(sync.anchor["2.weight"], anchored)
    assert not torch.equal(sync.anchor["2.weight"], sync.fragments[1].named[1][1].detach())
    _restart_both(two, 4, (1, 0))   # (the flight of fragment 0 dropped: a phase starts from the parameters)
    assert sync.schedule == (1, 0) and not sync.streaming and len(sync.outers) == 1
    assert two.events[0][-1] == (11, "drop", 0)
    with pytest.raises(ValueError, match=r"every=6, fragments=4\): the offset schedule"):
        sync.replan(6, 4, 0)
    with pytest.raises(ValueError, match=r"delay must be an int in \[0, every/fragments\)"):
        sync.replan(8, 4, 2)


def test_a_cycle_of_the_adjusters_schedule_is_measured_once_per_h_steps(monkeypatch):
    """With schedules chosen, fragment 0's launch ends a cycle of H steps and returns what the
    mode rule needs: seconds per step, seconds blocked, wire seconds of what landed (gathered
    from every rank: here each cluster's own row). The first cycle of a phase is not timed from
    its start: it decides nothing."""
    two = TwoClusters(LocalSteps(every=4, fragments=2, delay=1, mix="progress"))
    measured = [[], []]
    ticks = [0.0, 0.0]
    for c, sync in enumerate(two.syncs):
        sync.schedules_chosen = True
        sync.gather = lambda row: row

        def clock(c=c):   # 1 ms a call, each cluster its own
            ticks[c] += 0.001
            return ticks[c]
        sync.clock = clock
        after = sync.after_step

        def record(after=after, c=c):
            out = after()
            measured[c].append((two.step[c], out))
            return out
        sync.after_step = record
    two.train(12)
    for c in (0, 1):
        decided = [(step, out) for step, out in measured[c] if out is not None]
        assert [step for step, _ in decided] == [7, 11], measured[c]
        for _, (compute, blocked, wire) in decided:
            assert compute > 0 and blocked > 0 and wire > 0


def test_the_timeline_shows_each_fragments_launch_wait_and_outer_step(tmp_path):
    """With HOROVOD_TIMELINE on, every launch and landing of a fragment is a phase on the row
    named after its exchange (``.outer``, apart from its collectives' row): OUTER_LAUNCH,
    OUTER_WAIT (with whether it had arrived) and OUTER_STEP, once per launch or landing of each
    cluster."""
    import json
    from stella_mpi.base import timeline
    path = tmp_path / "tl.json"
    timeline.start(str(path))
    try:
        two = TwoClusters(LocalSteps(every=4, fragments=2, delay=1))
        two.train(9)
    finally:
        timeline.stop()
    events = json.loads(path.read_text())
    ops = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    seen = {}
    for e in events:
        if e["ph"] == "X":
            seen.setdefault((ops[e["pid"]], e["name"]), []).append(e)
    want = _schedule(4, 2, 1, 9)
    for f in (0, 1):
        launches = sum(1 for _, what, g in want if what == "launch" and g == f)
        landings = sum(1 for _, what, g in want if what == "land" and g == f)
        op = "local_steps.f%d.outer" % f
        assert len(seen[(op, "OUTER_LAUNCH")]) == 2 * launches and launches > 0
        assert len(seen[(op, "OUTER_WAIT")]) == len(seen[(op, "OUTER_STEP")]) == 2 * landings and landings > 0
        assert all(e["args"]["delay"] == 1 for e in seen[(op, "OUTER_LAUNCH")])
        assert all("arrived" in e["args"] for e in seen[(op, "OUTER_WAIT")])
    assert {op for op, _ in seen} == {"local_steps.f0.outer", "local_steps.f1.outer"}
