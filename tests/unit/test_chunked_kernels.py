"""SparseLoCo's C kernels (c_src/chunked.c) against numpy references: top-k per chunk with
error feedback, the per-chunk quantisation, the payload and its decoder's refusals; and the
DCT-II of the DeMo compressor."""
import math

import numpy as np
import pytest
import torch

from compress_refs import keys, top_units
from stella_mpi._native import MalformedPayloadError
from stella_mpi._native import chunked as C

SIZES = [0, 1, 15, 16, 17, 4095, 4096, 4097, 2**15 - 1, 2**15 + 1, 2**16 - 1, 2**16, 2**16 + 1, 300_001]
# (chunk, k per full chunk): density near 0 (one entry) and 1 (the whole chunk), and between
SETTINGS = [(16, 1), (16, 16), (64, 2), (4096, 41), (4096, 4096), (65536, 655)]


def ref_chunk_k(k, chunk, length):
    if length == chunk:
        return k
    if length == 0:
        return 0
    return min(length, max(1, (k * length + chunk // 2) // chunk))


def ref_chunk_topk(acc, chunk, k):
    out = [s + top_units(keys(acc[s:s + chunk]), ref_chunk_k(k, chunk, min(chunk, acc.size - s)))
           for s in range(0, acc.size, chunk)]
    return np.concatenate(out) if out else np.empty(0, np.int64)


def ref_quantize(idx, val, n, chunk, bits):
    """(values on the grid, scales) as the C quantiser computes them, in float32 arithmetic."""
    f = np.float32
    levels = 2 ** (bits - 1)
    scales = np.zeros(2 * (-(-n // chunk)), np.float32)
    out = val.astype(np.float32).copy()
    chunks = idx // chunk
    for c in np.unique(chunks):
        sel = chunks == c
        v = out[sel]
        if not np.isfinite(v).all():
            scales[2 * c] = np.nan
            out[sel] = np.nan
            continue
        m = np.abs(v)
        lo, hi = m.min(), m.max()
        step = f(0) if hi <= lo else f(f(hi - lo) / f(levels - 1))
        while step > 0 and not np.isfinite(f(lo + f(step * f(levels - 1)))):
            step = np.nextafter(step, f(0))
        if step > 0:
            j = np.clip(np.floor(f(f(m - lo) / step) + f(0.5)), 0, levels - 1).astype(np.float32)
        else:
            j = np.zeros_like(m)
        q = f(lo) + f(step) * j
        out[sel] = np.where(np.signbit(v), -q, q)
        scales[2 * c], scales[2 * c + 1] = lo, step
    return out, scales


def _data(n, seed, kind="normal"):
    rng = np.random.default_rng(seed)
    g = rng.standard_normal(n).astype(np.float32)
    if kind == "nonfinite" and n:
        g[rng.integers(0, n, max(1, n // 500))] = np.nan
        g[rng.integers(0, n, max(1, n // 700))] = np.inf
        g[rng.integers(0, n, max(1, n // 900))] = -np.inf
    elif kind == "ties" and n:
        g = np.round(g).astype(np.float32)
    elif kind == "zeros":
        g[:] = 0
    elif kind == "huge" and n:
        g[rng.integers(0, n, max(1, n // 50))] = np.float32(3.0e38)
    return g


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("chunk,k", SETTINGS)
def test_chunk_topk_with_error_feedback_matches_reference(n, chunk, k):
    g = _data(n, n + k)
    r = (_data(n, n + 1) * 0.3).astype(np.float32)
    res = torch.from_numpy(r.copy())
    idx, val = C.chunk_topk(torch.from_numpy(g), chunk, k, res)
    acc = g + r
    want = ref_chunk_topk(acc, chunk, k)
    assert np.array_equal(idx.numpy(), want)
    assert np.array_equal(val.numpy().view(np.uint32), acc[want].view(np.uint32))
    left = acc.copy()
    left[want] = 0
    assert np.array_equal(res.numpy().view(np.uint32), left.view(np.uint32))   # sent + residual == acc, bit for bit
    assert C.topk_count(n, chunk, k) == len(want)


@pytest.mark.parametrize("kind", ["nonfinite", "ties", "zeros", "huge"])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_edges_select_and_quantise_as_the_reference(kind, bits):
    n, chunk, k = 20_011, 64, 3
    g = _data(n, 7, kind)
    idx, val = C.chunk_topk(torch.from_numpy(g), chunk, k)
    want = ref_chunk_topk(g, chunk, k)
    assert np.array_equal(idx.numpy(), want)
    q = val.clone()
    res = torch.zeros(n)
    scales = C.quantize(idx, q, n, chunk, bits, res)
    ref_q, ref_scales = ref_quantize(want, g[want], n, chunk, bits)
    assert np.array_equal(q.numpy().view(np.uint32), ref_q.view(np.uint32)) or \
        np.array_equal(np.isnan(q.numpy()), np.isnan(ref_q)) and np.array_equal(q.numpy()[~np.isnan(ref_q)],
                                                                                 ref_q[~np.isnan(ref_q)])
    assert np.array_equal(np.isnan(scales.numpy()), np.isnan(ref_scales))
    assert np.array_equal(np.nan_to_num(scales.numpy()), np.nan_to_num(ref_scales))
    assert np.isfinite(res.numpy()).all()
    if kind != "nonfinite":
        fin = np.isfinite(ref_q)
        back = np.zeros(n, np.float64)
        back[want[fin]] = ref_q[fin]
        np.testing.assert_allclose(back[want] + res.numpy()[want], g[want].astype(np.float64), rtol=1e-6, atol=0)
    i2, v2, s2 = C.decode(C.encode(idx, q, scales, n, chunk, bits), n, chunk, bits)
    assert torch.equal(i2, idx) and torch.equal(s2.view(torch.int32), scales.view(torch.int32))
    assert torch.equal(v2.view(torch.int32), q.view(torch.int32))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantise_encode_decode_round_trip(n, bits):
    chunk, k = 4096, 41
    g = _data(n, 3 * n + bits)
    idx, val = C.chunk_topk(torch.from_numpy(g), chunk, k)
    q = val.clone()
    res = torch.zeros(n)
    scales = C.quantize(idx, q, n, chunk, bits, res)
    ref_q, ref_scales = ref_quantize(idx.numpy().astype(np.int64), val.numpy(), n, chunk, bits)
    assert np.array_equal(q.numpy().view(np.uint32), ref_q.view(np.uint32))
    assert np.array_equal(scales.numpy().view(np.uint32), ref_scales.view(np.uint32))
    err = (val - q).numpy()
    assert np.array_equal(res.numpy()[idx.numpy()], err)   # the rounding error is fed back
    payload = C.encode(idx, q, scales, n, chunk, bits)
    i2, v2, s2 = C.decode(payload, n, chunk, bits)
    assert torch.equal(i2, idx) and torch.equal(v2.view(torch.int32), q.view(torch.int32))
    assert torch.equal(s2.view(torch.int32), scales.view(torch.int32))
    kk = len(idx)
    index_bytes = min(4 * kk, 4 * math.ceil(n / 65536) + 2 * kk) if kk < n else 0   # (all: implied)
    assert payload.numel() == 32 + 32 + index_bytes + 8 * math.ceil(n / chunk) + math.ceil(kk * bits / 8)
    # the worst level error of a chunk is half a step
    if kk:
        step = scales.numpy()[1::2][idx.numpy() // chunk]
        assert (np.abs(err) <= step / 2 * (1 + 1e-5) + 1e-30).all()


def test_bytes_per_entry_at_one_percent_two_bits_is_under_a_150th_of_dense():
    n, chunk = 1 << 22, 4096
    idx, val = C.chunk_topk(torch.randn(n), chunk, 41)
    q = val.clone()
    payload = C.encode(idx, q, C.quantize(idx, q, n, chunk, 2), n, chunk, 2)
    assert 4 * n / payload.numel() > 150


def test_encode_refuses_values_off_their_grid_and_bad_scales():
    n, chunk, bits = 1000, 64, 4
    idx, val = C.chunk_topk(torch.randn(n), chunk, 4)
    q = val.clone()
    scales = C.quantize(idx, q, n, chunk, bits)
    off = q.clone()
    off[3] = torch.nextafter(off[3], torch.tensor(float("inf")))
    with pytest.raises(ValueError, match="quantised payload encode"):
        C.encode(idx, off, scales, n, chunk, bits)
    bad = scales.clone()
    bad[1] = -1.0
    with pytest.raises(ValueError):
        C.encode(idx, q, bad, n, chunk, bits)
    with pytest.raises(ValueError):
        C.encode(idx, q, scales[:-2].contiguous(), n, chunk, bits)


def _payload(n=5000, chunk=64, bits=4, k=3, seed=0):
    g = torch.from_numpy(_data(n, seed))
    idx, val = C.chunk_topk(g, chunk, k)
    scales = C.quantize(idx, val, n, chunk, bits)
    return C.encode(idx, val, scales, n, chunk, bits), idx, scales


def _scales_at(payload):
    ilen = int(np.frombuffer(payload.numpy()[24:32].tobytes(), np.uint64)[0])
    return 32 + ilen


@pytest.mark.parametrize("case", ["magic", "version", "bits", "reserved", "n", "chunk", "index_len", "truncated",
                                  "extended", "index_section", "negative_lo", "inf_step", "nan_step_marker",
                                  "empty_chunk_scale", "marker_code", "level_without_step", "padding"])
def test_decoder_refuses_every_malformation(case):
    n, chunk, bits = 5000, 64, 4
    payload, idx, scales = _payload(n, chunk, bits)
    b = payload.numpy().copy()
    s0 = _scales_at(payload)
    f32 = lambda off, v: b.__setitem__(slice(off, off + 4), np.frombuffer(np.float32(v).tobytes(), np.uint8))
    kk = len(idx)
    codes_at = s0 + 8 * math.ceil(n / chunk)
    if case == "magic":
        b[0] ^= 1
    elif case == "version":
        b[4] = 2
    elif case == "bits":
        b[5] = 2
    elif case == "reserved":
        b[6] = 1
    elif case == "n":
        b[8] ^= 1
    elif case == "chunk":
        b[16] = 128
    elif case == "index_len":
        b[24] += 2
    elif case == "truncated":
        b = b[:-1]
    elif case == "extended":
        b = np.concatenate([b, np.zeros(1, np.uint8)])
    elif case == "index_section":
        b[32 + 6] = 0   # the index section's value dtype becomes float32: its length no longer fits
    elif case == "negative_lo":
        f32(s0, -1.0)
    elif case == "inf_step":
        f32(s0 + 4, np.inf)
    elif case == "nan_step_marker":
        f32(s0, np.nan)
        f32(s0 + 4, 1.0)
    elif case == "empty_chunk_scale":
        # shrink the selection to chunk 0 only: re-encode with one chunk's entries, then give chunk 1 a scale
        keep = idx < chunk
        i1, v1 = idx[keep].contiguous(), torch.zeros(int(keep.sum()))
        sc = torch.zeros_like(scales)
        p = C.encode(i1, v1, sc, n, chunk, bits).numpy().copy()
        at = _scales_at(torch.from_numpy(p))
        p[at + 8:at + 12] = np.frombuffer(np.float32(1.0).tobytes(), np.uint8)
        b = p
    elif case == "marker_code":
        f32(s0, np.nan)
        f32(s0 + 4, 0.0)
        b[codes_at] |= 1
    elif case == "level_without_step":
        f32(s0 + 4, 0.0)
        b[codes_at] = 0x11 if b[codes_at] & 0x77 == 0 else b[codes_at]
        b[codes_at] |= 0x01
    elif case == "padding":
        assert (kk * bits) % 8 == 4
        b[-1] |= 0x80
    with pytest.raises(MalformedPayloadError):
        C.decode(torch.from_numpy(np.ascontiguousarray(b)), n, chunk, bits)


def test_a_nonfinite_chunk_travels_as_the_nan_marker():
    n, chunk = 256, 64
    g = torch.randn(n)
    g[70] = float("inf")
    idx, val = C.chunk_topk(g, chunk, 4)
    res = torch.zeros(n)
    scales = C.quantize(idx, val, n, chunk, 2, res)
    assert math.isnan(scales[2]) and scales[3] == 0 and torch.isnan(val[4:8]).all()
    assert torch.isfinite(res).all()
    _, v2, _ = C.decode(C.encode(idx, val, scales, n, chunk, 2), n, chunk, 2)
    assert torch.isnan(v2[4:8]).all() and torch.isfinite(v2[:4]).all() and torch.isfinite(v2[8:]).all()


def test_arguments_are_checked():
    g = torch.randn(100)
    for chunk in (8, 48, 1 << 17, True):
        with pytest.raises(ValueError):
            C.chunk_topk(g, chunk, 1)
    for k in (0, 17):
        with pytest.raises(ValueError):
            C.chunk_topk(g, 16, k)
    idx, val = C.chunk_topk(g, 16, 2)
    for bits in (1, 3, 16):
        with pytest.raises(ValueError):
            C.quantize(idx, val.clone(), 100, 16, bits)
    with pytest.raises(ValueError):
        C.quantize(idx.flip(0).contiguous(), val.clone(), 100, 16, 2)   # not ascending
    with pytest.raises(ValueError):
        C.quantize(idx, val.clone(), 10, 16, 2)                         # an index beyond n
    assert C.topk_count(2**31 - 1, 65536, 655) == (2**31 - 1) // 65536 * 655 + C.chunk_k(655, 65536, (2**31 - 1) % 65536)
    with pytest.raises(ValueError):
        C.topk_count(2**31, 4096, 1)


def test_a_payload_is_refused_by_a_receiver_of_other_settings():
    payload, _, _ = _payload(5000, 64, 4)
    for n, chunk, bits in ((5001, 64, 4), (5000, 128, 4), (5000, 64, 2)):
        with pytest.raises(MalformedPayloadError):
            C.decode(payload, n, chunk, bits)


# ---------------------------------------------------------------- DCT (DeMo)

def ref_dct(x, chunk):
    n = np.arange(chunk)
    d = np.cos(np.pi * (n[None, :] + 0.5) * n[:, None] / chunk) * np.sqrt(2.0 / chunk)
    d[0] /= np.sqrt(2.0)
    full = x.size // chunk * chunk
    out = x.astype(np.float64).copy()
    out[:full] = (x[:full].reshape(-1, chunk).astype(np.float64) @ d.T).ravel()
    return out


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 4096 + 5])
@pytest.mark.parametrize("chunk", [16, 64, 1024])
@pytest.mark.parametrize("path", ["host", "device"])
def test_dct_matches_the_formula_and_inverts(n, chunk, path, monkeypatch):
    """The forward transform against the formula, the inverse giving the entries back, the tail
    untouched. "device": the path a CUDA tensor takes (a float64 product, in slices of _ROWS
    entries, several here, the last one short), run on the host: within float32 rounding."""
    from stella_mpi.compression import dct
    x = _data(n, n + chunk)
    rtol = atol = 1e-4
    if path == "device":
        monkeypatch.setattr(dct, "_in_float64", lambda flat: True)
        monkeypatch.setattr(dct, "_ROWS", 3072)
        rtol, atol = 1e-6, 1e-6 * max(1.0, float(np.abs(x).max(initial=0.0)))
    coef = dct.forward(torch.from_numpy(x), chunk).numpy()
    np.testing.assert_allclose(coef, ref_dct(x, chunk), rtol=rtol, atol=atol)
    back = dct.inverse_(torch.from_numpy(coef.copy()), chunk).numpy()
    np.testing.assert_allclose(back, x, rtol=1e-5 if path == "device" else 1e-4, atol=1e-5)
    assert np.array_equal(coef[n // chunk * chunk:], x[n // chunk * chunk:])   # the tail is untouched
    assert np.array_equal(back[n // chunk * chunk:], x[n // chunk * chunk:])
