"""Horovod's dense (cast) compressors: ``Compression.none``, ``fp16`` and ``bf16``."""
import torch

from .._native.dense import cast_from_f32
from .contracts import Compressor


class NoneCompressor(Compressor):
    """Sends tensors unchanged."""
    name = "none"

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class _HalfCompressor(Compressor):
    wire_dtype = None

    @classmethod
    def compress(cls, tensor):
        if not tensor.dtype.is_floating_point or tensor.dtype == cls.wire_dtype:
            return tensor, None
        if tensor.dtype == torch.float32 and tensor.device.type == "cpu" and \
                not (tensor.requires_grad and torch.is_grad_enabled()):   # (the C cast is not differentiable)
            return cast_from_f32(tensor, cls.wire_dtype), tensor.dtype
        return tensor.to(cls.wire_dtype), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)


class FP16Compressor(_HalfCompressor):
    """Horovod's ``Compression.fp16``: floating tensors travel as float16."""
    name = "fp16"
    wire_dtype = torch.float16


class BF16Compressor(_HalfCompressor):
    """Like fp16 but bfloat16: the exponent range of float32, so no overflow."""
    name = "bf16"
    wire_dtype = torch.bfloat16
