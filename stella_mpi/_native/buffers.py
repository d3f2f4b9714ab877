"""The one way a buffer reaches the C core: a checked cffi pointer.

Every wrapper of a C kernel passes its tensors and arrays through :func:`pointer`, which
refuses (with a message naming the argument) anything the C side could misread: a wrong
dtype, a non-CPU tensor, a non-contiguous or misaligned array, a read-only array that the
kernel writes into. A buffer of zero elements becomes NULL (the C ABI's convention).
"""
import numpy as np
import torch

from . import ffi

# C element type of each torch dtype the kernels take (16-bit floats travel as raw uint16 bits)
# (64-bit words, e.g. THC's lanes, are int64 tensors or uint64 numpy arrays)
_CTYPES = {torch.float32: "float *", torch.int32: "uint32_t *", torch.uint8: "uint8_t *",
           torch.float16: "uint16_t *", torch.bfloat16: "uint16_t *", torch.int64: "uint64_t *"}
# numpy dtypes accepted for each torch dtype (numpy has no bfloat16)
_NP = {torch.float32: (np.float32,), torch.int32: (np.int32, np.uint32), torch.uint8: (np.uint8,),
       torch.float16: (np.float16,), torch.bfloat16: (), torch.int64: (np.int64, np.uint64)}


def pointer(x, dtype, what, writable=False):
    """(cffi pointer, numel) of a contiguous CPU torch tensor or numpy array of ``dtype``."""
    if dtype not in _CTYPES:
        raise TypeError("internal: the C kernels take no %s buffers" % dtype)
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise ValueError("%s must be a CPU tensor, got %s" % (what, x.device))
        if x.dtype != dtype:
            raise TypeError("%s must be %s, got %s" % (what, dtype, x.dtype))
        if not x.is_contiguous():
            raise ValueError("%s must be contiguous" % what)
        n = x.numel()
        return (ffi.cast(_CTYPES[dtype], x.data_ptr()) if n else ffi.NULL), n
    if isinstance(x, np.ndarray):
        if x.dtype.type not in _NP[dtype]:
            raise TypeError("%s must be %s, got numpy %s" % (what, dtype, x.dtype))
        if not x.dtype.isnative:
            raise TypeError("%s must be in this machine's byte order, got numpy %s" % (what, x.dtype))
        if not x.flags.c_contiguous:
            raise ValueError("%s must be contiguous" % what)
        if not x.flags.aligned:
            raise ValueError("%s must be aligned to its element size" % what)
        if writable and not x.flags.writeable:
            raise ValueError("%s must be writable" % what)
        n = x.size
        return (ffi.cast(_CTYPES[dtype], x.ctypes.data) if n else ffi.NULL), n
    raise TypeError("%s must be a torch tensor or numpy array, got %s" % (what, type(x).__name__))
