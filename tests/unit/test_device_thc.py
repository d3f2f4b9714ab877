"""THC's torch operations (compression/device_thc.py, the GPU route) against the C kernels
(c_src/thc.c, themselves checked against numpy in test_thc_kernels.py), bit for bit on CPU
tensors: rotation, block maxima, quantization and packing (nearest and stochastic), the decoding
of words summed over 1 to 16 clusters, the refusal of malformed words, and the compressor's
three calls with error feedback under ``STELLA_DEVICE_PATH=torch``. A difference is a failure,
not a tolerance: the device route and the host route must send and decode the same bits."""
import numpy as np
import pytest
import torch

from stella_mpi._native import MalformedPayloadError
from stella_mpi._native import thc as C
from stella_mpi.compression import Memory, TensorContext, THCCompressor
from stella_mpi.compression import device_thc as D

SIZES = [0, 1, 2, 7, 63, 64, 65, 1023, 1024, 1025, 5000, 2**15 - 1, 2**15, 2**15 + 1, 2**16, 2**16 + 7]


def _bits(t):
    t = torch.as_tensor(t).contiguous()
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int64)


def _same(a, b, what):
    a, b = _bits(a), _bits(b)
    assert a.shape == b.shape and torch.equal(a, b), "%s: the device route's bits differ from the C kernels'" % what


