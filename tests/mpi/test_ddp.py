"""torch's DistributedDataParallel over the job (stella_mpi.ddp): the process group made from MPI,
and the communication hook against stella's own DistributedOptimizer, plain DDP, checkpoints,
non-finite gradients and misuse. Runs on every rank (pytest under mpirun)."""
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import stella_mpi as hvd
from stella_mpi import ddp
from stella_mpi.base.errors import NonFiniteGradientError

from reference import nonfinite_policy

# on CUDA where the job sees a GPU (scripts/run_gpu.sh: every rank on one GPU, DDP over gloo)
DEVICE = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
CAP_MB = 0.01   # about 10 KB per bucket: the model below fills two of them once DDP has rebuilt its buckets
# (its first step, before the rebuild, has one bucket of every parameter)


@pytest.fixture(scope="module", autouse=True)
def torch_group():
    ddp.init_process_group()
    yield
    dist.destroy_process_group()


def _net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.Tanh(), torch.nn.Linear(48, 48), torch.nn.Tanh(),
                               torch.nn.Linear(48, 4)).to(DEVICE)


def _batch(rank, step):
    g = torch.Generator().manual_seed(7919 * (rank + 1) + step)
    return torch.randn(32, 16, generator=g).to(DEVICE), torch.randint(0, 4, (32,), generator=g).to(DEVICE)


def _wrap(net, **kwargs):
    return DDP(net, device_ids=[DEVICE.index] if DEVICE.type == "cuda" else None, **kwargs)


def _ddp(compression, seed=0, hook=True):
    net = _net(seed)
    model = _wrap(net, bucket_cap_mb=CAP_MB)
    state = None
    if hook:
        state = ddp.StellaHookState(net, compression=compression)
        model.register_comm_hook(state, ddp.stella_hook)
    return net, model, state


def _steps(model, opt, first, count, nan_at=None):
    for s in range(first, first + count):
        x, y = _batch(hvd.rank(), s)
        if nan_at == (s, hvd.rank()):
            x = x * float("nan")
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _flat(net):
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()]).cpu()


def test_process_group_is_the_mpi_job():
    assert dist.is_initialized()
    assert (dist.get_rank(), dist.get_world_size()) == (hvd.rank(), hvd.size())
    assert ddp.init_process_group() is dist.group.WORLD   # a second call is the same group
    t = torch.tensor([float(hvd.rank())], device=DEVICE)
    dist.all_reduce(t)
    assert t.item() == sum(range(hvd.size()))


@pytest.mark.parametrize("compression", ["topk", "cacheaware", "thc8"])
def test_hook_at_density_one_matches_distributed_optimizer(compression):
    """At density 1 (THC: 8 bits, with its rounding fed back) the hook's buckets and stella's own
    DistributedOptimizer give the same parameters, to 1e-6, SGD with momentum over 6 steps."""
    def comp():
        if compression == "thc8":
            return hvd.Compression.thc(bits=8)
        return getattr(hvd.Compression, compression)(density=1.0)
    net, model, state = _ddp(comp())
    opt = ddp.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), state)
    _steps(model, opt, 0, 6)

    ref = _net()
    hvd.broadcast_parameters(ref.state_dict(), root_rank=0)
    ref_opt = hvd.DistributedOptimizer(torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=ref.named_parameters(), compression=comp())
    _steps(ref, ref_opt, 0, 6)
    if compression == "thc8":   # quantized on the wire: equal to 8-bit rounding, not to 1e-6
        torch.testing.assert_close(_flat(net), _flat(ref), rtol=0, atol=2e-2)
    else:
        torch.testing.assert_close(_flat(net), _flat(ref), rtol=0, atol=1e-6)
    assert state.step == 6


@pytest.mark.parametrize("compression", [hvd.Compression.none, hvd.Compression.fp16])
def test_dense_hook_matches_plain_ddp(compression):
    net, model, state = _ddp(compression)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _steps(model, opt, 0, 5)
    plain, pmodel, _ = _ddp(None, hook=False)
    popt = torch.optim.SGD(pmodel.parameters(), lr=0.1, momentum=0.9)
    _steps(pmodel, popt, 0, 5)
    tol = 1e-6 if compression is hvd.Compression.none else 2e-3
    torch.testing.assert_close(_flat(net), _flat(plain), rtol=0, atol=tol)


