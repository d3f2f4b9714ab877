"""``hvd.broadcast`` (new tensor or in place, async), with autograd."""
import operator

import torch

from ..core import state
from ..core.dtypes import dtype_name
from ..core.process_sets import global_process_set
from .allreduce import allreduce
from .handles import auto_name, collective_thread, host, submit, synchronize
from .reduce_ops import Average
from .validation import check_tensor, checked_process_set


def _broadcast_async(tensor, root_rank, name, process_set, inplace):
    what = "hvd.broadcast"
    collective_thread(what)
    pset = checked_process_set(process_set, what)
    check_tensor(tensor, what)
    # an integer-like root (numpy's int64) as Horovod takes it
    if isinstance(root_rank, bool) or not hasattr(root_rank, "__index__") or \
            operator.index(root_rank) not in pset.ranks:
        raise ValueError("%s: root_rank %r is not a rank of the process set (ranks %s)"
                         % (what, root_rank, pset.ranks))
    root_rank = operator.index(root_rank)
    name = name or auto_name("broadcast", pset)
    desc = {"kind": "broadcast", "name": name, "dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape),
            "root": root_rank}
    src = host(tensor)
    out = tensor if inplace else torch.empty_like(tensor)
    host_out = out if (out.device.type == "cpu" and out.is_contiguous()) else torch.empty_like(src)

    def post(result):
        if out is not host_out:
            with torch.no_grad():   # (broadcast_ of a parameter)
                out.copy_(host_out)
        return out

    return submit("broadcast", name, desc, (src, host_out), pset, post)


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    return _broadcast_async(tensor, root_rank, name, process_set, inplace=False)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    return _broadcast_async(tensor, root_rank, name, process_set, inplace=True)


class _BroadcastFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce(grad, op=Average, process_set=ctx.process_set)
        if state.current().rank != ctx.root_rank:
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Return ``root_rank``'s ``tensor`` on every rank (a new tensor)."""
    check_tensor(tensor, "hvd.broadcast")
    if tensor.requires_grad and torch.is_grad_enabled():
        return _BroadcastFn.apply(tensor, root_rank, name, process_set)
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """In-place broadcast; returns ``tensor``."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))
