"""Wrappers of the C compression kernels (``c_src/stella_compress.h`` and
``c_src/stella_sparse.h``): sizes, checked pointers (:mod:`.buffers`), status codes.

Buffers are CPU, contiguous torch tensors or numpy arrays. Indices are int32
(the C side reads them as uint32; every tensor the sparse kernels accept has
fewer than 2**31 elements, so both views agree), values float32, payloads
uint8. Results are torch tensors. The C calls release the GIL.
"""
import numpy as np
import torch

from . import MalformedPayloadError, check, ffi, lib
from .buffers import pointer

MAX_NUMEL = int(lib.STELLA_SPARSE_MAX_N)
BLOCK = int(lib.STELLA_BLOCK)
HEADER_BYTES = int(lib.STELLA_PAYLOAD_HEADER)
SEGMENT = int(lib.STELLA_SEGMENT)   # entries per segment of the 16-bit offset scheme

SCHEMES = {"auto": lib.STELLA_IDX_AUTO, "u32": lib.STELLA_IDX_U32, "seg16": lib.STELLA_IDX_SEG16,
           "block16": lib.STELLA_IDX_BLOCK16, "block32": lib.STELLA_IDX_BLOCK32, "dense": lib.STELLA_IDX_DENSE,
           "implicit": lib.STELLA_IDX_IMPLICIT, "mixed": lib.STELLA_IDX_MIXED}
SCHEME_NAMES = {v: k for k, v in SCHEMES.items()}
VALUE_DTYPES = {"float32": lib.STELLA_VAL_F32, "float16": lib.STELLA_VAL_F16, "bfloat16": lib.STELLA_VAL_BF16}
_TORCH_VALUE_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
# every value section a payload may carry: "none" is the index section of a quantised payload
# (:mod:`.chunked`), never a sparse compressor's own
VALUE_NAMES = {**{v: k for k, v in VALUE_DTYPES.items()}, lib.STELLA_VAL_NONE: "none"}

def value_dtype_name(dtype):
    """Normalise a value dtype given as a name or a torch dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _TORCH_VALUE_DTYPES:
            raise ValueError("value dtype must be float32, float16 or bfloat16, not %s" % dtype)
        return _TORCH_VALUE_DTYPES[dtype]
    if dtype not in VALUE_DTYPES:
        raise ValueError("value dtype must be one of %s, not %r" % (sorted(VALUE_DTYPES), dtype))
    return dtype


def _out(t):
    """Pointer to a buffer this module just allocated for a kernel's output."""
    return pointer(t, t.dtype, "output buffer", writable=True)[0]


def _check_n(n, what):
    if n > MAX_NUMEL:
        raise ValueError("%s has %d elements; the sparse kernels take at most %d (split the buffer)"
                         % (what, n, MAX_NUMEL))


def _residual_ptr(residual, n):
    if residual is None:
        return ffi.NULL
    p, rn = pointer(residual, torch.float32, "residual", writable=True)
    if rn != n:
        raise ValueError("residual has %d elements, gradient %d" % (rn, n))
    return p


class SelState:
    """Per-tensor selection state: scratch memory and the threshold carried
    from step to step (cache-aware and top-k). Not for two threads at once."""

    def __init__(self):
        out = ffi.new("stella_sel_state **")
        check(lib.stella_sel_state_new(out), "stella_sel_state_new")
        self._ptr = ffi.gc(out[0], lib.stella_sel_state_free)

    @property
    def ptr(self):
        return self._ptr

    def stats(self):
        s = ffi.new("stella_sel_stats *")
        check(lib.stella_sel_state_stats(self._ptr, s), "stella_sel_state_stats")
        return {f: getattr(s, f) for f in ("calls", "units", "wanted", "candidates", "compactions",
                                           "extra_passes", "selected", "threshold_hits",
                                           "threshold_used", "threshold_next")}

    def set_threshold(self, t):
        check(lib.stella_sel_state_set_threshold(self._ptr, float(t)), "stella_sel_state_set_threshold")

    def reset(self):
        check(lib.stella_sel_state_reset(self._ptr), "stella_sel_state_reset")