def test_sparse_hook_keeps_ranks_identical_and_sends_fewer_bytes():
    before = hvd.stats()["total"]["wan_bytes_sent"]
    net, model, state = _ddp(hvd.Compression.topk(density=0.05))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _steps(model, opt, 0, 8)
    sent = hvd.stats()["total"]["wan_bytes_sent"] - before
    everyone = hvd.allgather(_flat(net).unsqueeze(0), name="ddp_params_sparse")
    assert all(torch.equal(everyone[0], everyone[r]) for r in range(hvd.size()))
    assert hvd.stats()["steps"] >= 8   # the hook closes each step in hvd.stats()
    if hvd.num_clusters() > 1:
        assert sum(hvd.allgather_object(len(state.memory))) > 0   # error feedback kept residuals (the leaders'
        # alone with uneven clusters)
        dense = sum(p.numel() for p in net.parameters()) * 4 * 8   # eight dense steps' payload
        sent = sum(hvd.allgather_object(sent))
        assert 0 < sent < 0.5 * hvd.size() * dense, (sent, dense)


def test_checkpoint_restores_the_residuals():
    """state_dict()/load_state_dict() carry the residuals (by bucket name) and the step count;
    a restored run goes on training with them (its first step is dense: DDP's first layout)."""
    net, model, state = _ddp(hvd.Compression.topk(density=0.05))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _steps(model, opt, 0, 4)
    saved = {"model": {k: v.clone() for k, v in net.state_dict().items()}, "hook": state.state_dict()}
    assert saved["hook"]["step"] == 4

    net2, model2, state2 = _ddp(hvd.Compression.topk(density=0.05), seed=1)
    net2.load_state_dict(saved["model"])
    state2.load_state_dict(saved["hook"])
    assert state2.step == 4
    assert sorted(state2.memory.names()) == sorted(saved["hook"]["residuals"])
    for name, r in saved["hook"]["residuals"].items():
        assert torch.equal(state2.memory.get(name), r)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1)
    _steps(model2, opt2, 4, 3)
    assert state2.step == 7
    everyone = hvd.allgather(_flat(net2).unsqueeze(0), name="ddp_params_restored")
    assert all(torch.equal(everyone[0], everyone[r]) for r in range(hvd.size()))
    with pytest.raises(ValueError, match="expected a dict from state_dict"):
        state2.load_state_dict({"step": 1})


@pytest.mark.parametrize("compression", ["sparse", "dense"])
def test_nonfinite_gradient_is_skipped_on_every_rank(compression):
    """STELLA_NONFINITE=skip: a NaN on the last rank at step 2 refuses that step on every rank;
    an optimizer wrapped by wrap_optimizer does not move, and training goes on."""
    comp = hvd.Compression.topk(density=0.05) if compression == "sparse" else hvd.Compression.none
    net, model, state = _ddp(comp)
    opt = ddp.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), state)
    with nonfinite_policy("skip"):
        _steps(model, opt, 0, 2)
        before = _flat(net).clone()
        _steps(model, opt, 2, 1, nan_at=(2, hvd.size() - 1))
        assert state.skipped and state.skipped_steps == 1
        assert torch.equal(_flat(net), before)
        _steps(model, opt, 3, 2)
    assert not state.skipped
    after = _flat(net)
    assert bool(torch.isfinite(after).all()) and not torch.equal(after, before)
    for name in state.memory.names():
        assert bool(torch.isfinite(state.memory.get(name)).all()), name


def test_nonfinite_gradient_raises_on_every_rank_with_raise():
    net, model, state = _ddp(hvd.Compression.topk(density=0.05))
    opt = ddp.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), state)
    with nonfinite_policy("raise"):
        _steps(model, opt, 0, 1)
        x, y = _batch(hvd.rank(), 1)
        if hvd.rank() == 0:
            x = x * float("inf")
        opt.zero_grad()
        with pytest.raises(NonFiniteGradientError, match="non-finite gradient .* on rank 0 .*refused on every rank"):
            torch.nn.functional.cross_entropy(model(x), y).backward()
        _steps(model, opt, 2, 1)   # the next step goes on


