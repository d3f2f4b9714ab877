"""The THC kernels (c_src/thc.c) in torch operations, for shards that live on a GPU.

On the device route THC's per-entry work runs where the shard is: the rotation, the block
maxima, the quantization into integer lanes and the decoding of the summed lanes. Only the block
maxima (4 bytes per 2**block_log2 entries) and the packed lanes cross PCIe, in each direction,
instead of the whole float32 shard twice.

Every function gives the C kernel's bits (checked on CPU tensors against them, and under
``STELLA_DEVICE_PATH=torch`` end to end: tests/unit/test_device_thc.py,
tests/mpi/test_device_route.py). What that takes:

* 64-bit hashes in int64 arithmetic: additions and products wrap as unsigned ones do, and a
  logical right shift is an arithmetic one masked;
* the Walsh-Hadamard butterflies in the C kernel's order (normalized first, then ``a + b`` and
  ``a - b`` per level): each level is one elementwise add and one subtract, which IEEE rounds
  the same way on every device;
* no division by a scalar: torch computes ``tensor / scalar`` on CUDA as a product with the
  reciprocal, which can differ in the last bit, so ``L / scale`` and ``scale / L`` divide by
  tensors;
* levels through an integer, so that a level of 0 is +0.0 as in C.
"""
import torch

from .._native import MalformedPayloadError
from .._native import thc as kernels

__all__ = ["rotate", "block_absmax", "quantize", "unpack_sum"]

_MASK64 = (1 << 64) - 1
_DRAW_MUL = 0xD1342543DE82EF95


def _i64(c):
    """The int64 with the bits of unsigned 64-bit ``c``."""
    c &= _MASK64
    return c - (1 << 64) if c >= 1 << 63 else c


def _srl(z, s):
    """Logical right shift of int64 ``z`` by the constant ``s`` (1..63)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def mix64(z):
    """splitmix64's finalizer (``stella_mix64``) of int64 tensor ``z``, wrapping."""
    z = z + _i64(0x9E3779B97F4A7C15)
    z = (z ^ _srl(z, 30)) * _i64(0xBF58476D1CE4E5B9)
    z = (z ^ _srl(z, 27)) * _i64(0x94D049BB133111EB)
    return z ^ _srl(z, 31)


def _sign_bits(n, key, device):
    """int32 masks with bit 31 set where entry i of the first ``n`` is negated: bit (i % 64) of
    mix64(key ^ (i / 64))."""
    groups = (n + 63) >> 6
    h = mix64(torch.arange(groups, dtype=torch.int64, device=device) ^ _i64(key))
    shifts = torch.arange(64, dtype=torch.int64, device=device)
    bit = ((h[:, None] >> shifts[None, :]) & 1).reshape(-1)[:n]
    return torch.where(bit.bool(), torch.tensor(-(1 << 31), dtype=torch.int32, device=device),
                       torch.tensor(0, dtype=torch.int32, device=device))


