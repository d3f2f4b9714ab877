"""engine=hvd.CpuEngine(...): the C optimizer on the pinned pool against torch.optim, the
staleness invariants (with an injected delay), checkpoints, refusals, and the previous release's
keyword arguments (engine="cpu", staleness=...) still working with a DeprecationWarning."""
import warnings
import copy

import pytest
import torch

import stella_mpi as hvd
from reference import rank_batch, small_model
from stella_mpi.optim.routes import cpu_engine


_model = small_model
_batch = rank_batch


def _mean_grad(model, step):
    model.zero_grad()
    for r in range(hvd.size()):
        x, y = _batch(r, step)
        (torch.nn.functional.cross_entropy(model(x), y) / hvd.size()).backward()
    return [p.grad.clone() for p in model.parameters()]


def _skip_uneven():
    if not hvd.global_process_set.topology.uniform_clusters:
        pytest.skip("engine='cpu' needs clusters of equal size")


@pytest.mark.parametrize("make", [lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3),
                                  lambda ps: torch.optim.Adam(ps, lr=1e-2),
                                  lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.05),
                                  lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.05,
                                                              decoupled_weight_decay=True)],
                         ids=["sgd", "adam", "adamw", "adam-decoupled"])
def test_staleness0_matches_torch_optimizer(make):
    _skip_uneven()
    _against_torch(make)


def _against_torch(make, steps=6, schedule=None, compression=hvd.Compression.none, **engine):
    """Train with engine='cpu' (staleness 0) and with ``make``'s torch optimizer on the mean
    gradient of every rank's batch; the parameters must agree. ``schedule(step, optimizer)``
    changes both optimizers' groups before a step (a scheduler)."""
    model = _model()
    opt = hvd.DistributedOptimizer(make(model.parameters()), named_parameters=model.named_parameters(),
                                   compression=compression, engine=hvd.CpuEngine(staleness=0, model=model, **engine))
    ref = _model()
    ref_opt = make(ref.parameters())
    for step in range(steps):
        if schedule is not None:
            schedule(step, opt)
            schedule(step, ref_opt)
        opt.zero_grad()
        x, y = _batch(hvd.rank(), step)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        _mean_grad(ref, step)
        ref_opt.step()
    opt.drain()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    return model


def test_staleness1_uses_updates_up_to_t_minus_2_and_never_half_applied(monkeypatch):
    _skip_uneven()
    real = cpu_engine.execute_cpu_update

    def slow(*args):
        import time
        time.sleep(0.05)   # the update lags behind the next step's compute
        return real(*args)
    monkeypatch.setattr(cpu_engine, "execute_cpu_update", slow)
    lr = 0.1
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                   named_parameters=model.named_parameters(),
                                   engine=hvd.CpuEngine(staleness=1, warmup=0, model=model))
    seen = []
    model[0].register_forward_pre_hook(lambda m, a: seen.append(min(b.applied for b in opt._buckets)), prepend=False)
    # reference: w_{t+1} = w_t - lr * grad(w_{t-1}) (the forward of step t sees w after t-1 updates)
    ref = _model()
    history = [copy.deepcopy(ref)]
    for step in range(6):
        opt.zero_grad()
        x, y = _batch(hvd.rank(), step)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        stale = history[max(0, step - 1)]
        grads = _mean_grad(stale, step)
        with torch.no_grad():
            for p, g in zip(ref.parameters(), grads):
                p -= lr * g
        history.append(copy.deepcopy(ref))
    assert seen == [-1, -1, 0, 1, 2, 3], seen  # forward t sees exactly the updates 0..t-2
    # the forward of step 5 used the parameters after 4 updates, whole (equal to the reference)
    opt.drain()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def test_sparse_compression_and_identical_ranks():
    _skip_uneven()
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.topk(density=0.1),
                                   engine=hvd.CpuEngine(staleness=1, warmup=0, model=model))
    for step in range(4):
        opt.zero_grad()
        x, y = _batch(hvd.rank(), step)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    opt.drain()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = hvd.allgather(flat.unsqueeze(0))
    assert all(torch.equal(everyone[0], everyone[r]) for r in range(hvd.size()))


def test_density_one_crosses_the_clusters_as_the_dense_sum():
    """Density 1 (the adjuster's top rung, or the user's): the shard crosses as a dense sum, with
    no selection and no indices: torch's result, and the bytes of no compression."""
    _skip_uneven()
    if hvd.global_process_set.topology.num_clusters < 2:
        pytest.skip("one cluster: nothing crosses")

    def make(ps):
        return torch.optim.SGD(ps, lr=0.1, momentum=0.9)
    sent = {}
    for name, comp in (("none", hvd.Compression.none), ("cacheaware 1.0", hvd.Compression.cacheaware(density=1.0)),
                       ("topk 1.0", hvd.Compression.topk(density=1.0))):
        _against_torch(make, compression=comp)
        last = hvd.stats()["last_step"]
        sent[name] = (last["wan_bytes_sent"], last.get("entries_sent", 0))
    assert sent["cacheaware 1.0"] == sent["none"] == sent["topk 1.0"] and sent["none"][0] > 0, sent


