"""Wrappers of SparseLoCo's kernels (``c_src/stella_chunked.h``): top-k per chunk with error
feedback, the per-chunk quantisation of the selected values, and their payload.

Buffers as in :mod:`.compress`: CPU, contiguous; indices int32, values and scales float32,
payloads uint8. Results are torch tensors. The C calls release the GIL."""
import torch

from . import check, ffi, lib
from . import compress as codec
from .buffers import pointer
from .compress import _check_n, _out, _residual_ptr

CHUNK_MIN = int(lib.STELLA_CHUNK_MIN)
CHUNK_MAX = int(lib.STELLA_CHUNK_MAX)
HEADER_BYTES = int(lib.STELLA_QPAYLOAD_HEADER)
BITS = (2, 4, 8)


def nchunks(n, chunk):
    return -(-int(n) // int(chunk))


def chunk_k(k, chunk, length):
    """Entries a chunk of ``length`` entries selects when a full one selects ``k``."""
    out = ffi.new("int64_t *")
    check(lib.stella_chunk_k(int(k), int(chunk), int(length), out), "chunk_k")
    return out[0]


def topk_count(n, chunk, k):
    """Entries the chunked top-k selects from ``n`` in all."""
    out = ffi.new("int64_t *")
    check(lib.stella_chunk_topk_count(int(n), int(chunk), int(k), out), "chunk_topk_count")
    return out[0]


def chunk_topk(grad, chunk, k, residual=None):
    """(int32 indices ascending, float32 values): the ``k`` largest |grad + residual| of every
    full chunk (fewer in a short tail chunk); the residual keeps what was not sent."""
    g, n = pointer(grad, torch.float32, "gradient")
    _check_n(n, "gradient")
    r = _residual_ptr(residual, n)
    cap = topk_count(n, chunk, k)
    idx = torch.empty(cap, dtype=torch.int32)
    val = torch.empty(cap, dtype=torch.float32)
    out_k = ffi.new("int64_t *")
    check(lib.stella_chunk_topk_f32(g, r, n, int(chunk), int(k), _out(idx), _out(val), cap, out_k), "chunk_topk")
    return idx[:out_k[0]], val[:out_k[0]]


def _selection(idx, val, k_what):
    ip, k = pointer(idx, torch.int32, "indices")
    vp, kv = pointer(val, torch.float32, "values", writable=True)
    if k != kv:
        raise ValueError("%s: %d indices and %d values" % (k_what, k, kv))
    return ip, vp, k


def quantize(idx, val, n, chunk, bits, residual=None):
    """Quantise the selected values in place (they become what a receiver decodes) and
    return the chunks' scales (float32, 2 per chunk: lo, step); with ``residual`` (n
    entries) each finite value's rounding error is added at its index."""
    ip, vp, k = _selection(idx, val, "quantize")
    scales = torch.empty(2 * nchunks(n, chunk), dtype=torch.float32)
    check(lib.stella_chunk_quantize_f32(ip, vp, k, int(n), int(chunk), int(bits), _out(scales), scales.numel(),
                                        _residual_ptr(residual, int(n))), "chunk_quantize")
    return scales


def payload_bound(n, chunk, k, bits):
    """Upper bound of the payload of ``k`` entries of ``n`` (the capacity :func:`encode` gives
    the C encoder: the index section at 32-bit indices)."""
    out = ffi.new("int64_t *")
    check(lib.stella_qpayload_bound(int(n), int(chunk), int(k), int(bits), out), "qpayload_bound")
    return out[0]


def payload_size(n, chunk, k, bits):
    """Bytes of the payload :func:`encode` writes for ``k`` entries of ``n`` that hold no whole
    aligned 16-block (the codec's block ids, its ``mixed`` scheme, would send such a selection
    smaller): the C's bound with its 32-bit index section replaced by the one the codec's
    ``auto`` scheme picks (:func:`.compress.choose_scheme`)."""
    u32 = codec.payload_size(n, k, 0, "u32", "none")
    return payload_bound(n, chunk, k, bits) - u32 + codec.payload_size(n, k, 0, codec.choose_scheme(n, k), "none")


def encode(idx, val, scales, n, chunk, bits):
    """Payload (1-D uint8) of quantised entries with their chunks' scales."""
    ip, vp, k = _selection(idx, val, "encode")
    sp, ns = pointer(scales, torch.float32, "scales")
    bound = ffi.new("int64_t *")
    check(lib.stella_qpayload_bound(int(n), int(chunk), k, int(bits), bound), "qpayload_bound")
    out = torch.empty(bound[0], dtype=torch.uint8)
    written = ffi.new("int64_t *")
    check(lib.stella_qpayload_encode(ip, vp, k, int(n), int(chunk), int(bits), sp, ns, _out(out), bound[0], written),
          "quantised payload encode")
    return out[:written[0]]


def decode(payload, n, chunk, bits):
    """Validate and decode an untrusted payload: (int32 indices, float32 values, float32
    scales). MalformedPayloadError names the check that failed."""
    p, length = pointer(payload, torch.uint8, "payload")
    entries = ffi.new("int64_t *")
    check(lib.stella_qpayload_decode_info(p, length, int(n), int(chunk), int(bits), entries),
          "quantised payload header (n=%d, chunk=%d, %d bits)" % (n, chunk, bits))
    k = entries[0]
    idx = torch.empty(k, dtype=torch.int32)
    val = torch.empty(k, dtype=torch.float32)
    scales = torch.empty(2 * nchunks(n, chunk), dtype=torch.float32)
    out_k = ffi.new("int64_t *")
    check(lib.stella_qpayload_decode(p, length, int(n), int(chunk), int(bits), _out(idx), _out(val), k, _out(scales),
                                     scales.numel(), out_k), "quantised payload decode")
    return idx, val, scales
