"""Rank-seeded inputs that any rank can recompute for every other rank, and reference results."""
import contextlib
import dataclasses

import torch

import stella_mpi as hvd

ALL_DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
              torch.float32, torch.float64, torch.bool]
TOL = {torch.float16: (2e-2, 2e-2), torch.bfloat16: (5e-2, 5e-2), torch.float32: (1e-5, 1e-5),
       torch.float64: (1e-12, 1e-12)}


def rank_input(rank, shape, dtype, seed=0, small=False):
    """Deterministic input of ``rank``: small integers (exact in every dtype and in products
    over a few ranks), or normal floats."""
    g = torch.Generator().manual_seed(1000003 * (rank + 1) + seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point and not small:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    lo, hi = (0, 4) if dtype == torch.uint8 else (-3, 4)
    return torch.randint(lo, hi, shape, generator=g).to(dtype)


def reference_allreduce(inputs, op, dtype, prescale=1.0, postscale=1.0):
    """Flat reduction computed in float64 (or int64), then cast like stella_mpi does."""
    n = len(inputs)
    wide = torch.float64 if (dtype.is_floating_point or dtype == torch.bool) else torch.int64
    xs = [x.to(wide) for x in inputs]
    if prescale != 1.0:
        xs = [x * prescale if dtype.is_floating_point else (x.double() * prescale).trunc().to(wide) for x in xs]
    if op in (hvd.Sum, hvd.Average):
        out = sum(xs[1:], xs[0].clone())
    elif op == hvd.Product:
        out = xs[0].clone()
        for x in xs[1:]:
            out = out * x
    elif op == hvd.Min:
        out = torch.stack(xs).min(0).values
    else:
        out = torch.stack(xs).max(0).values
    scale = postscale / n if op == hvd.Average else postscale
    if scale != 1.0:
        out = out * scale if dtype.is_floating_point else (out.double() * scale).trunc().to(wide)
    if dtype == torch.bool:
        return out != 0
    if not dtype.is_floating_point:
        return out.to(dtype)  # wraps like the fixed-width reduction
    return out.to(dtype)


def assert_close(got, want, dtype, what=""):
    assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    if dtype in TOL:
        rtol, atol = TOL[dtype]
        torch.testing.assert_close(got.double(), want.double(), rtol=rtol, atol=atol, msg=what)
    else:
        assert torch.equal(got, want), "%s: %s != %s" % (what, got, want)


def small_model(seed=0):
    """The little classifier the optimizer suites train."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def rank_batch(rank, step):
    """Rank ``rank``'s batch of step ``step`` (any rank can recompute any other's)."""
    g = torch.Generator().manual_seed(7919 * rank + step)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


@contextlib.contextmanager
def nonfinite_policy(name):
    """STELLA_NONFINITE=``name`` on this rank for the block (every rank must enter it alike)."""
    from stella_mpi.core import state
    rt = state.current()
    old = rt.config
    rt.config = dataclasses.replace(old, nonfinite=name)
    try:
        yield
    finally:
        rt.config = old



def error_feedback_balance(comp, key, n, seeds, back=None):
    """Reduce one rank-seeded input per seed in ``seeds`` through ``comp`` (op Sum, every rank checked to get
    the same bits) and return (delivered, held back in the residuals, fed in), float64, over
    all ranks. ``back`` takes a residual to the entries' domain (a compressor that keeps it in
    another, as the DCT's coefficients)."""
    from stella_mpi.comm.buffers import split_counts
    from stella_mpi.core import state
    topo = hvd.global_process_set.topology
    delivered = torch.zeros(n, dtype=torch.float64)
    fed = torch.zeros(n, dtype=torch.float64)
    for s, seed in enumerate(seeds):
        inputs = [rank_input(r, (n,), torch.float32, seed=seed) for r in range(hvd.size())]
        fed += sum(x.double() for x in inputs)
        out = hvd.allreduce(inputs[hvd.rank()], compression=comp, name=key, op=hvd.Sum)
        everyone = hvd.allgather(out.unsqueeze(0), name=key + ".check")
        assert all(torch.equal(everyone[0], everyone[r]) for r in range(hvd.size())), (key, s)
        delivered += out.double()
    back = back or (lambda r: r)
    residual = torch.zeros(n, dtype=torch.float64)
    if topo.num_clusters > 1:
        mem = state.current().sparse_memory
        if topo.uniform_clusters:
            counts = split_counts(n, topo.cluster_size)
            start = sum(counts[:topo.cluster_rank])
            residual[start:start + counts[topo.cluster_rank]] = back(mem.get("%s#shard%d" % (key, topo.cluster_rank))).double()
        elif topo.cluster_rank == 0:
            residual += back(mem.get(key)).double()
    return delivered, hvd.allreduce(residual, op=hvd.Sum, name=key + ".residuals"), fed