def _fwht(blocks, norm):
    """Walsh-Hadamard transform of each row of ``blocks`` (rows of 2**k entries, natural
    order) times ``norm``, with the C kernel's rounding: normalized first, then per level the
    butterflies ``a + b`` and ``a - b``. Returns a new tensor."""
    nb, length = blocks.shape
    x = blocks * norm
    y = torch.empty_like(x)
    h = 1
    while h < length:
        v = x.view(nb, length // (2 * h), 2, h)
        w = y.view(nb, length // (2 * h), 2, h)
        torch.add(v[:, :, 0, :], v[:, :, 1, :], out=w[:, :, 0, :])
        torch.sub(v[:, :, 0, :], v[:, :, 1, :], out=w[:, :, 1, :])
        x, y = y, x
        h <<= 1
    return x


def _norm(length):
    """1 / sqrtf(length) in float32 (both operations correctly rounded, as in C)."""
    t = torch.tensor(float(length), dtype=torch.float32)
    return float(torch.div(torch.ones((), dtype=torch.float32), torch.sqrt(t)))


def rotate(x, block_log2, key, inverse=False):
    """``stella_thc_rotate``: randomized Hadamard rotation of each full block of
    2**block_log2 entries of flat float32 ``x``, in place (the short tail is left as it is)."""
    if not 1 <= int(block_log2) <= kernels.MAX_BLOCK_LOG2:
        raise ValueError("rotate: block_log2 must be in [1, %d], got %r" % (kernels.MAX_BLOCK_LOG2, block_log2))
    length = 1 << int(block_log2)
    full = (x.numel() // length) * length
    if full == 0:
        return x
    head = x[:full]
    signs = _sign_bits(full, int(key), x.device)
    bits = head.view(torch.int32)
    if not inverse:
        bits.bitwise_xor_(signs)
        head.copy_(_fwht(head.view(-1, length), _norm(length)).view(-1))
    else:
        head.copy_(_fwht(head.view(-1, length), _norm(length)).view(-1))
        bits.bitwise_xor_(signs)
    return x


def _blocks(t, scale_log2, fill):
    """``t`` padded with ``fill`` to whole blocks of 2**scale_log2 entries, as rows."""
    n = t.numel()
    count = kernels.scale_count(n, scale_log2)
    if count <= 1:   # one block (or none): the whole vector, whatever 2**scale_log2 is
        return t.view(count, n)
    length = 1 << int(scale_log2)
    pad = count * length - n
    if pad:
        t = torch.cat([t, torch.full((pad,), fill, dtype=t.dtype, device=t.device)])
    return t.view(count, length)


def block_absmax(x, scale_log2):
    """``stella_thc_absmax``: (float32 tensor on x's device: the largest finite |x| of each block
    of 2**scale_log2 entries, int64 0-dim tensor: the number of NaN/Inf entries)."""
    n = x.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.float32, device=x.device), torch.zeros((), dtype=torch.int64,
                                                                                device=x.device)
    mag = x.reshape(-1).view(torch.int32) & 0x7FFFFFFF
    bad = mag >= 0x7F800000
    mag = torch.where(bad, torch.zeros_like(mag), mag)
    best = _blocks(mag, scale_log2, 0).amax(dim=1)
    return best.view(torch.float32), bad.sum()


def _factors(scales, levels):
    """Per block: L / s (0 where s is 0 or L / s overflows) and s / L, divided as C does."""
    lv = torch.full_like(scales, float(levels))
    inv = torch.div(lv, scales)
    inv = torch.where((scales > 0) & torch.isfinite(inv), inv, torch.zeros_like(inv))
    return inv, torch.div(scales, lv)


def _draws(key, n, device):
    """``draw(key, i)`` of c_src/thc.c for i < n: 24-bit uniforms in [0, 1)."""
    i = torch.arange(n, dtype=torch.int64, device=device)
    h = mix64((i >> 1) * _i64(_DRAW_MUL) + _i64(key))
    r = torch.where((i & 1).bool(), _srl(h, 16) & 0xFFFFFF, _srl(h, 40))
    return r.to(torch.float32) * (2.0 ** -24)


def _check_scales(scales, n, scale_log2):
    count = kernels.scale_count(n, scale_log2)
    if scales.numel() != count:
        raise ValueError("%d scales for %d entries in blocks of 2**%d: expected %d" % (
            scales.numel(), n, scale_log2, count))


def quantize(x, bits, scales, key, lane, stochastic=True, scale_log2=kernels.ONE_SCALE):
    """``stella_thc_quantize`` of flat float32 ``x`` (finite: the caller refuses a step with a
    NaN or Inf before it quantizes), in place (x becomes what was sent); returns the packed
    words as an int64 tensor on x's device (the bits of the C kernel's uint64 words).
    ``scales``: float32 tensor, one per block of 2**scale_log2 entries."""
    n = x.numel()
    if not kernels.MIN_BITS <= int(bits) <= kernels.MAX_BITS:
        raise ValueError("quantize: bits must be in [%d, %d], got %r" % (kernels.MIN_BITS, kernels.MAX_BITS, bits))
    if int(lane) < kernels.lane_bits(bits, 1) or int(lane) > 32:
        raise ValueError("quantize: a lane of %r bits cannot hold %d-bit levels" % (lane, bits))
    _check_scales(scales, n, scale_log2)
    nwords = kernels.words_for(n, lane)
    if n == 0:
        return torch.zeros(0, dtype=torch.int64, device=x.device)
    levels = kernels.levels(bits)
    inv, step = _factors(scales.to(device=x.device, dtype=torch.float32), levels)
    rows = _blocks(x, scale_log2, 0.0)
    t = (rows * inv[:, None]).view(-1)[:n]
    if stochastic:
        t = t + _draws(int(key), n, x.device)
    else:
        t = t + 0.5
    t = t.clamp_(-levels - 1, levels + 1)
    q = torch.floor(t).to(torch.int32).clamp_(-levels, levels)
    sent = _blocks(q.to(torch.float32), scale_log2, 0.0) * step[:, None]
    x.copy_(sent.view(-1)[:n])
    lanes = 64 // int(lane)
    vals = torch.zeros(nwords * lanes, dtype=torch.int64, device=x.device)
    vals[:n] = q.to(torch.int64) + levels
    shifts = torch.arange(lanes, dtype=torch.int64, device=x.device) * int(lane)
    # the lanes' bit fields do not overlap, so their sum is their OR (wrapping into bit 63)
    return (vals.view(nwords, lanes) << shifts[None, :]).sum(dim=1)


def unpack_sum(words, n, bits, nclusters, lane, scales, out, scale_log2=kernels.ONE_SCALE):
    """``stella_thc_unpack_sum``: the float sum of ``nclusters`` quantized vectors from their
    summed ``words`` (int64 tensor on ``out``'s device) into ``out`` (float32, n entries).
    MalformedPayloadError when a lane is above 2 L C or a bit past the used lanes is set."""
    n = int(n)
    need_lane = kernels.lane_bits(bits, nclusters)
    if int(lane) < need_lane or int(lane) > 32:
        raise ValueError("unpack_sum: a lane of %r bits cannot hold the sum of %d clusters at %d bits"
                         % (lane, nclusters, bits))
    _check_scales(scales, n, scale_log2)
    nwords = kernels.words_for(n, lane)
    if words.numel() != nwords:
        raise MalformedPayloadError("THC words: %d words for %d entries in %d-bit lanes, expected %d"
                                    % (words.numel(), n, lane, nwords))
    if out.numel() != n:
        raise ValueError("output has %d elements, expected %d" % (out.numel(), n))
    if n == 0:
        return out
    levels = kernels.levels(bits)
    top = 2 * levels * int(nclusters)
    lanes = 64 // int(lane)
    dev = out.device
    words = words.to(dev).view(-1)
    shifts = torch.arange(lanes, dtype=torch.int64, device=dev) * int(lane)
    lane_vals = ((words[:, None] >> shifts[None, :]) & ((1 << int(lane)) - 1)).view(-1)[:n]
    # bits past the lanes a word uses must be zero (the last word may use fewer lanes)
    used = torch.full((nwords,), lanes * int(lane), dtype=torch.int64, device=dev)
    used[-1] = (n - (nwords - 1) * lanes) * int(lane)
    stray = (used < 64) & ((words >> used.clamp(max=63)) != 0)
    bad = bool((stray.any() | (lane_vals > top).any()).item())
    if bad:
        raise MalformedPayloadError("THC words: a lane above %d (the sum of %d clusters at %d bits) or a stray "
                                    "bit past the used lanes" % (top, nclusters, bits))
    _, step = _factors(scales.to(device=dev, dtype=torch.float32), levels)
    summed = (lane_vals - levels * int(nclusters)).to(torch.float32)
    out.copy_((_blocks(summed, scale_log2, 0.0) * step[:, None]).view(-1)[:n])
    return out
