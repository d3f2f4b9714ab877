"""``hvd.allgather`` (dim 0 may differ across ranks), grouped and async, with autograd."""
import torch

from ..core.dtypes import dtype_name
from ..core.process_sets import global_process_set
from .allreduce import allreduce
from .handles import GroupHandle, auto_name, host, submit, synchronize
from .reduce_ops import Average
from .validation import check_rows_call, check_tensor


def allgather_async(tensor, name=None, process_set=global_process_set):
    pset = check_rows_call("hvd.allgather", tensor, process_set, "allgather")
    name = name or auto_name("allgather", pset)
    desc = {"kind": "allgather", "name": name, "dtype": dtype_name(tensor.dtype), "trailing": list(tensor.shape[1:])}
    device = tensor.device

    def post(result):
        out, _rows = result
        return out.to(device) if device.type != "cpu" else out

    return submit("allgather", name, desc, (host(tensor),), pset, post)


class _AllgatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.dim0 = tensor.shape[0]
        ctx.process_set = process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce(grad, op=Average, process_set=ctx.process_set)
        sizes = allgather(torch.tensor([ctx.dim0], dtype=torch.int64), process_set=ctx.process_set).tolist()
        me = ctx.process_set.set_rank
        start = sum(sizes[:me])
        return reduced.narrow(0, start, sizes[me]), None, None


def allgather(tensor, name=None, process_set=global_process_set):
    """Concatenate every rank's ``tensor`` along dim 0 (dim 0 may differ across ranks)."""
    check_tensor(tensor, "hvd.allgather")
    if tensor.requires_grad and torch.is_grad_enabled():
        return _AllgatherFn.apply(tensor, name, process_set)
    return synchronize(allgather_async(tensor, name, process_set))


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    """Allgather each tensor of the list (all submitted at once); ``synchronize`` returns the list."""
    for t in tensors:
        check_tensor(t, "hvd.grouped_allgather")
    base = name or auto_name("grouped_allgather", process_set)
    return GroupHandle([allgather_async(t, "%s_%dof%d" % (base, i + 1, len(tensors)), process_set)
                        for i, t in enumerate(tensors)])


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    for t in tensors:
        check_tensor(t, "hvd.grouped_allgather")
    if not tensors:
        return []
    if any(t.requires_grad for t in tensors) and torch.is_grad_enabled():
        base = name or auto_name("grouped_allgather", process_set)
        return [allgather(t, "%s_%dof%d" % (base, i + 1, len(tensors)), process_set) for i, t in enumerate(tensors)]
    return synchronize(grouped_allgather_async(tensors, name, process_set))
