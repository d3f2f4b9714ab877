"""The THC kernels (c_src/thc.c) against numpy references: lane widths, the randomized
Hadamard rotation (against an explicit Sylvester matrix), stochastic rounding and packing (bit
for bit), the lane sums of 1 to 16 clusters and beyond at their edges, and bad input."""
import numpy as np
import pytest
import torch

from stella_mpi._native import MalformedPayloadError
from stella_mpi._native import thc as T

M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def mix64(z):
    """splitmix64's finalizer on uint64 numpy arrays (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = (z + np.uint64(0x9E3779B97F4A7C15)) & M64
        z = ((z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & M64
        z = ((z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & M64
        return z ^ (z >> np.uint64(31))


def ref_lane_bits(bits, c):
    return int(2 * ((1 << (bits - 1)) - 1) * c).bit_length()


def ref_signs(n, key):
    i = np.arange(n, dtype=np.uint64)
    h = mix64(np.uint64(key) ^ (i >> np.uint64(6)))
    return ((h >> (i & np.uint64(63))) & np.uint64(1)).astype(bool)


def hadamard(m):
    h = np.array([[1.0]])
    for _ in range(m):
        h = np.block([[h, h], [h, -h]])
    return h


def ref_rotate(x, m, key, inverse=False):
    x = x.astype(np.float64).copy()
    b = 1 << m
    neg = ref_signs(x.size, key)
    h = hadamard(m) / np.sqrt(b)
    for s in range(0, x.size - b + 1, b):
        blk = x[s:s + b]
        sg = np.where(neg[s:s + b], -1.0, 1.0)
        x[s:s + b] = sg * (h @ blk) if inverse else h @ (sg * blk)
    return x


def ref_draws(n, key):
    i = np.arange(n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = mix64((np.uint64(key) + (i >> np.uint64(1)) * np.uint64(0xD1342543DE82EF95)) & M64)
    r = np.where(i & np.uint64(1), (h >> np.uint64(16)) & np.uint64(0xFFFFFF), h >> np.uint64(40))
    return r.astype(np.float32) * np.float32(2.0 ** -24)


def ref_entry_scales(scale, n, scale_log2):
    """The scale of each entry: one number for all, or scale[i >> scale_log2]."""
    if scale_log2 is None:
        return np.full(n, np.float32(scale), np.float32)
    return np.asarray(scale, np.float32)[np.arange(n) >> scale_log2]


def ref_quantize(x, bits, scale, key, lane, stochastic=True, scale_log2=None):
    """(levels q, what was sent, packed words) in the kernel's float32 sequence."""
    L = (1 << (bits - 1)) - 1
    x = x.astype(np.float32)
    s = ref_entry_scales(scale, x.size, scale_log2)
    with np.errstate(over="ignore", divide="ignore"):
        inv = np.where(s > 0, np.float32(L) / s, np.float32(0)).astype(np.float32)
    inv[np.isinf(inv)] = 0
    u = ref_draws(x.size, key) if stochastic else np.full(x.size, 0.5, np.float32)
    t = (x * inv).astype(np.float32) + u
    q = np.clip(np.floor(t.astype(np.float32)), -L, L).astype(np.int64)
    sent = q.astype(np.float32) * (s / np.float32(L))
    return q, sent, ref_pack(q + L, lane)


