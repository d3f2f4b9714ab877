"""``hvd.alltoall`` (with or without splits, async), with autograd."""
import torch

from ..core.dtypes import dtype_name
from ..core.process_sets import global_process_set
from .handles import auto_name, host, submit, synchronize
from .validation import check_rows_call, check_tensor


def _split_list(tensor, splits, n):
    """The rows to send to each of the ``n`` ranks, checked as Horovod checks them."""
    if splits is None:
        if tensor.shape[0] % n:
            raise ValueError("splits not provided, but first dimension of tensor is not an even multiple of "
                             "the number of workers.")
        return [tensor.shape[0] // n] * n
    if isinstance(splits, torch.Tensor):
        if splits.dim() != 1:
            raise ValueError("alltoall expects a 1D splits tensor")
        if splits.dtype != torch.int32:
            raise ValueError("alltoall expects splits to contain 32-bit integer elements.")
        split_list = [int(s) for s in splits.tolist()]
    else:
        split_list = [int(s) for s in splits]
    if len(split_list) != n:
        raise ValueError("Number of entries in splits does not equal number of workers.")
    if any(s < 0 for s in split_list):
        raise ValueError("alltoall splits must be non-negative, got %s" % split_list)
    if sum(split_list) > tensor.shape[0]:
        raise ValueError("Sum of splits entries is greater than the first dimension of tensor.")
    return split_list


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    pset = check_rows_call("hvd.alltoall", tensor, process_set, "alltoall")
    n = pset.nranks
    split_list = _split_list(tensor, splits, n)
    name = name or auto_name("alltoall", pset)
    desc = {"kind": "alltoall", "name": name, "dtype": dtype_name(tensor.dtype), "trailing": list(tensor.shape[1:]),
            "size": n}
    device = tensor.device
    splits_like = splits if isinstance(splits, torch.Tensor) else None
    src = host(tensor)[:sum(split_list)]

    def post(result):
        out, recv = result
        if device.type != "cpu":
            out = out.to(device)
        if splits_like is not None:
            recv = recv.to(splits_like.device)
        return out, recv

    return submit("alltoall", name, desc, (src, split_list), pset, post)


class _AlltoallFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        out, recv = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.recv, ctx.process_set = recv, process_set
        ctx.mark_non_differentiable(recv)
        return out, recv

    @staticmethod
    def backward(ctx, grad, _grad_recv):
        back, _ = synchronize(alltoall_async(grad.contiguous(), ctx.recv, None, ctx.process_set))
        return back, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Send ``splits[r]`` rows of ``tensor`` to rank r; returns the received rows, and the
    received splits when ``splits`` was given (Horovod's convention)."""
    check_tensor(tensor, "hvd.alltoall")
    if tensor.requires_grad and torch.is_grad_enabled():
        out, recv = _AlltoallFn.apply(tensor, splits, name, process_set)
    else:
        out, recv = synchronize(alltoall_async(tensor, splits, name, process_set))
    return out if splits is None else (out, recv)
