"""The torch-op selection of the CUDA route (compression/device_select.py) against the C kernels,
bit for bit, on CPU tensors: the same sets, values and residuals over many sizes and edges."""
import functools
import pytest
import torch

from stella_mpi._native import compress as kernels
from stella_mpi.compression import (CacheAwareCompressor, Memory, RandomKCompressor, TensorContext,
                                    ThresholdCompressor, TopKCompressor)
from stella_mpi.compression import device_select

SIZES = [1, 2, 15, 16, 17, 33, 1000, 4097, (1 << 15) - 1, 1 << 15, (1 << 15) + 1, 1 << 16, (1 << 16) + 7]
DENSITIES = [1e-4, 0.01, 0.3, 0.99, 1.0]


def _grad(n, seed, kind="normal"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    if kind == "ties":
        x = torch.randint(-3, 4, (n,), generator=g).float()          # many equal magnitudes
    elif kind == "nonfinite" and n >= 4:
        x[n // 3] = float("nan")
        x[n // 2] = float("inf")
        x[-1] = -float("inf")
    elif kind == "zeros":
        x.zero_()
    return x


def _same(a, b):
    """Bitwise equality of float32 tensors (NaN payloads and signed zeros included)."""
    return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", ["normal", "ties", "nonfinite", "zeros"])
def test_topk_and_blocks_match_c(n, kind):
    grad = _grad(n, n, kind)
    for density in DENSITIES:
        k = max(1, min(n, int(round(density * n))))
        for c_fn, t_fn in ((kernels.topk, device_select.topk), (kernels.block_topk, device_select.block_topk)):
            res_c = _grad(n, n + 1) * 0.1
            res_t = res_c.clone()
            ic, vc = c_fn(grad, k, res_c)
            it, vt = t_fn(grad, k, res_t)
            assert torch.equal(ic, it), (c_fn.__name__, n, k, kind)
            assert _same(vc, vt)
            assert _same(res_c, res_t)
            # and without error feedback
            ic, vc = c_fn(grad, k)
            it, vt = t_fn(grad, k)
            assert torch.equal(ic, it) and _same(vc, vt)


@pytest.mark.parametrize("n", [1, 17, 5000, (1 << 16) + 3])
def test_randomk_matches_c(n):
    grad = _grad(n, 7)
    key = kernels.randomk_key(3, "w", 5)
    for k in {1, max(1, n // 100), n}:
        res_c = torch.full((n,), 0.25)
        res_t = res_c.clone()
        ic, vc = kernels.randomk_select(grad, k, key, res_c)
        it, vt = device_select.randomk(grad, k, key, res_t)
        assert torch.equal(ic, it) and _same(vc, vt) and _same(res_c, res_t)


def test_block_scores_use_the_c_order():
    # a sum whose float32 result depends on the order: 1e8 and 1 in different lanes
    x = torch.zeros(16)
    x[0], x[8], x[1] = 1e8, 1.0, 1.0
    s = device_select.block_scores(x)
    # the reference in plain Python float32 arithmetic
    a = [abs(float(v)) for v in x]
    f = lambda v: torch.tensor(v, dtype=torch.float32).item()  # noqa: E731
    u = [f(a[i] + a[i + 8]) for i in range(8)]
    w = [f(u[i] + u[i + 4]) for i in range(4)]
    y = [f(w[i] + w[i + 2]) for i in range(2)]
    assert s.item() == f(y[0] + y[1])
    assert _same(s, torch.tensor([f(y[0] + y[1])]))
    # and the block the C kernel picks from scores like these is the same
    big = torch.randn(16 * 50)
    big[16 * 7:16 * 8] = 1e8 / 16
    assert torch.equal(device_select.block_topk(big, 16)[0], kernels.block_topk(big, 16)[0])


def test_magnitude_keys_order_nan_above_inf():
    x = torch.tensor([0.0, -0.0, 1.0, -2.0, float("inf"), float("nan"), -float("nan")])
    keys = device_select.magnitude_keys(x).tolist()
    assert keys[0] == keys[1] == 0
    assert keys[2] < keys[3] < keys[4] < keys[5] == keys[6]


@pytest.mark.parametrize("cls", [TopKCompressor, CacheAwareCompressor, RandomKCompressor,
                                 functools.partial(CacheAwareCompressor, singles=0.6)],
                         ids=["topk", "cacheaware", "randomk", "cacheaware-singles"])
@pytest.mark.parametrize("value_dtype", ["float32", "float16", "bfloat16"])
def test_compressors_on_the_device_route_equal_the_c_path(monkeypatch, cls, value_dtype):
    """SparseCompressor.select on the device route (STELLA_DEVICE_PATH=torch) gives the C path's
    selection and residual, step after step (error feedback carried)."""
    comp_c, comp_t = cls(density=0.01, value_dtype=value_dtype), cls(density=0.01, value_dtype=value_dtype)
    mem_c, mem_t = Memory(), Memory()
    for step in range(4):
        grad = _grad(70001, step) * (100 if value_dtype != "float32" else 1)
        ctx = TensorContext(name="w", step=step, shape=(70001,), seed=9)
        monkeypatch.delenv("STELLA_DEVICE_PATH", raising=False)
        sc = comp_c.select(grad, ctx, memory=mem_c)
        monkeypatch.setenv("STELLA_DEVICE_PATH", "torch")
        st = comp_t.select(grad, ctx, memory=mem_t)
        assert torch.equal(sc.indices, st.indices) and _same(sc.values, st.values) and sc.key == st.key
        assert _same(mem_c.get("w"), mem_t.get("w"))


@pytest.mark.parametrize("kind", ["ties", "nonfinite", "zeros", "signed_zeros"])
@pytest.mark.parametrize("feedback", [True, False])
def test_cacheaware_singles_on_the_device_route_equal_the_c_path_at_the_edges(monkeypatch, kind, feedback):
    """Cache-aware with singles on the two routes: many equal magnitudes, NaN and Inf, all zeros,
    and -0.0 entries give the same selection, values and residual, with and without feedback."""
    for n in (320, 3201, 70001):   # 320: one block, given up for singles
        comps = [CacheAwareCompressor(density=0.05, singles=0.6, error_feedback=feedback) for _ in range(2)]
        mems = [Memory(), Memory()]
        for step in range(3):
            grad = _grad(n, step, "ties" if kind == "signed_zeros" else kind)
            if kind == "signed_zeros":
                grad[::3] = -0.0
            ctx = TensorContext(name="w", step=step, shape=(n,), seed=9)
            sels = []
            for path, comp, mem in zip((None, "torch"), comps, mems):
                if path:
                    monkeypatch.setenv("STELLA_DEVICE_PATH", path)
                else:
                    monkeypatch.delenv("STELLA_DEVICE_PATH", raising=False)
                sels.append(comp.select(grad, ctx, memory=mem if feedback else None))
            assert torch.equal(sels[0].indices, sels[1].indices) and _same(sels[0].values, sels[1].values)
            assert bool((torch.diff(sels[0].indices.long()) > 0).all())
            if feedback:
                assert _same(mems[0].get("w"), mems[1].get("w"))


def test_threshold_on_the_device_route_sends_the_exact_topk(monkeypatch):
    monkeypatch.setenv("STELLA_DEVICE_PATH", "torch")
    grad = _grad(50000, 3)
    comp = ThresholdCompressor(density=0.01)
    sel = comp.select(grad, TensorContext(name="t", step=0, shape=(50000,)))
    ic, _ = kernels.topk(grad, comp.k_for(50000))
    assert torch.equal(sel.indices, ic)


def test_device_route_setting_is_checked(monkeypatch):
    monkeypatch.setenv("STELLA_DEVICE_PATH", "gpu-please")
    with pytest.raises(ValueError, match="STELLA_DEVICE_PATH"):
        TopKCompressor(0.5).select(torch.ones(100), TensorContext(name="x", step=0, shape=(100,)))


def test_residual_on_another_device_is_refused():
    with pytest.raises(ValueError, match="residual"):
        device_select.topk(torch.ones(10), 2, torch.zeros(11))


def test_empty_tensor(monkeypatch):
    monkeypatch.setenv("STELLA_DEVICE_PATH", "torch")
    sel = CacheAwareCompressor(0.01).select(torch.empty(0), TensorContext(name="e", step=0, shape=(0,)), Memory())
    assert len(sel) == 0 and sel.numel == 0