def _state_ptr(state):
    return ffi.NULL if state is None else state.ptr


def _run_select(fn, name, grad, residual, cap, *args, state=None, with_state=True):
    g, n = pointer(grad, torch.float32, "gradient")
    _check_n(n, "gradient")
    r = _residual_ptr(residual, n)
    idx = torch.empty(max(cap, 0), dtype=torch.int32)
    val = torch.empty(max(cap, 0), dtype=torch.float32)
    out_k = ffi.new("int64_t *")
    ip = _out(idx)
    vp = _out(val)
    if with_state:
        rc = fn(g, r, n, *args, ip, vp, cap, out_k, _state_ptr(state))
    else:
        rc = fn(g, r, n, *args, ip, vp, cap, out_k)
    check(rc, name)
    k = out_k[0]
    return idx[:k], val[:k]


def topk(grad, k, residual=None, state=None):
    """Exact top-k by magnitude (NaN above Inf, ties to the lower index), with
    error feedback when ``residual`` is given. Returns (int32 indices ascending, float32 values)."""
    k = int(k)
    return _run_select(lib.stella_topk_f32, "stella_topk_f32", grad, residual, k, k, state=state)


def block_count(n, k):
    """(blocks, max entries) of a cache-aware selection of k entries out of n."""
    nb, me = ffi.new("int64_t *"), ffi.new("int64_t *")
    check(lib.stella_block_count(int(n), int(k), nb, me), "stella_block_count")
    return nb[0], me[0]


def block_topk(grad, k, residual=None, state=None):
    """Cache-aware block selection of ceil(k/16) whole 16-float blocks."""
    n = grad.numel() if isinstance(grad, torch.Tensor) else np.asarray(grad).size
    _check_n(n, "gradient")
    _, cap = block_count(n, k)
    return _run_select(lib.stella_block_topk_f32, "stella_block_topk_f32", grad, residual, cap, int(k), state=state)


def threshold_select(grad, threshold, min_k, max_k, residual=None, state=None):
    """Entries with |acc| > threshold, at least min_k and at most max_k of them."""
    return _run_select(lib.stella_threshold_select_f32, "stella_threshold_select_f32", grad, residual,
                       int(max_k), float(threshold), int(min_k), int(max_k), state=state)


def estimate_threshold(grad, k, residual=None):
    """Sampled estimate of the k-th largest |grad + residual| (exact for small tensors)."""
    g, n = pointer(grad, torch.float32, "gradient")
    _check_n(n, "gradient")
    r = ffi.NULL
    if residual is not None:
        r, rn = pointer(residual, torch.float32, "residual")
        if rn != n:
            raise ValueError("residual has %d elements, gradient %d" % (rn, n))
    out = ffi.new("float *")
    check(lib.stella_estimate_threshold_f32(g, r, n, int(k), out), "stella_estimate_threshold_f32")
    return out[0]


def randomk_key(seed, name, step):
    """The random-k key of (shared seed, tensor name, step): equal on every rank."""
    b = name.encode("utf-8") if isinstance(name, str) else bytes(name)
    out = ffi.new("uint64_t *")
    check(lib.stella_randomk_key(int(seed) & (2**64 - 1), b, len(b), int(step), out), "stella_randomk_key")
    return out[0]


def randomk_indices(key, n, k):
    """The k ascending indices random-k draws for (key, n, k)."""
    _check_n(int(n), "tensor")
    idx = torch.empty(int(k), dtype=torch.int32)
    ip = _out(idx)
    check(lib.stella_randomk_indices(int(key), int(n), int(k), ip, int(k)), "stella_randomk_indices")
    return idx


def randomk_select(grad, k, key, residual=None):
    k = int(k)
    return _run_select(lib.stella_randomk_select_f32, "stella_randomk_select_f32", grad, residual, k, k, int(key),
                       with_state=False)


# ------------------------------------------------------------------ codec

