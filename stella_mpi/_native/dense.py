"""Wrappers of the dense C kernels (``c_src/stella_dense.h``): element-wise reduction into a
float32 accumulator and float32 -> 16-bit casts (round to nearest even, NaN/Inf kept)."""
import torch

from . import check, lib
from .buffers import pointer

C_OPS = {"sum": lib.STELLA_OP_SUM, "min": lib.STELLA_OP_MIN, "max": lib.STELLA_OP_MAX, "product": lib.STELLA_OP_PROD}
_ACCUMULATE = {torch.float32: lib.stella_accumulate_f32, torch.float16: lib.stella_accumulate_f16,
               torch.bfloat16: lib.stella_accumulate_bf16}
_CAST = {torch.float16: (lib.stella_f32_to_f16, "stella_f32_to_f16"),
         torch.bfloat16: (lib.stella_f32_to_bf16, "stella_f32_to_bf16")}


def accumulate(acc, src, op):
    """acc = acc OP src, element-wise, in place (``acc`` float32; ``src`` float32, float16 or
    bfloat16, the same length)."""
    a, n = pointer(acc, torch.float32, "accumulator", writable=True)
    s, m = pointer(src, src.dtype, "addend")
    if m != n:
        raise ValueError("accumulate: %d elements into %d" % (m, n))
    if n:
        check(_ACCUMULATE[src.dtype](a, s, n, C_OPS[op]), "accumulate")


def cast_from_f32(tensor, wire_dtype):
    """A new ``wire_dtype`` (float16/bfloat16) tensor holding float32 ``tensor`` rounded."""
    kernel, name = _CAST[wire_dtype]
    src = tensor.detach().contiguous()
    out = torch.empty(src.shape, dtype=wire_dtype)
    s, n = pointer(src, torch.float32, "cast input")
    if n:
        check(kernel(s, pointer(out, wire_dtype, "cast output", writable=True)[0], n, 1.0), name)
    return out
