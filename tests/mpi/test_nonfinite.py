"""A NaN or Inf in one rank's gradient, on every path (dense, sparse with error feedback, CPU
engine): by default the step (the CPU engine: that bucket's update) is skipped on every rank and
no non-finite value reaches the parameters or a residual; with STELLA_NONFINITE=raise every rank
raises NonFiniteGradientError and the optimizer stays usable."""

import pytest
import torch

import stella_mpi as hvd
from reference import nonfinite_policy, rank_batch, small_model
from stella_mpi.base.errors import NonFiniteGradientError
from stella_mpi.core import state

BAD_STEP = 2


def _bad_rank():
    return hvd.size() - 1


def _poison(model, how):
    """Make this backward's gradient of the first weight non-finite (a tensor hook: it runs before
    the gradient is handed to the optimizer, as a NaN from the model itself would)."""
    def hook(grad):
        grad = grad.clone()
        if how == "entry":
            grad.view(-1)[3] = float("nan")
        else:
            grad.fill_(float("inf"))
        return grad
    return model[0].weight.register_hook(hook)


def _reference(steps, skipped, lr=0.1, momentum=0.9):
    """Plain torch on one process, mean gradient over the ranks, the step ``skipped`` left out."""
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    for step in range(steps):
        opt.zero_grad()
        for r in range(hvd.size()):
            x, y = rank_batch(r, step)
            (torch.nn.functional.cross_entropy(model(x), y) / hvd.size()).backward()
        if step != skipped:
            opt.step()
    return model


def _train(steps, how, **kwargs):
    model = small_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), **kwargs)
    if kwargs.get("engine") is not None:
        opt.attach(model)
    errors = []
    for step in range(steps):
        opt.zero_grad()
        x, y = rank_batch(hvd.rank(), step)
        hook = _poison(model, how) if step == BAD_STEP and hvd.rank() == _bad_rank() else None
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if hook is not None:
            hook.remove()
        try:
            opt.step()
        except NonFiniteGradientError as e:
            errors.append((step, e))
    if kwargs.get("engine") == "cpu":
        try:
            opt.drain()
        except NonFiniteGradientError as e:
            errors.append(("drain", e))
    return model, opt, errors


def _finite_and_equal_everywhere(model):
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert bool(torch.isfinite(flat).all()), "non-finite parameters on rank %d" % hvd.rank()
    everyone = hvd.allgather(flat.unsqueeze(0))
    for r in range(hvd.size()):
        assert torch.equal(everyone[r], flat), "parameters differ between ranks %d and %d" % (hvd.rank(), r)


@pytest.mark.parametrize("how", ["entry", "tensor"])
def test_dense_skips_the_step_everywhere(how):
    before = hvd.stats()["total"]["skipped_nonfinite"]
    model, _, errors = _train(5, how)
    assert not errors
    assert hvd.stats()["total"]["skipped_nonfinite"] == before + 1
    _finite_and_equal_everywhere(model)
    for p, q in zip(model.parameters(), _reference(5, BAD_STEP).parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("how", ["entry", "tensor"])
def test_sparse_keeps_the_residual_finite(how):
    if hvd.num_clusters() < 2:
        pytest.skip("the sparse route needs two clusters")
    model, opt, errors = _train(6, how, compression=hvd.Compression.topk(density=0.3))
    assert not errors
    _finite_and_equal_everywhere(model)
    residuals = opt._memory.state_dict()
    assert residuals or hvd.cluster_rank() != 0   # with unequal clusters only the leaders select
    assert all(bool(torch.isfinite(r).all()) for r in residuals.values())


@pytest.mark.parametrize("how", ["entry", "tensor"])
def test_cpu_engine_skips_the_update(how):
    if not hvd.global_process_set.topology.uniform_clusters:
        pytest.skip("engine='cpu' needs clusters of equal size")
    before = hvd.stats()["total"]["skipped_nonfinite"]
    model, opt, errors = _train(5, how, engine=hvd.CpuEngine(staleness=1, warmup=0))
    assert not errors
    assert hvd.stats()["total"]["skipped_nonfinite"] > before
    _finite_and_equal_everywhere(model)
    sd = opt.state_dict()
    assert all(bool(torch.isfinite(t).all()) for b in sd["buckets"] if b for t in b["full"].values())


@pytest.mark.parametrize("path", ["dense", "sparse", "cpu"])
def test_raise_policy_raises_on_every_rank_and_training_goes_on(path):
    kwargs = {"dense": {}, "sparse": {"compression": hvd.Compression.topk(density=0.3)},
              "cpu": {"engine": hvd.CpuEngine(staleness=0)}}[path]
    if path == "cpu" and not hvd.global_process_set.topology.uniform_clusters:
        pytest.skip("engine='cpu' needs clusters of equal size")
    with nonfinite_policy("raise"):
        model, _, errors = _train(5, "entry", **kwargs)
    assert [step for step, _ in errors] == [BAD_STEP], errors
    assert "rank %d" % _bad_rank() in str(errors[0][1])
    _finite_and_equal_everywhere(model)


def test_a_sparse_allreduce_of_a_nan_is_refused_everywhere():
    x = torch.ones(2000)
    if hvd.rank() == _bad_rank():
        x[7] = float("inf")
    with pytest.raises(NonFiniteGradientError, match="rank %d" % _bad_rank()):
        hvd.allreduce(x, compression=hvd.Compression.topk(density=0.1), name="nonfinite.refused")
    out = hvd.allreduce(torch.ones(2000), compression=hvd.Compression.topk(density=1.0), name="nonfinite.refused")
    assert bool(torch.isfinite(out).all())
    memory = state.current().sparse_memory
    for key in ("nonfinite.refused#shard%d" % hvd.cluster_rank(), "nonfinite.refused"):
        res = memory.get(key)
        assert res is None or bool(torch.isfinite(res).all())


def test_a_plain_allreduce_keeps_horovods_semantics():
    """Outside gradients nothing is checked: NaN reduces like any number, as in Horovod."""
    x = torch.ones(5)
    if hvd.rank() == _bad_rank():
        x[0] = float("nan")
    out = hvd.allreduce(x)
    assert torch.isnan(out[0]) and torch.equal(out[1:], torch.ones(4))


def test_a_skipped_step_leaves_the_same_gradients_on_every_rank():
    """What a GradScaler or a clipping step looks at between synchronize() and step() is the same
    on every rank: the refused gradients are NaN everywhere, as an allreduce would have made them;
    step() then changes nothing, and the next step is not skipped."""
    model = small_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    before = [p.detach().clone() for p in model.parameters()]
    x, y = rank_batch(hvd.rank(), 0)
    hook = _poison(model, "entry") if hvd.rank() == _bad_rank() else None
    torch.nn.functional.cross_entropy(model(x), y).backward()
    if hook is not None:
        hook.remove()
    opt.synchronize()
    assert all(bool(torch.isnan(p.grad).all()) for p in model.parameters())
    with opt.skip_synchronize():
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    _finite_and_equal_everywhere(model)
