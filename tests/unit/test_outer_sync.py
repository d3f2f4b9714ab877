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


class TwoClusters:
    """Two clusters, each one model with its inner SGD and its LocalStepsSync; ``exchange`` is
    the mean of the two clusters' pseudo-gradients (threads meet at a barrier)."""

    def __init__(self, settings, inner=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)):
        self.models = [_model(), _model()]
        self.inner = [inner(m.parameters()) for m in self.models]
        self.barrier = threading.Barrier(2)
        self.sent = [None, None]
        self.syncs = [LocalStepsSync(settings, list(m.named_parameters()), self._exchange(c),
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

    def _exchange(self, cluster):
        def exchange(deltas):
            self.sent[cluster] = [d.clone() for d in deltas]
            self.barrier.wait()
            mean = [(a + b) / 2 for a, b in zip(*self.sent)]
            finite = all(bool(torch.isfinite(d).all()) for sent in self.sent for d in sent)
            self.barrier.wait()   # both read before the next exchange overwrites
            if not finite:   # what the allreduce's agreement does: refused on every rank
                raise NonFiniteGradientError("rank %d: a non-finite gradient (NaN or Inf) in the exchange" % cluster)
            return mean
        return exchange

    def train(self, steps, start=0, skip=(), poison=()):
        """``skip``: (cluster, step) pairs whose step is skipped and never reaches ``step()``
        (GradScaler's pattern); ``poison``: (cluster, step) pairs after whose update the
        cluster's first weight gets a NaN."""
        def run(c):
            model, opt, sync = self.models[c], self.inner[c], self.syncs[c]
            for step in range(start, start + steps):
                sync.before_synchronize()
                opt.zero_grad()
                x, y = _batch(c, step)
                torch.nn.functional.cross_entropy(model(x), y).backward()
                sync.step_closed(skipped=(c, step) in skip)
                if (c, step) in skip:
                    continue
                sync.before_step()
                opt.step()
                if (c, step) in poison:
                    with torch.no_grad():
                        model[0].weight.view(-1)[0] = float("nan")
                sync.after_step()
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
