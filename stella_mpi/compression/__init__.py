"""Compressors: Horovod's dense ones (none, fp16, bf16) and the sparse WAN compressors."""
from .base import (BF16Compressor, Compression, Compressor, FP16Compressor, NoneCompressor,  # noqa: F401
                   TensorContext, get_compressor, register, registered)

try:  # the sparse compressors register themselves on import
    from . import sparse  # noqa: F401
except ImportError as e:  # pragma: no cover - only while the module does not exist yet
    if "sparse" not in str(e):
        raise