def _vector(n, seed, spread=3.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * spread
    if n > 4:   # entries of very different magnitudes, exact zeros and a -0.0
        x[::7] *= 1e-6
        x[1] = 0.0
        x[2] = -0.0
    return x


@pytest.mark.parametrize("block_log2", [1, 2, 3, 5, 10, 16])
def test_rotation_and_its_inverse_match_the_c_kernel(block_log2):
    for n in SIZES:
        x = _vector(n, n + block_log2)
        a, b = x.clone(), x.clone()
        C.rotate(a, block_log2, 0x1234_5678_9ABC_DEF0)
        D.rotate(b, block_log2, 0x1234_5678_9ABC_DEF0)
        _same(a, b, "rotation n=%d block 2**%d" % (n, block_log2))
        C.rotate(a, block_log2, 0x1234_5678_9ABC_DEF0, inverse=True)
        D.rotate(b, block_log2, 0x1234_5678_9ABC_DEF0, inverse=True)
        _same(a, b, "inverse rotation n=%d block 2**%d" % (n, block_log2))


@pytest.mark.parametrize("m", [5, 10])
def test_rotation_near_the_float32_limit_matches(m):
    x = torch.full((3 << m,), 3.0e38)
    x[1::2] = -3.0e38
    a, b = x.clone(), x.clone()
    C.rotate(a, m, 9)
    D.rotate(b, m, 9)
    _same(a, b, "rotation of values near the float32 limit (overflows included)")


@pytest.mark.parametrize("scale_log2", [0, 3, 10, C.ONE_SCALE])
def test_block_maxima_and_the_nonfinite_count_match(scale_log2):
    for n in SIZES:
        x = _vector(n, 3 * n + 1)
        if n > 10:
            x[3], x[5], x[n - 1] = float("nan"), float("inf"), -float("inf")
        ref, bad = C.block_absmax(x, scale_log2)
        got, got_bad = D.block_absmax(x, scale_log2)
        _same(torch.from_numpy(ref), got, "block maxima n=%d" % n)
        assert int(got_bad) == bad


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("stochastic", [False, True])
def test_quantize_and_decode_match_the_c_kernels(bits, stochastic):
    for n in SIZES:
        for scale_log2 in (3, 10):
            for clusters in (1, 2, 16):
                lane = C.lane_bits(bits, clusters)
                x = _vector(n, 7 * n + bits)
                scales, _ = C.block_absmax(x, scale_log2)
                scales = (scales * np.float32(0.8)).astype(np.float32)   # some entries beyond the scale
                if scales.size > 2:
                    scales[0] = 0.0                                          # a zero scale: all levels 0
                    scales[1] = np.float32(1e-45)                            # L / s overflows: levels 0
                a, b = x.clone(), x.clone()
                w_c = C.quantize(a, bits, scales, 0xFEED + n, lane, stochastic=stochastic, scale_log2=scale_log2)
                w_d = D.quantize(b, bits, torch.from_numpy(scales), 0xFEED + n, lane, stochastic=stochastic,
                                 scale_log2=scale_log2)
                what = "n=%d bits=%d lane=%d stochastic=%s" % (n, bits, lane, stochastic)
                _same(a, b, "what was sent, " + what)
                _same(torch.from_numpy(w_c.view(np.int64)), w_d, "words, " + what)
                out_c = C.unpack_sum(w_c, n, bits, 1, lane, scales, scale_log2=scale_log2)
                out_d = D.unpack_sum(w_d, n, bits, 1, lane, torch.from_numpy(scales), torch.empty(n),
                                     scale_log2=scale_log2)
                _same(out_c, out_d, "decoded, " + what)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("clusters", [2, 3, 7, 16])
def test_words_summed_over_clusters_decode_alike(bits, clusters):
    """What MPI's SUM of every cluster's words gives, extreme levels included, decodes to the
    C kernel's bits."""
    lane = C.lane_bits(bits, clusters)
    for n in (1, 64 // lane, 64 // lane + 1, 3000):
        scales = np.full(C.scale_count(n, 10), 2.5, np.float32)
        total = np.zeros(C.words_for(n, lane), np.uint64)
        for r in range(clusters):
            x = torch.from_numpy(np.random.default_rng(r).uniform(-2.5, 2.5, n).astype(np.float32))
            x[-1] = 2.5 if r % 2 else 9.0          # the top level from every cluster at the last entry
            with np.errstate(over="ignore"):
                total = total + C.quantize(x, bits, scales, r + 1, lane, scale_log2=10)
        ref = C.unpack_sum(total, n, bits, clusters, lane, scales, scale_log2=10)
        got = D.unpack_sum(torch.from_numpy(total.view(np.int64)), n, bits, clusters, lane, torch.from_numpy(scales),
                           torch.empty(n), scale_log2=10)
        _same(ref, got, "sum of %d clusters, n=%d" % (clusters, n))


def test_malformed_words_are_refused_as_the_c_kernel_refuses_them():
    bits, clusters = 4, 2
    lane = C.lane_bits(bits, clusters)             # 5 bits: 12 lanes, 4 unused bits per word
    n = 14                                         # 2 words, the second with 2 lanes used
    scales = np.ones(1, np.float32)
    good = C.quantize(torch.zeros(n), bits, scales, 3, lane, scale_log2=C.ONE_SCALE) * np.uint64(2)
    rng = np.random.default_rng(5)
    cases = [(0, good[0] | np.uint64(1 << 62)),                  # a bit past the last whole lane
             (0, good[0] | np.uint64(1 << 63)),                  # the top bit (a negative int64)
             (1, good[1] | np.uint64(1 << (2 * lane))),          # a lane past n
             (0, (good[0] & ~np.uint64(31)) | np.uint64(29))]    # a lane above 2 L C = 28
    cases += [(int(rng.integers(2)), np.uint64(rng.integers(0, 2**63)) * np.uint64(rng.integers(1, 3)))
              for _ in range(200)]
    refused = 0
    for word, value in cases:
        bad = good.copy()
        bad[word] = value
        try:
            ref = C.unpack_sum(bad, n, bits, clusters, lane, scales, scale_log2=C.ONE_SCALE)
        except MalformedPayloadError:
            ref = None
        args = (torch.from_numpy(bad.view(np.int64)), n, bits, clusters, lane, torch.from_numpy(scales),
                torch.empty(n))
        if ref is None:
            refused += 1
            with pytest.raises(MalformedPayloadError, match="THC words"):
                D.unpack_sum(*args, scale_log2=C.ONE_SCALE)
        else:
            _same(ref, D.unpack_sum(*args, scale_log2=C.ONE_SCALE), "accepted words %r" % value)
    assert refused >= 4
    with pytest.raises(MalformedPayloadError, match="expected 2"):        # a word missing
        D.unpack_sum(torch.from_numpy(good[:1].view(np.int64)), n, bits, clusters, lane, torch.from_numpy(scales),
                     torch.empty(n), scale_log2=C.ONE_SCALE)
    with pytest.raises(ValueError, match="cannot hold the sum of 16 clusters"):
        D.unpack_sum(torch.from_numpy(good.view(np.int64)), n, bits, 16, lane, torch.from_numpy(scales),
                     torch.empty(n), scale_log2=C.ONE_SCALE)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="bits must be in"):
        D.quantize(torch.zeros(4), 9, torch.ones(1), 0, 5, scale_log2=C.ONE_SCALE)
    with pytest.raises(ValueError, match="cannot hold 4-bit levels"):
        D.quantize(torch.zeros(4), 4, torch.ones(1), 0, 3, scale_log2=C.ONE_SCALE)
    with pytest.raises(ValueError, match="3 scales for 4 entries"):
        D.quantize(torch.zeros(4), 4, torch.ones(3), 0, 5, scale_log2=C.ONE_SCALE)
    with pytest.raises(ValueError, match="block_log2"):
        D.rotate(torch.zeros(4), 0, 1)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_the_compressor_on_the_device_route_equals_the_host_route(monkeypatch, rounding):
    """Three steps of begin, quantize (two clusters' words summed), finish, with error feedback:
    the results and the residuals are the host route's bits."""
    comps = [THCCompressor(bits=4, rounding=rounding), THCCompressor(bits=4, rounding=rounding)]
    results = {}
    for path in ("host", "torch"):
        if path == "torch":
            monkeypatch.setenv("STELLA_DEVICE_PATH", "torch")
        else:
            monkeypatch.delenv("STELLA_DEVICE_PATH", raising=False)
        mems = [Memory(), Memory()]
        outs = []
        for step in range(3):
            ctx = TensorContext(name="w", step=step, shape=(5000,), seed=11)
            works = [comps[r].begin(_vector(5000, 100 * step + r), ctx, mems[r]) for r in range(2)]
            scales = np.maximum(works[0].absmax, works[1].absmax)
            words = [comps[r].quantize(works[r], scales, 2, r) for r in range(2)]
            words = [w if isinstance(w, np.ndarray) else w.numpy().view(np.uint64) for w in words]
            assert all(w.dtype == np.uint64 for w in words)
            with np.errstate(over="ignore"):
                total = words[0] + words[1]
            outs.append([comps[r].finish(works[r], total, 2, scales, mems[r]).clone() for r in range(2)])
            outs[-1] += [mems[r].get("w").clone() for r in range(2)]
        results[path] = outs
    for step, (h, d) in enumerate(zip(results["host"], results["torch"])):
        for i, (a, b) in enumerate(zip(h, d)):
            _same(a, b, "step %d, %s %d" % (step, "sum" if i < 2 else "residual", i % 2))
