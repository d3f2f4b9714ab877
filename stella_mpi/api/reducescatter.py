"""``hvd.reducescatter`` (grouped, async), with autograd."""
import torch

from ..compression import Compression
from ..core.dtypes import dtype_name
from ..core.process_sets import global_process_set
from .allgather import allgather
from .handles import GroupHandle, auto_name, host, submit, synchronize
from .reduce_ops import Average, Sum, op_name
from .validation import check_rows_call, check_tensor, dense_compression


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0):
    pset = check_rows_call("hvd.reducescatter", tensor, process_set, "reducescatter")
    if op not in (Average, Sum):   # Horovod's RuntimeError: reducescatter sums or averages only
        raise NotImplementedError("hvd.reducescatter supports op=hvd.Average or hvd.Sum, as in Horovod (got op %r)"
                                  % (op,))
    opname = op_name(op, tensor.dtype)
    name = name or auto_name("reducescatter", pset)
    desc = {"kind": "reducescatter", "name": name, "dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape),
            "op": opname, "prescale": float(prescale_factor), "postscale": float(postscale_factor)}
    device = tensor.device
    return submit("reducescatter", name, desc, (host(tensor),), pset,
                  lambda out: out.to(device) if device.type != "cpu" else out)


class _ReducescatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale, postscale):
        ctx.args = (op, process_set, prescale, postscale)
        return synchronize(reducescatter_async(tensor, name, op, process_set, prescale, postscale))

    @staticmethod
    def backward(ctx, grad):
        op, process_set, prescale, postscale = ctx.args
        if op == Sum:
            grad = grad * process_set.nranks
        grad = grad * prescale * postscale if (prescale != 1.0 or postscale != 1.0) else grad
        return allgather(grad.contiguous(), process_set=process_set), None, None, None, None, None


def reducescatter(tensor, name=None, compression=Compression.none, op=Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0):
    """Reduce ``tensor`` over all ranks and return this rank's rows of dim 0 (the first
    ``rows % size`` ranks get one extra row)."""
    check_tensor(tensor, "hvd.reducescatter")
    compression = dense_compression(compression, "hvd.reducescatter")
    compressed, ctx = compression.compress(tensor)
    if compressed.requires_grad and torch.is_grad_enabled():
        out = _ReducescatterFn.apply(compressed, name, op, process_set, prescale_factor, postscale_factor)
    else:
        out = synchronize(reducescatter_async(compressed, name, op, process_set, prescale_factor, postscale_factor))
    return compression.decompress(out, ctx)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                                postscale_factor=1.0):
    """Reduce-scatter each tensor of the list (all submitted at once); ``synchronize`` returns the list."""
    for t in tensors:
        check_tensor(t, "hvd.grouped_reducescatter")
    base = name or auto_name("grouped_reducescatter", process_set)
    return GroupHandle([reducescatter_async(t, "%s_%dof%d" % (base, i + 1, len(tensors)), op, process_set,
                                            prescale_factor, postscale_factor) for i, t in enumerate(tensors)])


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    for t in tensors:
        check_tensor(t, "hvd.grouped_reducescatter")
    if not tensors:
        return []
    base = name or auto_name("grouped_reducescatter", process_set)
    compression = dense_compression(compression, "hvd.grouped_reducescatter")
    if compression is Compression.none and not (any(t.requires_grad for t in tensors) and torch.is_grad_enabled()):
        return synchronize(grouped_reducescatter_async(tensors, base, op, process_set, prescale_factor,
                                                       postscale_factor))
    return [reducescatter(t, "%s_%dof%d" % (base, i + 1, len(tensors)), compression, op, process_set,
                          prescale_factor, postscale_factor) for i, t in enumerate(tensors)]