def ref_pack(lanes, lane):
    per = 64 // lane
    nw = -(-lanes.size // per)
    padded = np.zeros(nw * per, np.uint64)
    padded[:lanes.size] = lanes.astype(np.uint64)
    shifts = (np.arange(per, dtype=np.uint64) * np.uint64(lane))
    return np.bitwise_or.reduce(padded.reshape(nw, per) << shifts, axis=1) if nw else np.zeros(0, np.uint64)


def ref_unpack_sum(total_levels, bits, c, scale, scale_log2=None):
    L = (1 << (bits - 1)) - 1
    s = ref_entry_scales(scale, total_levels.size, scale_log2)
    return (total_levels - L * c).astype(np.float32) * (s / np.float32(L))


def ref_block_absmax(x, scale_log2):
    a = np.where(np.isfinite(x), np.abs(x), 0).astype(np.float32)
    b = 1 << scale_log2
    return np.array([a[i:i + b].max() for i in range(0, x.size, b)], np.float32)


SIZES = [0, 1, 2, 3, 63, 64, 65, 1000, 2**15 - 1, 2**15, 2**15 + 1, 2**16, 2**16 + 5]


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_lane_bits_hold_the_sum_of_every_cluster(bits):
    for c in list(range(1, 17)) + [100, 4096, T.MAX_CLUSTERS]:
        assert T.lane_bits(bits, c) == ref_lane_bits(bits, c)
        L = T.levels(bits)
        assert 2 * L * c < 2 ** T.lane_bits(bits, c)   # the largest sum fits: no carry into the next lane
    for bad in ((1, 2), (9, 2), (4, 0), (4, T.MAX_CLUSTERS + 1)):
        with pytest.raises(ValueError, match="stella_thc_lane_bits"):
            T.lane_bits(*bad)


@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 10])
def test_rotation_matches_the_explicit_hadamard_matrix_and_inverts(m):
    rng = np.random.default_rng(m)
    for n in [0, 1, (1 << m) - 1, 1 << m, 3 * (1 << m) + 5, 2000]:
        x = rng.standard_normal(n).astype(np.float32)
        y = torch.from_numpy(x.copy())
        T.rotate(y, m, key=0xABCDEF + m)
        np.testing.assert_allclose(y.numpy(), ref_rotate(x, m, 0xABCDEF + m), rtol=1e-5, atol=1e-5)
        full = n - n % (1 << m)
        assert np.array_equal(y.numpy()[full:], x[full:])           # the tail is left as it is
        np.testing.assert_allclose(np.linalg.norm(y.numpy()), np.linalg.norm(x), rtol=1e-5)   # orthonormal
        T.rotate(y, m, key=0xABCDEF + m, inverse=True)
        np.testing.assert_allclose(y.numpy(), x, rtol=1e-5, atol=1e-5)


def test_rotation_spreads_an_outlier():
    x = torch.zeros(4096)
    x[17] = 1000.0
    T.rotate(x, 10, key=5)
    assert T.absmax(x)[0] == pytest.approx(1000.0 / 32, rel=1e-6)   # 1000 / sqrt(1024) in every entry of its block


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("n", SIZES)
def test_quantize_matches_the_reference_bit_for_bit(bits, n):
    rng = np.random.default_rng(n + bits)
    x = (rng.standard_normal(n) * rng.choice([1e-3, 1.0, 50.0])).astype(np.float32)
    if n:
        x[rng.integers(0, n)] = 0.0
    scale = float(np.abs(x).max()) if n else 0.0
    for c, stochastic in ((1, True), (2, True), (16, True), (2, False), (16, False)):
        lane = T.lane_bits(bits, c)
        key = 0x1234 + n
        y = torch.from_numpy(x.copy())
        words = T.quantize(y, bits, scale, key, lane, stochastic=stochastic)
        q, sent, ref_words = ref_quantize(x, bits, scale, key, lane, stochastic)
        assert words.dtype == np.uint64 and np.array_equal(words, ref_words)
        assert np.array_equal(y.numpy().view(np.uint32), sent.view(np.uint32))
        L = T.levels(bits)
        assert q.min(initial=0) >= -L and q.max(initial=0) <= L


