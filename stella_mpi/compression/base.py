"""The compression contract and the dense (cast) compressors.

Two kinds of compressor share one registry:

* dense compressors keep Horovod's contract exactly: ``compress(tensor) ->
  (tensor_compressed, ctx)`` and ``decompress(tensor_compressed, ctx) ->
  tensor``. ``Compression.none``, ``Compression.fp16`` and ``Compression.bf16``
  are of this kind; they may be used inside a cluster and across clusters.
* sparse compressors (``sparse = True``) select a fraction of a flat float32
  gradient shard. They are only used on the cross-cluster (WAN) hop; they are
  defined in ``stella_mpi.compression.sparse`` and receive a
  :class:`TensorContext` that tells them the tensor's name, the step, its
  shape and a seed shared by all ranks.
"""
from dataclasses import dataclass, field

import torch

from .. import _native

__all__ = ["TensorContext", "Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor",
           "register", "registered", "get_compressor", "Compression"]


@dataclass(frozen=True)
class TensorContext:
    """What a compressor may know about the tensor it compresses."""
    name: str
    step: int
    shape: tuple
    seed: int = 0
    extra: dict = field(default_factory=dict, compare=False)


class Compressor:
    """Base of every compressor; the Horovod contract (static methods work on the class too)."""
    name = "base"
    sparse = False
    wire_dtype = None  # dtype on the wire for dense compressors (None: unchanged)

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError

    def settings(self):
        """A tuple that must be equal on every rank (checked at the first exchange)."""
        return (self.name,)


class NoneCompressor(Compressor):
    """Sends tensors unchanged."""
    name = "none"

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


def _cast_f32(tensor, wire_dtype, kernel):
    """float32 -> 16-bit with the C kernel (round to nearest even, NaN/Inf kept)."""
    src = tensor.detach().contiguous()
    out = torch.empty(src.shape, dtype=wire_dtype, device=src.device)
    n = src.numel()
    if n:
        _native.check(kernel(_native.ffi.cast("const float *", src.data_ptr()),
                             _native.ffi.cast("uint16_t *", out.data_ptr()), n, 1.0),
                      kernel.__name__ if hasattr(kernel, "__name__") else "cast")
    return out


class _HalfCompressor(Compressor):
    wire_dtype = None
    _kernel_name = None

    @classmethod
    def compress(cls, tensor):
        if not tensor.dtype.is_floating_point or tensor.dtype == cls.wire_dtype:
            return tensor, None
        if tensor.dtype == torch.float32 and tensor.device.type == "cpu":
            return _cast_f32(tensor, cls.wire_dtype, getattr(_native.lib, cls._kernel_name)), tensor.dtype
        return tensor.to(cls.wire_dtype), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)


class FP16Compressor(_HalfCompressor):
    """Horovod's ``Compression.fp16``: floating tensors travel as float16."""
    name = "fp16"
    wire_dtype = torch.float16
    _kernel_name = "stella_f32_to_f16"


class BF16Compressor(_HalfCompressor):
    """Like fp16 but bfloat16: the exponent range of float32, so no overflow."""
    name = "bf16"
    wire_dtype = torch.bfloat16
    _kernel_name = "stella_f32_to_bf16"


_REGISTRY = {}


def register(name, factory):
    """Register a compressor class or factory under ``name`` (``Compression.<name>``)."""
    if name in _REGISTRY and _REGISTRY[name] is not factory:
        raise ValueError("compressor %r is already registered" % name)
    _REGISTRY[name] = factory
    return factory


def registered():
    return sorted(_REGISTRY)


def get_compressor(name, **kwargs):
    """Build a compressor by registry name, e.g. ``get_compressor("topk", density=0.01)``."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError("unknown compressor %r; registered: %s" % (name, ", ".join(registered()))) from None
    if isinstance(factory, type) and not factory.sparse and not kwargs:
        return factory
    return factory(**kwargs)


register("none", NoneCompressor)
register("fp16", FP16Compressor)
register("bf16", BF16Compressor)


class _CompressionNamespace(type):
    def __getattr__(cls, name):
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return _REGISTRY[name]
        except KeyError:
            raise AttributeError("Compression has no compressor %r; registered: %s"
                                 % (name, ", ".join(registered()))) from None


class Compression(metaclass=_CompressionNamespace):
    """Horovod's ``hvd.Compression``: ``none``, ``fp16`` as before, plus ``bf16`` and every
    registered sparse compressor (``Compression.cacheaware(density=0.01)``)."""
    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