def test_a_scheduler_of_momentum_and_weight_decay_is_followed():
    """Every hyper-parameter of the group, not only lr, goes to the C optimizer at each step."""
    _skip_uneven()

    def schedule(step, opt):
        for g in opt.param_groups:
            g["lr"] = 0.1 / (1 + step)
            g["momentum"] = 0.9 if step < 3 else 0.5
            g["weight_decay"] = 0.0 if step < 2 else 1e-2
    _against_torch(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), steps=6, schedule=schedule)
    _against_torch(lambda ps: torch.optim.Adam(ps, lr=1e-2), steps=6,
                   schedule=lambda step, opt: [g.update(betas=(0.9, 0.99) if step < 3 else (0.8, 0.9))
                                               for g in opt.param_groups])


def test_refused_patterns_say_why():
    """A second backward before step() (the first one's update has started), Horovod's
    skip_synchronize (gradients are taken when backward produces them), and a checkpoint of
    other buckets are refused with a message."""
    _skip_uneven()
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                   engine=hvd.CpuEngine(staleness=0, model=model))
    x, y = _batch(hvd.rank(), 0)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(AssertionError, match="computed twice before step"):
        torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    with pytest.raises(ValueError, match="takes each gradient when backward produces it"):
        opt.skip_synchronize()
    sd = opt.state_dict()
    with pytest.raises(ValueError, match=r"the checkpoint has %d buckets, this optimizer %d" % (
            len(sd["buckets"]) + 1, len(sd["buckets"]))):
        opt.load_state_dict(dict(sd, buckets=sd["buckets"] + [None]))
    with pytest.raises(ValueError, match=r"bucket 0 of the checkpoint \(parameters .2.bias., .2.weight.*\) holds"):
        bad = copy.deepcopy(sd)
        bad["buckets"][0]["full"]["master"] = torch.zeros(3)
        opt.load_state_dict(bad)
    opt.drain()
    conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="'weight' is not contiguous"):
        hvd.DistributedOptimizer(torch.optim.SGD(conv.parameters(), lr=0.1), named_parameters=conv.named_parameters(),
                                 engine=hvd.CpuEngine())
    with pytest.raises(ValueError, match="maximize=True is not supported"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, maximize=True),
                                 named_parameters=model.named_parameters(), engine=hvd.CpuEngine(),
                                 compression=hvd.Compression.topk(0.5, momentum_correction=True))


def test_broadcast_optimizer_state_spreads_rank_0s_engine_state():
    """Horovod's resume pattern with engine='cpu': rank 0 loads a checkpoint, then
    broadcast_parameters and broadcast_optimizer_state give every rank its model and engine
    state (master weights, momentum, step count), and training goes on identically. A
    checkpoint saved before the first step resets the buckets (they start afresh)."""
    _skip_uneven()
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   engine=hvd.CpuEngine(staleness=0, model=model))
    fresh = opt.state_dict()
    hvd.broadcast_optimizer_state(opt, root_rank=0)   # before any step: nothing to spread, no error

    _run(model, opt, 2, 0)
    saved = opt.state_dict()
    saved_params = copy.deepcopy(model.state_dict())
    _run(model, opt, 3, 2)
    if hvd.rank() == 0:   # rank 0 alone resumes from the checkpoint
        model.load_state_dict(saved_params)
        opt.load_state_dict(saved)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt._route._steps == 2
    _run(model, opt, 2, 2)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = hvd.allgather(flat.unsqueeze(0))
    assert all(torch.equal(everyone[0], everyone[r]) for r in range(hvd.size()))
    # the same as training 4 steps straight from the start
    ref = _model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(4):
        _mean_grad(ref, step)
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    # back to the checkpoint of step 0: every bucket starts afresh from the model's parameters
    opt.load_state_dict(fresh)
    assert opt._route._steps == 0 and all(b.master is None and b.applied == -1 for b in opt._buckets)


def _run(model, opt, steps, start):
    """``steps`` training steps from step ``start`` (each rank its own batches), then drain()."""
    for step in range(start, start + steps):
        opt.zero_grad()
        x, y = _batch(hvd.rank(), step)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    opt.drain()