@pytest.mark.parametrize("scale_log2", [0, 3, 10])
@pytest.mark.parametrize("n", SIZES)
def test_quantize_and_unpack_with_a_scale_per_block_match_the_reference(scale_log2, n):
    """A scale per block of 2**scale_log2 entries, blocks of very different magnitudes (as a
    fused bucket of several tensors), one block at scale 0 and one subnormal: levels, what was
    sent, words and the decoded sum of 3 clusters bit for bit."""
    rng = np.random.default_rng(n + 31 * scale_log2)
    nb = T.scale_count(n, scale_log2)
    assert nb == -(-n // (1 << scale_log2))
    mag = rng.choice([1e-4, 1.0, 300.0], nb).astype(np.float32)
    if nb > 2:
        mag[1], mag[2] = 0.0, np.float32(1e-44)
    bits, c = 4, 3
    lane = T.lane_bits(bits, c)
    xs = [(rng.standard_normal(n) * mag[np.arange(n) >> scale_log2]).astype(np.float32) for _ in range(c)]
    maxes = [T.block_absmax(torch.from_numpy(x.copy()), scale_log2) for x in xs]
    for x, (m, bad) in zip(xs, maxes):
        assert bad == 0 and m.dtype == np.float32 and np.array_equal(m, ref_block_absmax(x, scale_log2))
    scales = np.maximum.reduce([m for m, _ in maxes]) if n else np.zeros(0, np.float32)
    words_sum = np.zeros(T.words_for(n, lane), np.uint64)
    total = np.zeros(n, np.int64)
    for r, x in enumerate(xs):
        y = torch.from_numpy(x.copy())
        words = T.quantize(y, bits, scales, key=r + 5, lane=lane, stochastic=r != 1, scale_log2=scale_log2)
        q, sent, ref_words = ref_quantize(x, bits, scales, r + 5, lane, r != 1, scale_log2)
        assert np.array_equal(words, ref_words)
        assert np.array_equal(y.numpy().view(np.uint32), sent.view(np.uint32))
        with np.errstate(over="ignore"):
            words_sum = words_sum + words
        total += q + T.levels(bits)
    out = T.unpack_sum(words_sum, n, bits, c, lane, scales, scale_log2=scale_log2).numpy()
    assert np.array_equal(out.view(np.uint32), ref_unpack_sum(total, bits, c, scales, scale_log2).view(np.uint32))


def test_a_scale_per_block_keeps_small_tensors_of_a_fused_buffer():
    """The reason for block scales: a buffer of a large and a small tensor. Under one scale the
    small one rounds to zero; with a scale per block it is sent within half a step of its own
    scale."""
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.standard_normal(1024) * 100, rng.standard_normal(1024) * 1e-3]).astype(np.float32)
    lane = T.lane_bits(4, 1)
    one = torch.from_numpy(x.copy())
    T.quantize(one, 4, float(np.abs(x).max()), key=0, lane=lane, stochastic=False)
    assert torch.count_nonzero(one[1024:]) == 0
    blocks = torch.from_numpy(x.copy())
    scales, _ = T.block_absmax(blocks, 10)
    T.quantize(blocks, 4, scales, key=0, lane=lane, stochastic=False, scale_log2=10)
    err = np.abs(blocks.numpy() - x)
    assert np.all(err[1024:] <= scales[1] / 7 / 2 * (1 + 1e-6)) and torch.count_nonzero(blocks[1024:]) > 500


def test_scale_arguments_are_checked():
    lane = T.lane_bits(4, 1)
    with pytest.raises(ValueError, match="stella_thc_quantize"):          # 3 blocks of 2, 2 scales
        T.quantize(torch.ones(5), 4, np.ones(2, np.float32), key=1, lane=lane, scale_log2=1)
    with pytest.raises(ValueError, match="stella_thc_quantize"):          # a NaN scale in a later block
        T.quantize(torch.ones(4), 4, np.array([1.0, np.nan], np.float32), key=1, lane=lane, scale_log2=1)
    words = T.quantize(torch.ones(4), 4, np.ones(2, np.float32), key=1, lane=lane, scale_log2=1)
    with pytest.raises(ValueError, match="stella_thc_unpack_sum"):
        T.unpack_sum(words, 4, 4, 1, lane, np.array([1.0, -1.0], np.float32), scale_log2=1)
    for bad in (-1, T.ONE_SCALE + 1):
        with pytest.raises(ValueError, match="stella_thc_scale_count"):
            T.scale_count(4, bad)
    for n in (2**31 - 1, 2**31, 2**31 + 1, 2**40):   # counts only, nothing allocated
        assert T.scale_count(n, 10) == -(-n // 1024) and T.scale_count(n, T.ONE_SCALE) == 1


def test_stochastic_rounding_is_unbiased_and_error_bounded():
    x = np.full(200000, 0.3, np.float32)
    y = torch.from_numpy(x.copy())
    T.quantize(y, 4, 1.0, key=99, lane=T.lane_bits(4, 2))
    step = 1.0 / 7
    assert np.all(np.abs(y.numpy() - x) < step + 1e-6)
    assert abs(float(y.mean()) - 0.3) < 0.002                        # E[q * step] = x
    assert set(np.round(np.unique(y.numpy()) / step).astype(int)) == {2, 3}   # the two neighbours of 2.1 steps
    y = torch.from_numpy(x.copy())
    T.quantize(y, 4, 1.0, key=99, lane=T.lane_bits(4, 2), stochastic=False)
    assert torch.equal(y, torch.full_like(y, float(np.float32(2.0) * (np.float32(1.0) / np.float32(7)))))  # nearest


def test_quantize_edges_and_bad_input():
    lane = T.lane_bits(4, 2)
    y = torch.tensor([1.0, -1.0, 0.5])
    words = T.quantize(y, 4, 0.0, key=1, lane=lane)                   # scale 0: every level is zero
    assert torch.equal(y, torch.zeros(3)) and np.array_equal(T.unpack_sum(words, 3, 4, 1, lane, 0.0).numpy(), np.zeros(3))
    y = torch.tensor([2.0, -3.0, 3e38, -3e38])                         # beyond the scale: clamped to +-L
    T.quantize(y, 4, 1.0, key=1, lane=lane)
    assert y.tolist() == [1.0, -1.0, 1.0, -1.0]
    tiny = np.float32(1e-44)                                           # subnormal: L / scale overflows
    x = np.array([tiny, -tiny, 0.0], np.float32)
    y = torch.from_numpy(x.copy())
    words = T.quantize(y, 8, float(tiny), key=1, lane=T.lane_bits(8, 1))
    assert torch.equal(y, torch.zeros(3)) and np.array_equal(words, ref_quantize(x, 8, tiny, 1, T.lane_bits(8, 1))[2])
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = torch.tensor([0.1, bad, 0.2])
        before = y.clone()
        with pytest.raises(ValueError, match="stella_thc_quantize"):
            T.quantize(y, 4, 1.0, key=1, lane=lane)
        assert torch.equal(y[[0, 2]], before[[0, 2]])                  # nothing written
    for scale in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match="stella_thc_quantize"):
            T.quantize(torch.ones(3), 4, scale, key=1, lane=lane)
    with pytest.raises(ValueError, match="stella_thc_quantize"):      # a lane too narrow for one level
        T.quantize(torch.ones(3), 8, 1.0, key=1, lane=4)
    with pytest.raises(ValueError, match="stella_thc_quantize"):
        T.quantize(torch.ones(3), 9, 1.0, key=1, lane=12)
    with pytest.raises(TypeError):
        T.quantize(torch.ones(3, dtype=torch.float64), 4, 1.0, key=1, lane=lane)


