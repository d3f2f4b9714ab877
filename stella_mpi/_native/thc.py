"""Wrappers of the homomorphic-quantization kernels (``c_src/stella_thc.h``): lane widths,
the Hadamard rotation, the quantizer that packs integer lanes into 64-bit words, and the
checked unpacking of the words' sum. Words are numpy uint64 arrays (what MPI sums)."""
import numpy as np
import torch

from . import check, ffi, lib
from .buffers import pointer

MIN_BITS = int(lib.STELLA_THC_MIN_BITS)
MAX_BITS = int(lib.STELLA_THC_MAX_BITS)
MAX_CLUSTERS = int(lib.STELLA_THC_MAX_CLUSTERS)
MAX_BLOCK_LOG2 = int(lib.STELLA_THC_MAX_BLOCK_LOG2)
ONE_SCALE = int(lib.STELLA_THC_ONE_SCALE)   # scale_log2 of one scale for the whole vector


def levels(bits):
    """L: the levels on each side of zero at ``bits`` bits (q in [-L, L])."""
    return (1 << (int(bits) - 1)) - 1


def lane_bits(bits, nclusters):
    """Bits of a lane that holds the sum of ``nclusters`` levels (no carry into the next lane)."""
    out = ffi.new("int *")
    check(lib.stella_thc_lane_bits(int(bits), int(nclusters), out),
          "stella_thc_lane_bits(bits=%r, nclusters=%r)" % (bits, nclusters))
    return out[0]


def words_for(n, lane):
    out = ffi.new("int64_t *")
    check(lib.stella_thc_words(int(n), int(lane), out), "stella_thc_words")
    return out[0]


def rotate(x, block_log2, key, inverse=False):
    """Randomized Hadamard rotation of each full block of 2**block_log2 entries, in place."""
    p, n = pointer(x, torch.float32, "rotated vector", writable=True)
    check(lib.stella_thc_rotate(p, n, int(block_log2), int(key) & (2**64 - 1), 1 if inverse else 0),
          "stella_thc_rotate")
    return x


def scale_count(n, scale_log2):
    """Scale blocks of 2**scale_log2 entries in ``n`` entries (the last may be shorter)."""
    out = ffi.new("int64_t *")
    check(lib.stella_thc_scale_count(int(n), int(scale_log2), out), "stella_thc_scale_count")
    return out[0]


def block_absmax(x, scale_log2):
    """(float32 numpy array: the largest finite |x| of each block of 2**scale_log2 entries,
    number of NaN/Inf entries)."""
    p, n = pointer(x, torch.float32, "vector")
    out = np.zeros(scale_count(n, scale_log2), dtype=np.float32)
    op, nout = pointer(out, torch.float32, "block maxima", writable=True)
    bad = ffi.new("int64_t *")
    check(lib.stella_thc_absmax(p, n, int(scale_log2), op, nout, bad), "stella_thc_absmax")
    return out, int(bad[0])


def absmax(x):
    """(largest |x| over finite entries, number of NaN/Inf entries)."""
    m, bad = block_absmax(x, ONE_SCALE)
    return (float(m[0]) if m.size else 0.0), bad


def _scales(scale, n, scale_log2):
    """(float32 array, scale_log2): a number is one scale for the whole vector."""
    if scale_log2 is None:
        return np.full(scale_count(n, ONE_SCALE), scale, dtype=np.float32), ONE_SCALE
    return np.ascontiguousarray(scale, dtype=np.float32).reshape(-1), int(scale_log2)


def quantize(x, bits, scale, key, lane, stochastic=True, scale_log2=None):
    """Quantize x in place (it becomes what was sent) and return the packed words (uint64):
    stochastic rounding drawn from ``key``, or to the nearest level. ``scale``: one number, or
    with ``scale_log2`` the scale of each block of 2**scale_log2 entries."""
    p, n = pointer(x, torch.float32, "quantized vector", writable=True)
    scales, scale_log2 = _scales(scale, n, scale_log2)
    sp, ns = pointer(scales, torch.float32, "scales")
    words = np.empty(words_for(n, lane), dtype=np.uint64)
    wp, nw = pointer(words, torch.int64, "words", writable=True)
    check(lib.stella_thc_quantize(p, n, int(bits), sp, ns, scale_log2, 1 if stochastic else 0,
                                  int(key) & (2**64 - 1), int(lane), wp, nw),
          "stella_thc_quantize")
    return words


def unpack_sum(words, n, bits, nclusters, lane, scale, out=None, scale_log2=None):
    """The float sum of ``nclusters`` quantized vectors from their summed words (validated:
    MalformedPayloadError when a lane is out of range); ``scale`` as for :func:`quantize`."""
    if out is None:
        out = torch.empty(int(n), dtype=torch.float32)
    op, on = pointer(out, torch.float32, "output", writable=True)
    if on != int(n):
        raise ValueError("output has %d elements, expected %d" % (on, n))
    scales, scale_log2 = _scales(scale, n, scale_log2)
    sp, ns = pointer(scales, torch.float32, "scales")
    wp, nw = pointer(words, torch.int64, "words")
    check(lib.stella_thc_unpack_sum(wp, nw, int(n), int(bits), int(nclusters), int(lane), sp, ns, scale_log2, op),
          "stella_thc_unpack_sum")
    return out