def payload_size(n, entries, nblocks, scheme, value_dtype="float32"):
    """Bytes of a payload of ``entries`` in ``scheme`` (``nblocks`` whole blocks for the block
    schemes); ``value_dtype`` "none": the index section of a quantised payload (:mod:`.chunked`)."""
    code = lib.STELLA_VAL_NONE if value_dtype == "none" else VALUE_DTYPES[value_dtype_name(value_dtype)]
    out = ffi.new("int64_t *")
    check(lib.stella_payload_size(int(n), int(entries), int(nblocks), SCHEMES[scheme], code, out),
          "stella_payload_size")
    return out[0]


def block_and_single_bytes(n, value_dtype="float32"):
    """(bytes a whole block adds to a block or mixed payload, bytes a single entry adds to a
    segment-offset or mixed payload) for a tensor of n >= 1 elements, from the codec's own sizes:
    a block is 16 values and its id (16-bit while the block ids fit, else 32-bit), a single a
    value and its 16-bit offset."""
    e = min(BLOCK, int(n))
    try:
        block = payload_size(n, e, 1, "block16", value_dtype)
    except ValueError:   # more blocks than 16-bit ids can name
        block = payload_size(n, e, 1, "block32", value_dtype)
    single = payload_size(n, 1, 0, "seg16", value_dtype) - payload_size(n, 0, 0, "seg16", value_dtype)
    return block - HEADER_BYTES, single


def choose_scheme(n, k, whole_blocks=-1):
    out = ffi.new("int *")
    check(lib.stella_choose_scheme(int(n), int(k), int(whole_blocks), out), "stella_choose_scheme")
    return SCHEME_NAMES[out[0]]


def encoded_size(idx, n, scheme="auto", value_dtype="float32"):
    """(bytes, scheme) of the payload :func:`encode` writes for ascending indices < n with
    ``scheme`` (``auto`` resolved to the one it picks; ``mixed``'s size depends on the indices)."""
    ip, k = pointer(idx, torch.int32, "indices")
    out, chosen = ffi.new("int64_t *"), ffi.new("int *")
    check(lib.stella_encoded_size(ip, k, int(n), SCHEMES[scheme], VALUE_DTYPES[value_dtype_name(value_dtype)], out,
                                  chosen), "stella_encoded_size")
    return out[0], SCHEME_NAMES[chosen[0]]


def _pair_ptrs(idx, val, what):
    ip, k = pointer(idx, torch.int32, what + " indices")
    vp, kv = pointer(val, torch.float32, what + " values")
    if k != kv:
        raise ValueError("%s: %d indices but %d values" % (what, k, kv))
    return ip, vp, k


def encode(idx, val, n, scheme="auto", value_dtype="float32"):
    """Payload (1-D torch.uint8) of k entries with ascending indices < n."""
    vd = VALUE_DTYPES[value_dtype_name(value_dtype)]
    ip, vp, k = _pair_ptrs(idx, val, "encode")
    n = int(n)
    _check_n(n, "tensor")
    if scheme in ("seg16", "mixed"):
        cap = encoded_size(idx, n, scheme, value_dtype)[0]
    else:
        bound = ffi.new("int64_t *")
        check(lib.stella_payload_bound(n, k, vd, bound), "stella_payload_bound")
        cap = bound[0]
    out = torch.empty(cap, dtype=torch.uint8)
    written = ffi.new("int64_t *")
    check(lib.stella_sparse_encode(ip, vp, k, n, SCHEMES[scheme], vd, _out(out), cap, written),
          "stella_sparse_encode")
    return out[:written[0]]


def randomk_encode(key, val, n, value_dtype="float32"):
    """Values-only payload of a random-k selection (the receiver regenerates the indices)."""
    vd = VALUE_DTYPES[value_dtype_name(value_dtype)]
    vp, k = pointer(val, torch.float32, "values")
    cap = payload_size(n, k, 0, "implicit", value_dtype)
    out = torch.empty(cap, dtype=torch.uint8)
    written = ffi.new("int64_t *")
    check(lib.stella_randomk_encode(int(key), vp, k, int(n), vd, _out(out), cap, written),
          "stella_randomk_encode")
    return out[:written[0]]


