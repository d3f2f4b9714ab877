"""The sparse compressor API: registry, select/encode/decode, error feedback
across steps (hypothesis), the small-tensor rule, merge and scatter."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stella_mpi._native import MalformedPayloadError
from stella_mpi.compression import Compression, TensorContext, get_compressor, registered
from stella_mpi.compression.memory import Memory
from stella_mpi.compression import (CacheAwareCompressor, Selection, SparseCompressor,
                                           merge_selections, scatter_add)

from compress_refs import ref_blocks, ref_blocks_and_singles, ref_topk, same_bits

NAMES = ["topk", "cacheaware", "threshold", "randomk"]


def ctx(name="w", step=0, n=0, seed=7):
    return TensorContext(name, step, (n,), seed)


def test_registry_and_horovod_compat():
    for name in NAMES:
        assert name in registered()
        comp = getattr(Compression, name)(density=0.01)
        assert isinstance(comp, SparseCompressor) and comp.sparse
        assert comp.settings()[:3] == (name, 0.01, "float32")
        assert get_compressor(name, density=0.05).density == 0.05
    assert isinstance(Compression.cacheaware(density=0.01), CacheAwareCompressor)
    t = torch.randn(10)
    c, cctx = Compression.fp16.compress(t)
    assert c.dtype == torch.float16 and Compression.fp16.decompress(c, cctx).dtype == torch.float32
    assert Compression.none.compress(t)[0] is t
    for bad in (0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError):
            Compression.topk(density=bad)
    with pytest.raises(ValueError):
        Compression.topk(density=0.1, value_dtype="int8")
    with pytest.raises(TypeError):
        Compression.topk(density=0.1).compress(t)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("vd", ["float32", "float16", "bfloat16"])
def test_select_encode_decode(name, vd):
    comp = getattr(Compression, name)(density=0.01, value_dtype=vd)
    mem = Memory()
    x = torch.randn(100_003)
    c = ctx(n=x.numel())
    sel = comp.select(x, c, memory=mem)
    assert sel.indices.dtype == torch.int32 and sel.values.dtype == torch.float32
    assert np.all(np.diff(sel.indices.numpy().astype(np.int64)) > 0)
    payload = comp.encode(sel, c)
    assert payload.dtype == torch.uint8 and payload.dim() == 1
    back = comp.decode(payload, c, x.numel())
    assert torch.equal(back.indices, sel.indices) and same_bits(back.values.numpy(), sel.values.numpy())
    # sent + residual == acc, bit for bit (acc = x: the residual started at zero)
    assert same_bits((sel.to_dense() + mem.get("w")).numpy(), x.numpy())
    if name == "randomk":  # values only on the wire
        assert payload.numel() == 32 + sel.values.numel() * (4 if vd == "float32" else 2)
    with pytest.raises(MalformedPayloadError):
        comp.decode(payload, c, x.numel() + 1)
    with pytest.raises(MalformedPayloadError):
        comp.decode(payload[:-1], c, x.numel())


def test_selected_sets_match_references():
    x = torch.randn(2**16 + 1)
    n = x.numel()
    k = round(0.01 * n)
    a = Compression.topk(density=0.01).select(x, ctx(n=n))
    assert np.array_equal(a.indices.numpy(), ref_topk(x.numpy(), k))
    b = Compression.cacheaware(density=0.01, singles=0.0).select(x, ctx(n=n))   # blocks only
    assert np.array_equal(b.indices.numpy(), ref_blocks(x.numpy(), k))
    t = Compression.threshold(density=0.01).select(x, ctx(n=n))
    assert 0.5 * k < len(t) <= 2 * k + 16
    assert np.array_equal(t.indices.numpy(), ref_topk(x.numpy(), len(t)))  # threshold: a top set
    e = Compression.threshold(density=0.01, exact=True).select(x, ctx(n=n))
    assert np.array_equal(e.indices.numpy(), ref_topk(x.numpy(), k))


@pytest.mark.parametrize("name", NAMES)
def test_small_tensors_use_exact_topk(name):
    comp = getattr(Compression, name)(density=0.01)  # 16 / 0.01 = 1600
    for n in (1, 15, 17, 1599):
        x = torch.randn(n)
        sel = comp.select(x, ctx(n=n))
        k = max(1, round(0.01 * n))
        assert np.array_equal(sel.indices.numpy(), ref_topk(x.numpy(), k)), (name, n)
        back = comp.decode(comp.encode(sel, ctx(n=n)), ctx(n=n), n)
        assert torch.equal(back.indices, sel.indices)
    sel = comp.select(torch.empty(0), ctx())
    assert len(sel) == 0
    assert len(comp.decode(comp.encode(sel, ctx()), ctx(), 0)) == 0


@pytest.mark.parametrize("n", [3201, 2**15 - 1, 2**15, 2**16 + 1, 70001, 2**20 + 17])
@pytest.mark.parametrize("singles", [0.3, 0.7, 0.95])
@pytest.mark.parametrize("feedback", [True, False])
def test_cacheaware_singles_match_the_reference(n, singles, feedback):
    """Cache-aware with singles: fewer blocks, then the largest entries they left (the numpy
    reference), step after step with error feedback (sent + residual == acc, bit for bit), NaN
    and Inf sent; on the wire the mixed scheme, in no more bytes than the blocks alone (plus its
    table of 4 bytes per 64K entries)."""
    comp = Compression.cacheaware(density=0.01, singles=singles, error_feedback=feedback)
    blocks_only = Compression.cacheaware(density=0.01)
    rng = np.random.default_rng(n)
    mem = Memory() if feedback else None
    k = comp.k_for(n)
    nb, m = comp.split(n, k)
    assert nb == round((1 - singles) * -(-k // 16)) and m > 0
    for step in range(3):
        g = (rng.standard_normal(n) * rng.exponential(1.0, n) ** 3).astype(np.float32)
        g[rng.integers(0, n, 2)] = [np.nan, np.inf]
        old = mem.residual("w", n).clone().numpy() if feedback else np.zeros(n, np.float32)
        with np.errstate(invalid="ignore"):
            acc = g + old
        c = ctx("w", step, n)
        sel = comp.select(torch.from_numpy(g), c, memory=mem)
        want = ref_blocks_and_singles(acc, nb, m)
        assert np.array_equal(sel.indices.numpy(), want)
        assert same_bits(sel.values.numpy(), acc[want])
        if feedback:
            assert same_bits((sel.to_dense() + mem.get("w")).numpy(), acc)
        payload = comp.encode(sel, c)
        back = comp.decode(payload, c, n)
        assert torch.equal(back.indices, sel.indices) and same_bits(back.values.numpy(), sel.values.numpy())
        from stella_mpi._native import compress as kernels
        assert kernels.decode_info(payload, n)["scheme"] == "mixed" or nb == 0   # no block left: singles only
        budget = blocks_only.encode(blocks_only.select(torch.from_numpy(acc), c), c).numel()
        assert payload.numel() <= budget + 4 * -(-n // 65536)


def test_cacheaware_singles_settings():
    comp = Compression.cacheaware(density=0.01, singles=0.5)
    assert comp.settings() == ("cacheaware", 0.01, "float32", True, 0.5)
    assert comp.with_density(0.1).singles == 0.5
    for bad in (-0.1, 1.0, float("nan")):
        with pytest.raises(ValueError, match="singles"):
            Compression.cacheaware(density=0.01, singles=bad)
    # density 1 sends every entry, singles or not; and 16-bit values buy more singles
    assert comp.split(10_000, 10_000) == (625, 0)
    assert comp.split(100_000, 1000) == (32, 341)
    assert Compression.cacheaware(density=0.01, singles=0.5, value_dtype="float16").split(100_000, 1000) == (32, 263)


def test_randomk_same_indices_on_every_rank():
    a, b = Compression.randomk(density=0.01), Compression.randomk(density=0.01)
    x, y = torch.randn(50000), torch.randn(50000)
    sa = a.select(x, ctx("layer", 5, 50000, seed=99))
    sb = b.select(y, ctx("layer", 5, 50000, seed=99))
    assert torch.equal(sa.indices, sb.indices)
    sc = b.select(y, ctx("layer", 6, 50000, seed=99))
    assert not torch.equal(sa.indices, sc.indices)
    # decoding needs the same (seed, name, step)
    p = a.encode(sa, ctx("layer", 5, 50000, seed=99))
    with pytest.raises(MalformedPayloadError):
        a.decode(p, ctx("layer", 6, 50000, seed=99), 50000)


def test_decode_refuses_a_payload_the_compressor_would_not_send():
    """A peer's payload with other value dtype, or random-k's implied indices for a compressor
    that is not random-k (a key of 0 included), is refused naming what is wrong; random-k
    takes both its own implied indices and explicit ones (small tensors, tree rounds)."""
    c = ctx("layer", 5, 50000, seed=99)
    x = torch.randn(50000)
    topk16 = Compression.topk(density=0.01, value_dtype="float16")
    p = Compression.topk(density=0.01).encode(Compression.topk(density=0.01).select(x, c), c)
    with pytest.raises(MalformedPayloadError, match="values are float32, the compressor sends float16"):
        topk16.decode(p, c, 50000)
    rk = Compression.randomk(density=0.01)
    implied = rk.encode(rk.select(x, c), c)
    assert len(rk.decode(implied, c, 50000)) == 500
    assert len(rk.decode(p, c, 50000)) == 500                    # explicit indices
    from stella_mpi._native import compress as kernels
    zero_key = kernels.randomk_encode(0, torch.ones(500), 50000, "float32")
    for name in ("topk", "cacheaware", "threshold"):
        with pytest.raises(MalformedPayloadError, match="implied by a random-k key"):
            getattr(Compression, name)(density=0.01).decode(zero_key, c, 50000)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(NAMES + ["cacheaware:singles"]), st.sampled_from(["float32", "float16", "bfloat16"]),
       st.integers(0, 5000), st.sampled_from([1e-3, 0.01, 0.1, 0.5, 1.0]), st.integers(1, 4),
       st.integers(0, 2**32 - 1), st.booleans())
def test_error_feedback_invariant_across_steps(name, vd, n, density, steps, seed, special):
    """Every step: sent + new residual == grad + old residual, bit for bit (16-bit
    wire values: exact while |acc| < 2x the wire's largest finite value)."""
    rng = np.random.default_rng(seed)
    name, _, singles = name.partition(":")
    extra = {"singles": 0.6} if singles else {}
    comp = getattr(Compression, name)(density=density, value_dtype=vd, **extra)
    mem = Memory()
    for step in range(steps):
        g = (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 3)).astype(np.float32)
        if special and n:
            g[rng.integers(0, n, 3)] = [np.nan, np.inf, -np.inf]
        old = mem.residual("t", n).clone().numpy()
        with np.errstate(invalid="ignore"):
            acc = g + old  # Inf + -Inf residuals are NaN, as in the kernel
        sel = comp.select(torch.from_numpy(g), ctx("t", step, n, seed=3), memory=mem)
        r = mem.get("t").numpy()
        sent = np.zeros(n, np.float32)
        sent[sel.indices.numpy()] = sel.values.numpy()
        mask = np.zeros(n, bool)
        mask[sel.indices.numpy()] = True
        assert same_bits(r[~mask], acc[~mask])
        assert same_bits((sent + r)[mask], acc[mask]) or vd != "float32"
        if vd != "float32":
            fin = np.isfinite(acc) & mask & (np.abs(acc) < 60000)
            assert same_bits((sent + r)[fin], acc[fin])
            assert np.all(r[mask & ~np.isfinite(acc)] == 0)  # non-finite values are sent as they are
        assert len(sel) == (0 if n == 0 else sel.indices.numel())