def test_buckets_that_differ_between_ranks_are_named():
    if hvd.size() < 2:
        pytest.skip("needs two ranks")
    net = _net()   # per-bucket caps that differ: DDP's first buckets differ (it agrees on its rebuilt ones)
    model = _wrap(net, bucket_cap_mb_list=[0.004, 0.004] if hvd.rank() == 0 else [1])
    state = ddp.StellaHookState(net, compression=hvd.Compression.none)
    model.register_comm_hook(state, ddp.stella_hook)
    x, y = _batch(hvd.rank(), 0)
    with pytest.raises(ValueError, match="bucket 0 differs between ranks"):
        torch.nn.functional.cross_entropy(model(x), y).backward()


def test_a_state_on_another_group_is_refused():
    if hvd.size() < 2:
        pytest.skip("needs two ranks")
    sub = dist.new_group([0, 1][:hvd.size() - 1])   # every rank makes it, a group without the last rank
    net = _net()
    model = _wrap(net, bucket_cap_mb=CAP_MB)
    state = ddp.StellaHookState(net, compression=hvd.Compression.none, process_group=sub)
    model.register_comm_hook(state, ddp.stella_hook)
    x, y = _batch(hvd.rank(), 0)
    with pytest.raises(ValueError, match="DDP reduces over torch ranks"):
        torch.nn.functional.cross_entropy(model(x), y).backward()


def test_momentum_correction_carries_velocities_and_a_refused_step_leaves_none():
    """wrap_optimizer with SGD with momentum on a sparse route: the hook sends velocities (DGC),
    kept in the state and its checkpoint; a step refused for a NaN rolls them back."""
    net, model, state = _ddp(hvd.Compression.topk(density=0.05))
    opt = ddp.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), state)
    assert state._mc is not None
    _steps(model, opt, 0, 3)
    assert len(state._mc.velocity) == len(list(net.parameters()))
    saved = state.state_dict()["momentum_correction"]["velocity"]
    with nonfinite_policy("skip"):
        _steps(model, opt, 3, 1, nan_at=(3, 0))
    assert state.skipped
    for name, v in state._mc.velocity.items():
        assert torch.equal(v, saved[name]), name
    plain = ddp.StellaHookState(_net(), compression=hvd.Compression.topk(density=0.05))
    ddp.wrap_optimizer(torch.optim.SGD(_net().parameters(), lr=0.1), plain)
    assert plain._mc is None   # no momentum: nothing to correct
    thc = ddp.StellaHookState(_net(), compression=hvd.Compression.thc(bits=4))
    ddp.wrap_optimizer(torch.optim.SGD(_net().parameters(), lr=0.1, momentum=0.9), thc)
    assert thc._mc is None     # THC holds nothing back, as on the Horovod path


@pytest.mark.auto_route
def test_automatic_route_runs_the_adjuster_across_clusters():
    net, model, state = _ddp(None)
    if hvd.num_clusters() < 2:
        assert state.session is None and state.compression is hvd.Compression.none
        return
    assert state.session is not None and state.compression.name == "cacheaware"
    opt = ddp.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), state)
    _steps(model, opt, 0, 12)
    decisions = state.session.decisions
    assert decisions, "the adjuster decided nothing in 12 steps (interval 2)"
    steps = hvd.allgather_object([(s, d.density, d.bits) for s, d in decisions])
    assert all(x == steps[0] for x in steps)   # the same decisions at the same steps on every rank


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="modes=.*not for the DDP hook: local steps need"):
        ddp.StellaHookState(_net(), compression=hvd.Compression.topk(density=0.01),
                            adjuster=hvd.Adjuster(modes=("sync", "local")))
    with pytest.raises(ValueError, match="nothing to tune"):
        ddp.StellaHookState(_net(), compression=hvd.Compression.none, adjuster=hvd.Adjuster())
    with pytest.raises(TypeError, match="state must be a StellaHookState"):
        ddp.wrap_optimizer(torch.optim.SGD(_net().parameters(), lr=0.1), None)
    with pytest.raises(TypeError, match="pass the model DDP wraps"):
        ddp.StellaHookState([1, 2])
    with pytest.raises(TypeError, match="expected hvd.Compression.none"):
        ddp.StellaHookState(_net(), compression="topk")
    with pytest.raises(TypeError, match="StellaHookState"):
        ddp.stella_hook(object(), None)
    state = ddp.StellaHookState(_net(), compression=hvd.Compression.none)
    with pytest.raises(TypeError, match="takes DDP's GradBucket, got Tensor"):   # FSDP's hooks get tensors
        ddp.stella_hook(state, torch.zeros(3))
