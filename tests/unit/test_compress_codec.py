"""Wire codec, merge and scatter-add against numpy references; hypothesis
round trips at every size boundary; untrusted payloads; sizes near 2^31."""
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stella_mpi import _native
from stella_mpi._native import MalformedPayloadError
from stella_mpi._native import compress as K

from compress_refs import ref_merge, same_bits

BOUNDARY_SIZES = [0, 1, 2, 15, 16, 17, 31, 32, 33, 255, 256, 257, 2**15 - 1, 2**15, 2**15 + 1,
                  2**16 - 1, 2**16, 2**16 + 1, 2**17 + 3, 2**20, 2**20 + 1]
WIRE = {"float32": np.float32, "float16": np.float16, "bfloat16": None}


def wire_round(val, vd):
    t = torch.from_numpy(np.asarray(val, np.float32))
    if vd == "float32":
        return t.numpy()
    return t.to(torch.float16 if vd == "float16" else torch.bfloat16).to(torch.float32).numpy()


@st.composite
def selections(draw):
    n = draw(st.sampled_from(BOUNDARY_SIZES) | st.integers(0, 3000))
    mode = draw(st.sampled_from(["random", "blocks", "mixed", "dense", "edges"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if n == 0:
        idx = np.empty(0, np.int64)
    elif mode == "random":
        p = draw(st.sampled_from([0.0, 1e-4, 0.01, 0.3, 0.9]))
        idx = np.flatnonzero(rng.random(n) < p)
    elif mode == "blocks":
        nb = (n + 15) // 16
        b = np.flatnonzero(rng.random(nb) < draw(st.sampled_from([0.05, 0.5])))
        if draw(st.booleans()):
            b = np.union1d(b, [nb - 1])  # the short tail block
        idx = (b[:, None] * 16 + np.arange(16)).ravel()
        idx = idx[idx < n]
    elif mode == "mixed":   # whole blocks and single entries between them
        nb = (n + 15) // 16
        b = np.flatnonzero(rng.random(nb) < draw(st.sampled_from([0.02, 0.3])))
        idx = (b[:, None] * 16 + np.arange(16)).ravel()
        singles = np.flatnonzero(rng.random(n) < draw(st.sampled_from([1e-3, 0.05, 0.5])))
        idx = np.union1d(idx[idx < n], singles)
    elif mode == "dense":
        idx = np.arange(n)
    else:  # indices at the segment and block edges
        cand = np.array([0, 15, 16, 65535, 65536, 65537, n - 1])
        idx = np.unique(cand[(cand >= 0) & (cand < n)])
    bits = rng.integers(0, 2**32, idx.size, dtype=np.uint64).astype(np.uint32)
    val = bits.view(np.float32)  # every bit pattern: NaN, Inf, subnormals
    vd = draw(st.sampled_from(list(WIRE)))
    return n, idx.astype(np.int32), val, vd


def ref_whole_blocks(idx, n):
    """The whole aligned blocks among ascending indices (the short tail block when complete)."""
    present = np.zeros(-(-n // 16) * 16, bool)
    present[idx] = True
    present[n:] = True
    return np.flatnonzero(present.reshape(-1, 16).all(axis=1)).tolist()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(selections())
def test_roundtrip_every_boundary(sel):
    n, idx, val, vd = sel
    payload = K.encode(idx, val, n, "auto", vd)
    assert payload.dtype == torch.uint8 and payload.dim() == 1
    info = K.decode_info(payload, n)
    assert info["entries"] == idx.size and info["nbytes"] == payload.numel()
    di, dv = K.decode(payload, n)
    assert np.array_equal(di.numpy(), idx)
    assert same_bits(dv.numpy(), wire_round(val, vd))
    assert K.encoded_size(idx, n, "auto", vd) == (payload.numel(), info["scheme"])
    # auto is never larger than any explicit scheme that applies
    schemes = ["u32", "seg16"] + (["mixed"] if ref_whole_blocks(idx, n) else [])
    for scheme in schemes:
        size, _ = K.encoded_size(idx, n, scheme, vd)
        assert payload.numel() <= size
        p2 = K.encode(idx, val, n, scheme, vd)
        assert p2.numel() == size and K.decode_info(p2, n)["scheme"] == scheme
        di2, dv2 = K.decode(p2, n)
        assert np.array_equal(di2.numpy(), idx) and same_bits(dv2.numpy(), wire_round(val, vd))
    if "mixed" not in schemes:
        with pytest.raises(ValueError):
            K.encode(idx, val, n, "mixed", vd)
    if idx.size == n and n > 0:
        assert info["scheme"] == "dense"


@settings(max_examples=300, deadline=None)
@given(selections(), st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), min_size=1, max_size=4))
def test_corrupted_payloads_never_decode_to_garbage(sel, flips):
    n, idx, val, vd = sel
    payload = K.encode(idx, val, n, "auto", vd).numpy().copy()
    for at, x in flips:
        payload[at % payload.size] ^= x
    for buf in (payload, payload[:-1], np.concatenate([payload, [0]]).astype(np.uint8)):
        try:
            di, dv = K.decode(torch.from_numpy(buf.copy()), n)
        except MalformedPayloadError:
            continue
        d = di.numpy().astype(np.int64)
        assert d.size == dv.numel()
        assert np.all(np.diff(d) > 0) and (d.size == 0 or (d[0] >= 0 and d[-1] < n))


def test_malformed_names_the_problem():
    idx = np.array([1, 5, 900], np.int32)
    val = np.ones(3, np.float32)
    p = K.encode(idx, val, 1000, "u32").numpy()
    with pytest.raises(MalformedPayloadError, match="decode"):
        K.decode(torch.from_numpy(p), 999)          # wrong tensor size
    with pytest.raises(MalformedPayloadError):
        K.decode(torch.from_numpy(p[:-1].copy()), 1000)
    q = p.copy()
    q[32 + 4:32 + 8] = np.frombuffer(np.uint32(0).tobytes(), np.uint8)  # 1, 0: not ascending
    with pytest.raises(MalformedPayloadError, match="u32"):
        K.decode(torch.from_numpy(q), 1000)
    q = p.copy()
    q[32 + 8:32 + 12] = np.frombuffer(np.uint32(1000).tobytes(), np.uint8)  # out of range
    with pytest.raises(MalformedPayloadError):
        K.decode(torch.from_numpy(q), 1000)
    with pytest.raises(MalformedPayloadError):
        K.decode(b"STSP", 1000)
    with pytest.raises(MalformedPayloadError):
        K.decode(b"", 10)
    key = K.randomk_key(1, "w", 2)
    rp = K.randomk_encode(key, val, 1000)
    assert np.array_equal(K.decode(rp, 1000, key)[0].numpy(), K.randomk_indices(key, 1000, 3).numpy())
    with pytest.raises(MalformedPayloadError):
        K.decode(rp, 1000, key ^ 1)
    # encoder refuses what it cannot represent
    with pytest.raises(ValueError):
        K.encode(np.array([3, 2], np.int32), np.ones(2, np.float32), 10)
    with pytest.raises(ValueError):
        K.encode(idx, val, 900)
    with pytest.raises(ValueError):
        K.encode(idx, val, 1000, "block32")
    with pytest.raises(ValueError):
        K.encode(idx, val[:2], 1000)


def test_sizes_and_scheme_choice_near_2_31():
    M = 2**31 - 1
    assert K.payload_size(M, M, 0, "u32") == 32 + 8 * M
    assert K.payload_size(M, 10**6, 0, "seg16", "float16") == 32 + 4 * 32768 + 4 * 10**6
    for bad in ((2**31, 1, 0, "u32"), (M, M + 1, 0, "u32"), (-1, 0, 0, "u32"), (2**20 + 1, 16, 1, "block16")):
        with pytest.raises(ValueError):
            K.payload_size(*bad)
    # 16-bit offsets pay off once the per-64K segment table is small next to the entries
    assert K.choose_scheme(M, 10**6) == "seg16"
    assert K.choose_scheme(M, 1000) == "u32"
    assert K.choose_scheme(2**16, 3) == "seg16" and K.choose_scheme(2**16, 1) == "u32"
    assert K.choose_scheme(M, 160, 10) == "block32"
    assert K.choose_scheme(2**20, 160, 10) == "block16"
    assert K.choose_scheme(2**20 + 1, 160, 10) == "block32"
    assert K.choose_scheme(M, M) == "dense"
    with pytest.raises(ValueError):
        K.choose_scheme(2**31, 1)


def test_mixed_payload_layout():
    """Whole blocks plus singles: block ids, the segment table, 16-bit offsets, then the values
    in index order; auto picks it; a single inside a listed block is refused."""
    n = 200_000
    blocks = np.array([3, 700, 12_000])
    singles = np.array([5, 47, 11_300, 70_000, 199_999])
    idx = np.union1d((blocks[:, None] * 16 + np.arange(16)).ravel(), singles).astype(np.int32)
    val = np.arange(idx.size, dtype=np.float32)
    p = K.encode(idx, val, n, "auto")
    info = K.decode_info(p, n)
    assert info["scheme"] == "mixed" and info["count"] == 3 and info["key"] == 5 and info["entries"] == 53
    nseg = -(-n // 65536)
    assert p.numel() == 32 + 2 * 3 + 4 * nseg + 2 * 5 + 4 * 53
    raw = p.numpy()
    assert raw[32:38].view(np.uint16).tolist() == blocks.tolist()
    assert raw[38:38 + 4 * nseg].view(np.uint32).tolist() == [3, 1, 0, 1]
    assert raw[38 + 4 * nseg:48 + 4 * nseg].view(np.uint16).tolist() == [5, 47, 11_300, 70_000 - 65536, 199_999 - 3 * 65536]
    di, dv = K.decode(p, n)
    assert np.array_equal(di.numpy(), idx) and np.array_equal(dv.numpy(), val)
    bad = raw.copy()
    bad[38 + 4 * nseg:40 + 4 * nseg] = np.frombuffer(np.uint16(3 * 16 + 2).tobytes(), np.uint8)   # inside block 3
    with pytest.raises(MalformedPayloadError, match="mixed"):
        K.decode(torch.from_numpy(bad), n)
    with pytest.raises(ValueError):
        K.payload_size(n, 53, 3, "mixed")   # a mixed size depends on the indices: encoded_size


def test_block_payload_is_compact():
    n = 10**6
    idx = (np.arange(0, n // 16, 100)[:, None] * 16 + np.arange(16)).ravel().astype(np.int32)
    val = np.ones(idx.size, np.float32)
    p = K.encode(idx, val, n, "auto", "float16")
    nb = idx.size // 16
    assert K.decode_info(p, n)["scheme"] == "block16"  # 62500 blocks: 16-bit block ids
    assert p.numel() == 32 + 2 * nb + 2 * idx.size
    n = 2 * 10**6                                         # 125000 blocks: 32-bit ids
    p = K.encode(idx, val, n, "auto", "float16")
    assert K.decode_info(p, n)["scheme"] == "block32"
    assert p.numel() == 32 + 4 * nb + 2 * idx.size


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 9), st.integers(1, 70000), st.integers(0, 2**32 - 1),
       st.sampled_from([0.0001, 0.01, 0.2, 0.9]))
def test_merge_matches_reference(w, n, seed, p):
    rng = np.random.default_rng(seed)
    lists = []
    for _ in range(w):
        idx = np.flatnonzero(rng.random(n) < p).astype(np.int32)
        val = rng.standard_normal(idx.size).astype(np.float32)
        val[rng.random(idx.size) < 0.05] = -0.0
        lists.append((idx, val))
    mi, mv = K.merge(lists, n)
    ri, rv = ref_merge(lists)
    assert np.array_equal(mi.numpy(), ri)
    assert same_bits(mv.numpy(), rv)


def test_merge_validation_and_special_values():
    a = (np.array([0, 5, 4095], np.int32), np.array([-0.0, np.nan, np.inf], np.float32))
    b = (np.array([4095, 4096, 9000], np.int32), np.array([-np.inf, 3.0, 4.0], np.float32))
    mi, mv = K.merge([a, b], 10000)
    assert mi.tolist() == [0, 5, 4095, 4096, 9000]
    mv = mv.numpy()
    assert mv[:1].view(np.uint32)[0] == 0x80000000 and np.isnan(mv[1]) and np.isnan(mv[2])
    with pytest.raises(MalformedPayloadError):
        K.merge([a, (np.array([3, 3], np.int32), np.ones(2, np.float32))], 10000)
    with pytest.raises(MalformedPayloadError):
        K.merge([a, b], 9000)  # 9000 out of range
    with pytest.raises(ValueError):
        K.merge([a, (np.array([1], np.int32), np.ones(2, np.float32))], 10000)
    assert K.merge([], 10)[0].numel() == 0
    buf = (torch.empty(6, dtype=torch.int32), torch.empty(6))
    oi, ov = K.merge([a, b], 10000, out=buf)
    assert oi.tolist() == mi.tolist() and oi.data_ptr() == buf[0].data_ptr()
    with pytest.raises(ValueError):
        K.merge([a, b], 10000, out=(torch.empty(4, dtype=torch.int32), torch.empty(4)))


def test_scatter_add():
    d = torch.zeros(10)
    K.scatter_add(d, torch.tensor([2, 2, 9], dtype=torch.int32), torch.tensor([1.0, 2.0, 3.0]), 0.5)
    assert d.tolist() == [0, 0, 1.5, 0, 0, 0, 0, 0, 0, 1.5]
    with pytest.raises(ValueError):
        K.scatter_add(d, torch.tensor([2, 10], dtype=torch.int32), torch.tensor([1.0, 1.0]))
    assert d.tolist() == [0, 0, 1.5, 0, 0, 0, 0, 0, 0, 1.5]  # nothing written


def test_merge_same_on_every_simd_level():
    rng = np.random.default_rng(1)
    lists = [(np.flatnonzero(rng.random(100000) < 0.05).astype(np.int32), None) for _ in range(4)]
    lists = [(i, rng.standard_normal(i.size).astype(np.float32)) for i, _ in lists]
    outs = []
    for lvl in _native.simd_levels_available():
        _native.force_simd(lvl)
        try:
            outs.append(tuple(t.numpy().tobytes() for t in K.merge(lists, 100000)))
        finally:
            _native.force_simd(None)
    assert all(o == outs[0] for o in outs)


def test_wrappers_refuse_foreign_byte_order_and_misaligned_arrays():
    import numpy as np
    from stella_mpi._native import compress as K
    with pytest.raises(TypeError, match="byte order"):
        K.topk(np.array([1, -5, 2, .5], ">f4"), 1)
    raw = np.zeros(17, dtype=np.uint8)
    misaligned = np.frombuffer(raw.data, dtype=np.int32, count=4, offset=1)
    with pytest.raises(ValueError, match="aligned"):
        K.scatter_add(np.zeros(8, np.float32), misaligned, np.ones(4, np.float32))


def test_caller_threshold_wins_over_a_forced_one():
    import torch
    from stella_mpi._native import compress as K
    st = K.SelState()
    st.set_threshold(100.0)
    idx, _ = K.threshold_select(torch.tensor([3., -2., .1, 5.]), 1.0, 0, 4, None, st)
    assert idx.tolist() == [0, 1, 3]