def test_absmax_counts_nonfinite_and_ignores_them():
    x = torch.tensor([1.0, -7.5, float("nan"), float("inf"), 3.0, -float("inf")])
    assert T.absmax(x) == (7.5, 3)
    assert T.absmax(torch.empty(0)) == (0.0, 0)
    assert T.absmax(torch.tensor([float("nan")])) == (0.0, 1)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("c", [1, 2, 3, 4, 7, 8, 15, 16])
def test_summed_words_decode_to_the_sum_of_levels(bits, c):
    """Words of c clusters added as 64-bit integers (what MPI's SUM does) decode to the sum of
    their levels, also when every cluster sends the extreme level (the lane's largest sum)."""
    rng = np.random.default_rng(bits * 100 + c)
    lane = T.lane_bits(bits, c)
    L = T.levels(bits)
    for n in (1, 5, 64 // lane, 64 // lane + 1, 1001):
        scale = 2.5
        total = np.zeros(n, np.int64)
        words_sum = np.zeros(T.words_for(n, lane), np.uint64)
        for r in range(c):
            x = rng.uniform(-scale, scale, n).astype(np.float32)
            if r % 2 == 0:
                x[0] = scale                        # the top level from every other cluster ...
            x[-1] = scale                           # ... and from all of them at the last entry
            y = torch.from_numpy(x)
            with np.errstate(over="ignore"):
                words_sum = words_sum + T.quantize(y, bits, scale, key=r * 7 + 1, lane=lane)
            total += ref_quantize(x, bits, scale, r * 7 + 1, lane)[0] + L
        assert total[-1] == 2 * L * c               # the edge: the largest sum a lane must hold
        out = T.unpack_sum(words_sum, n, bits, c, lane, scale).numpy()
        assert np.array_equal(out.view(np.uint32), ref_unpack_sum(total, bits, c, scale).view(np.uint32))


def test_unpack_refuses_lanes_out_of_range_and_stray_bits():
    bits, c = 4, 2
    lane = T.lane_bits(bits, c)                     # 5 bits: 12 lanes, 4 unused bits per word
    n = 14                                          # 2 words, the second with 2 lanes used
    good = T.quantize(torch.zeros(n), bits, 1.0, key=3, lane=lane) * np.uint64(2)
    assert np.array_equal(T.unpack_sum(good, n, bits, c, lane, 1.0).numpy(), np.zeros(n, np.float32))
    for word, value in ((0, good[0] | np.uint64(1 << 62)),                    # a bit past the last whole lane
                        (1, good[1] | np.uint64(1 << (2 * lane))),            # a lane past n
                        (0, (good[0] & ~np.uint64(31)) | np.uint64(29))):     # a lane above 2 L c = 28
        bad = good.copy()
        bad[word] = value
        with pytest.raises(MalformedPayloadError, match="stella_thc_unpack_sum"):
            T.unpack_sum(bad, n, bits, c, lane, 1.0)
    with pytest.raises(ValueError, match="stella_thc_unpack_sum"):   # wrong number of words
        T.unpack_sum(good[:1], n, bits, c, lane, 1.0)
    with pytest.raises(ValueError, match="stella_thc_unpack_sum"):   # lanes too narrow for the clusters
        T.unpack_sum(good, n, bits, 16, lane, 1.0)


def test_sizes_near_two_to_the_31():
    """Sizes alone at 2^31 and beyond: the word count does not overflow (no data allocated)."""
    for n in (2**31 - 1, 2**31, 2**31 + 1, 2**40):
        for lane in (3, 5, 9, 12, 32):
            per = 64 // lane
            assert T.words_for(n, lane) == -(-n // per)
    with pytest.raises(ValueError):
        T.words_for(-1, 5)
    with pytest.raises(ValueError):
        T.words_for(10, 33)


def test_a_refused_step_leaves_the_residual_as_it_was():
    """The compressor's side of a step some cluster refused (its rotated values overflowed):
    nothing was sent and every rank skips the step, so, as on the sparse route, the residual
    keeps none of this step's values; a non-finite entry in it is zeroed (none stays forever)."""
    from stella_mpi.compression import Memory, TensorContext, THCCompressor
    comp, mem = THCCompressor(bits=4), Memory()
    ctx = TensorContext(name="w", step=0, shape=(2048,))
    mem.residual("w", 2048).fill_(0.5)
    mem.get("w")[5] = float("inf")
    x = torch.ones(2048)
    x[3], x[9] = float("nan"), float("inf")
    work = comp.begin(x, ctx, mem)
    assert work.nonfinite > 0
    comp.skip_nonfinite(work, mem)
    res = mem.get("w")
    assert torch.isfinite(res).all() and res[5] == 0 and res[3] == res[9] == res[0] == 0.5


@pytest.mark.parametrize("m", [5, 10, 16])
def test_rotation_of_values_near_the_float32_limit_does_not_overflow_on_the_way(m):
    """A result that fits in float32 comes back finite: one entry of 3e38 spreads to
    3e38/sqrt(2^m) in every entry of its block, and the inverse gathers it again (normalizing
    after the butterflies overflowed there); two entries of 2e38 add up to a finite 4e38/sqrt(2^m)."""
    b = 1 << m
    x = torch.zeros(2 * b)
    x[b + 3] = 3e38
    y = x.clone()
    T.rotate(y, m, key=11)
    assert torch.isfinite(y).all() and float(y[b:].abs().max()) == pytest.approx(3e38 / np.sqrt(b), rel=1e-5)
    T.rotate(y, m, key=11, inverse=True)
    assert torch.isfinite(y).all()
    np.testing.assert_allclose(y.numpy(), x.numpy(), rtol=1e-5, atol=3e38 * 1e-6)
    two = torch.zeros(b)
    two[0] = two[1] = 2e38
    T.rotate(two, m, key=3)
    assert torch.isfinite(two).all() and float(two.abs().max()) == pytest.approx(4e38 / np.sqrt(b), rel=1e-5)


def test_compressor_settings_round_trip_and_refusals():
    from stella_mpi.compression import THCCompressor
    for kw in ({}, {"bits": 2, "rotation": False}, {"bits": 8, "error_feedback": False}, {"rounding": "stochastic"}):
        c = THCCompressor(**kw)
        assert THCCompressor.from_settings(c.settings()).settings() == c.settings()
    assert THCCompressor(error_feedback=False).rounding == "stochastic" and THCCompressor().rounding == "nearest"
    for kw in ({"bits": 1}, {"bits": 9}, {"bits": True}, {"block_log2": 0}, {"block_log2": True}, {"rounding": "up"}):
        with pytest.raises(ValueError, match="Compression.thc"):
            THCCompressor(**kw)