def test_state_dict_round_trip():
    _skip_uneven()
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2),
                                   named_parameters=model.named_parameters(), engine=hvd.CpuEngine(staleness=0))
    _run(model, opt, 3, 0)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), opt.state_dict()
    _run(model, opt, 2, 3)
    model2 = _model(seed=5)
    model2.load_state_dict(saved_model)
    opt2 = hvd.DistributedOptimizer(torch.optim.Adam(model2.parameters(), lr=1e-2),
                                    named_parameters=model2.named_parameters(), engine=hvd.CpuEngine(staleness=0))
    opt2.load_state_dict(saved_opt)
    _run(model2, opt2, 2, 3)
    for p, q in zip(model.parameters(), model2.parameters()):
        torch.testing.assert_close(p, q)


def test_refusals():
    model = _model()
    with pytest.raises(ValueError, match="SGD, torch.optim.Adam and torch.optim.AdamW"):
        hvd.DistributedOptimizer(torch.optim.RMSprop(model.parameters()), engine=hvd.CpuEngine())
    with pytest.raises(ValueError, match="staleness"):
        hvd.CpuEngine(staleness=2)
    with pytest.raises(ValueError, match="engine must be None or hvd.CpuEngine"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), engine="gpu")
    if not hvd.global_process_set.topology.uniform_clusters:
        with pytest.raises(ValueError, match="clusters of equal size"):
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), engine=hvd.CpuEngine())
        return
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), engine=hvd.CpuEngine())
    x, y = _batch(hvd.rank(), 0)
    with torch.no_grad():
        model[0].weight.data = torch.zeros(16, 7)   # a parameter that changed shape after wrapping
    with pytest.raises(ValueError, match="changed"):
        torch.nn.functional.cross_entropy(model(torch.randn(8, 7)), y).backward()


@pytest.mark.parametrize("warmup", [0, 2])
def test_stale_prediction_and_warmup_follow_the_reference(warmup):
    """Staleness 1 with momentum SGD: the forward of step t sees the master after updates
    0..t-2 moved one zero-gradient step ahead (momentum known before gradient t-1 arrives);
    the first ``warmup`` steps are synchronous; drain() leaves the exact master weights."""
    _skip_uneven()
    lr, mu = 0.1, 0.9
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=mu),
                                   named_parameters=model.named_parameters(),
                                   engine=hvd.CpuEngine(staleness=1, warmup=warmup, model=model))
    seen = []
    model.register_forward_hook(lambda m, a, out: seen.append([p.detach().clone() for p in m.parameters()]))
    ref = _model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=mu)
    masters = [[p.detach().clone() for p in ref.parameters()]]   # M_k: after k updates
    predicted = [None]                                           # the lookahead of M_k
    for step in range(6):
        opt.zero_grad()
        x, y = _batch(hvd.rank(), step)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        # what the forward of this step must have seen
        if step < warmup or step == 0:
            expect = masters[step]
        elif step - 1 >= warmup and step >= 2:
            expect = predicted[step - 1]
        else:
            expect = masters[step - 1]
        for p, q in zip(seen[step], expect):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=lambda m: "step %d: %s" % (step, m))
        with torch.no_grad():
            for p, q in zip(ref.parameters(), expect):
                p.copy_(q)
        grads = _mean_grad(ref, step)
        with torch.no_grad():
            for p, m, g in zip(ref.parameters(), masters[-1], grads):
                p.copy_(m)
                p.grad = g
        ref_opt.step()
        masters.append([p.detach().clone() for p in ref.parameters()])
        predicted.append([p.detach() - lr * mu * ref_opt.state[p]["momentum_buffer"] for p in ref.parameters()])
    opt.drain()
    for p, q in zip(model.parameters(), masters[-1]):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    assert not any(b.predicted_in_model for b in opt._buckets)
    assert all(b.predicts for b in opt._buckets)
    for bad in (-1, True):
        with pytest.raises(ValueError, match="CpuEngine: warmup must be a number of steps"):
            hvd.CpuEngine(warmup=bad)
    # plain SGD: a zero-gradient step moves nothing, so nothing is predicted (no copies, drain is local)
    plain = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(plain.parameters(), lr=lr), named_parameters=plain.named_parameters(),
                                   engine=hvd.CpuEngine(staleness=1, warmup=0, model=plain))
    for step in range(3):
        opt.zero_grad()
        x, y = _batch(hvd.rank(), step)
        torch.nn.functional.cross_entropy(plain(x), y).backward()
        opt.step()
    assert not any(b.predicts or b.predicted_in_model for b in opt._buckets)
    opt.drain()
    with pytest.raises(ValueError, match="prediction needs semantics=.exact."):
        hvd.CpuEngine(staleness=1, semantics="lazy", prediction=True)


def test_refused_worker_cores_leave_no_hook_behind(monkeypatch):
    """A CPU engine whose pool cannot be built raises, and the model trains on without it."""
    _skip_uneven()
    monkeypatch.setenv("STELLA_CPU_CORES", "x")
    model = _model()
    with pytest.raises(ValueError, match="STELLA_CPU_CORES"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=model.named_parameters(), engine=hvd.CpuEngine())
    x, y = _batch(hvd.rank(), 0)
    torch.nn.functional.cross_entropy(model(x), y).backward()   # no hook of the refused optimizer runs
    assert all(p.grad is not None for p in model.parameters())