def _payload_ptr(payload):
    """(pointer, length, what keeps the memory alive) of a payload: a uint8 tensor or array, or
    bytes-like."""
    if isinstance(payload, (bytes, bytearray, memoryview)):
        payload = np.frombuffer(payload, dtype=np.uint8)
    p, n = pointer(payload, torch.uint8, "payload")
    return p, n, payload


def decode_info(payload, n):
    """Validated header of a payload for a tensor of n elements (MalformedPayloadError if bad)."""
    p, length, _keep = _payload_ptr(payload)
    info = ffi.new("stella_payload_info *")
    check(lib.stella_sparse_decode_info(p, length, int(n), info), "decode payload header")
    return {"n": info.n, "count": info.count, "entries": info.entries, "nbytes": info.nbytes,
            "scheme": SCHEME_NAMES.get(info.scheme, info.scheme),
            "value_dtype": VALUE_NAMES[info.value_dtype], "key": info.key}


def decode(payload, n, expected_key=0, value_dtype=None, implicit=True):
    """Validate and decode an untrusted payload: (int32 indices ascending, float32 values).
    ``value_dtype``: the values must be of that dtype; ``implicit``: whether indices implied by
    a random-k key are accepted (else only explicit indices)."""
    info = decode_info(payload, n)
    if value_dtype is not None and info["value_dtype"] != value_dtype:
        raise MalformedPayloadError("the payload's values are %s, the compressor sends %s"
                                    % (info["value_dtype"], value_dtype))
    if not implicit and info["scheme"] == "implicit":
        raise MalformedPayloadError("the payload's indices are implied by a random-k key, and the compressor is not "
                                    "random-k")
    p, length, _keep = _payload_ptr(payload)
    k = info["entries"]
    idx = torch.empty(k, dtype=torch.int32)
    val = torch.empty(k, dtype=torch.float32)
    out_k = ffi.new("int64_t *")
    check(lib.stella_sparse_decode(p, length, int(n), int(expected_key), _out(idx), _out(val), k, out_k),
          "decode payload (scheme %s)" % info["scheme"])
    return idx, val


# ------------------------------------------------------------ merge, scatter

def merge(pairs, n, out=None):
    """k-way merge of (indices, values) lists, each strictly ascending < n:
    union ascending, values summed in list order. ``out``: optional (int32,
    float32) tensors to write into (reused buffers avoid page faults); the
    result is a view of them."""
    w = len(pairs)
    ips = ffi.new("uint32_t *[]", max(w, 1))
    vps = ffi.new("float *[]", max(w, 1))
    lens = ffi.new("int64_t[]", max(w, 1))
    total = 0
    for j, (idx, val) in enumerate(pairs):
        ip, vp, k = _pair_ptrs(idx, val, "merge list %d" % j)
        ips[j], vps[j], lens[j] = ip, vp, k
        total += k
    total = max(0, min(total, int(n)))  # the union never exceeds n
    if out is None:
        out_i = torch.empty(total, dtype=torch.int32)
        out_v = torch.empty(total, dtype=torch.float32)
    else:
        out_i, out_v = out
        _pair_ptrs(out_i, out_v, "merge output")
        total = min(total, out_i.numel())
    out_len = ffi.new("int64_t *")
    check(lib.stella_merge_f32(w, ips, vps, lens, int(n), _out(out_i), _out(out_v), total, out_len),
          "stella_merge_f32")
    m = out_len[0]
    return out_i[:m], out_v[:m]


def scatter_add(dense, idx, val, scale=1.0):
    """dense[idx[i]] += val[i] * scale (every index checked first)."""
    dp, n = pointer(dense, torch.float32, "dense", writable=True)
    ip, vp, k = _pair_ptrs(idx, val, "scatter_add")
    check(lib.stella_scatter_add_f32(dp, n, ip, vp, k, float(scale)), "stella_scatter_add_f32")
    return dense