def test_memory_and_merge_and_scatter():
    mem = Memory()
    r = mem.residual("a", 10)
    assert r.dtype == torch.float32 and r.numel() == 10 and "a" in mem and len(mem) == 1
    r.fill_(1.0)
    again = mem.residual("a", 11)   # the name reused with another size: a new tensor, a fresh residual
    assert again.numel() == 11 and not again.any() and len(mem) == 1
    sd = mem.state_dict()
    mem.reset()
    assert len(mem) == 0
    mem.load_state_dict(sd)
    assert mem.names() == ["a"] and mem.get("a").numel() == 11
    comp = Compression.topk(density=0.01)
    xs = [torch.randn(30000) for _ in range(4)]
    sels = [comp.select(x, ctx("m", 0, 30000)) for x in xs]
    merged = merge_selections(sels)
    want = sum(s.to_dense() for s in sels)
    dense = torch.zeros(30000)
    scatter_add(dense, merged, scale=0.25)
    assert torch.allclose(dense, want * 0.25)
    with pytest.raises(ValueError):
        merge_selections([sels[0], Selection(sels[1].indices, sels[1].values, 29999)])
    with pytest.raises(ValueError):
        scatter_add(torch.zeros(5), merged)
    with pytest.raises(TypeError):
        comp.select(torch.randn(10, dtype=torch.float64), ctx(n=10))