def test_momentum_correction_at_density_one_matches_torch_sgd():
    """engine='cpu' with momentum correction: the ranks' velocities cross the route, the C optimizer
    applies them without momentum; at density 1 and staleness 0 that is torch's momentum SGD."""
    _skip_uneven()

    def make(ps):
        return torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3)
    model = _against_torch(make, compression=hvd.Compression.topk(density=1.0, momentum_correction=True))
    with pytest.raises(ValueError, match="masking is not supported"), pytest.warns(DeprecationWarning):
        hvd.DistributedOptimizer(make(model.parameters()), named_parameters=model.named_parameters(),
                                 engine=hvd.CpuEngine(), compression=hvd.Compression.topk(density=0.1),
                                 momentum_correction="masking")


def test_momentum_correction_state_survives_a_checkpoint():
    """The velocities are saved with the engine's state_dict and restored by load_state_dict."""
    _skip_uneven()
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   engine=hvd.CpuEngine(staleness=1, warmup=0, model=model),
                                   compression=hvd.Compression.topk(0.5, momentum_correction=True))
    for step in range(3):
        opt.zero_grad()
        x, y = _batch(hvd.rank(), step)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    saved = opt.state_dict()
    velocity = saved["stella_momentum_correction"]["velocity"]
    assert velocity and all(bool(v.abs().sum() > 0) for v in velocity.values())
    other = _model()
    opt2 = hvd.DistributedOptimizer(torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9),
                                    named_parameters=other.named_parameters(),
                                    engine=hvd.CpuEngine(staleness=1, warmup=0, model=other),
                                    compression=hvd.Compression.topk(0.5, momentum_correction=True))
    opt2.load_state_dict(saved)
    assert set(opt2._mc.velocity) == set(velocity)
    assert all(torch.equal(opt2._mc.velocity[k], v) for k, v in velocity.items())
    for p, q in zip(model.parameters(), other.parameters()):
        assert torch.equal(p, q)


def test_the_previous_releases_keywords_still_work_with_a_warning():
    """engine="cpu", staleness=1, staleness_warmup, model (the previous release) build the same
    engine as hvd.CpuEngine(...), each with a DeprecationWarning that names the new place; the old
    default stays synchronous (staleness 0, no warm-up)."""
    _skip_uneven()
    model = _model()
    with pytest.warns(DeprecationWarning) as caught:
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), engine="cpu", staleness=1,
                                       staleness_warmup=2, model=model)
    said = " ".join(str(w.message) for w in caught)
    assert "engine=hvd.CpuEngine(staleness=...)" in said and "engine=hvd.CpuEngine(warmup=...)" in said, said
    assert "engine=hvd.CpuEngine(model=...)" in said and "pass engine=hvd.CpuEngine(" in said, said
    route = opt._route
    assert (route.kind, route._staleness, route._warmup, route._predict) == ("cpu", 1, 2, True)
    assert route._module_hooks   # the model's forward pre-hooks
    _run(model, opt, 3, 0)
    opt.drain()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old = hvd.DistributedOptimizer(torch.optim.SGD(_model().parameters(), lr=0.1), engine="cpu")
    assert (old._route._staleness, old._route._warmup) == (0, 0)
    with pytest.raises(ValueError, match="pass them to hvd.CpuEngine only"), pytest.warns(DeprecationWarning):
        hvd.DistributedOptimizer(torch.optim.SGD(_model().parameters(), lr=0.1), engine=hvd.CpuEngine(), staleness=0)


def test_the_adjuster_tunes_the_engines_density():
    """hvd.Adjuster with the CPU engine: its session is fed the engine's steps (telemetry from
    every rank), decides, and every rank applies the same density at the same step."""
    _skip_uneven()
    if hvd.global_process_set.topology.num_clusters < 2:
        pytest.skip("one cluster: nothing crosses, nothing to adjust")
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.topk(density=0.1),
                                   engine=hvd.CpuEngine(staleness=1, warmup=0, model=model),
                                   adjuster=hvd.Adjuster(interval=1, window=1, min_density=0.01, max_density=0.5))
    _run(model, opt, 16, 0)   # (a decision every 3 steps: one telemetry step, two to read it at staleness 1)
    decisions = [(step, d.density) for step, d in opt.adjust_decisions]
    assert len(decisions) >= 4, decisions
    assert all(x == decisions for x in hvd.allgather_object(decisions))
    assert opt._route.compression.density == opt.adjust_decisions[-1][1].density
    assert hvd.stats()["last_step"]["step_s"] > 0   # the session timed the engine's steps
