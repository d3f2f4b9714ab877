"""Checks every public call makes on the calling thread, before anything is queued: a clear
error naming what is wrong, never a hang."""
import torch

from ..base.errors import CollectiveNotInitializedError
from ..core import state
from ..core.dtypes import dtype_name
from ..core.process_sets import ProcessSet


def running(what):
    """The running Runtime; Horovod's error for a collective before ``init()``."""
    rt = state.running()
    if rt is None:
        raise CollectiveNotInitializedError(what)
    return rt


def check_tensor(t, what):
    if not isinstance(t, torch.Tensor):
        raise TypeError("%s expects a torch.Tensor, got %s" % (what, type(t).__name__))
    if t.is_sparse:
        raise ValueError("%s: sparse tensors are not supported here; convert with .to_dense() "
                         "(DistributedOptimizer(sparse_as_dense=True))" % what)
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError("%s: tensors on %s are not supported (CPU and CUDA are)" % (what, t.device))
    dtype_name(t.dtype)


def checked_process_set(process_set, what):
    """``process_set`` if this rank can run collectives on it, else a clear error."""
    if not isinstance(process_set, ProcessSet):
        raise ValueError("%s: process_set must be an hvd.ProcessSet, not %r" % (what, type(process_set).__name__))
    if process_set.process_set_id is None:
        raise ValueError("%s: Process set provided does not exist, or has not been registered." % what)
    if process_set.comms is None:
        raise ValueError("%s: Rank %d is not a member of the provided process set." % (what, state.current().rank))
    return process_set


def check_rows_call(what, tensor, process_set, verb):
    """The checks of a collective on the rows (dim 0) of one tensor; returns the process set."""
    running(what)
    pset = checked_process_set(process_set, what)
    check_tensor(tensor, what)
    if tensor.dim() == 0:
        raise ValueError("%s: cannot %s a rank-zero (scalar) tensor; reshape it to 1-D" % (what, verb))
    return pset


def dense_compression(compression, what):
    if getattr(compression, "sparse", False):
        raise ValueError("%s: %s is a sparse (WAN) compressor; use it with hvd.allreduce or "
                         "DistributedOptimizer" % (what, compression.name))
    return compression
