"""Horovod's collective API for torch tensors (``horovod.torch`` is the reference).

Each call validates its arguments on the calling thread (a clear error, no
hang), builds a description that every rank must agree on, and hands the op
to the engine. ``*_async`` functions return an integer handle for ``poll`` and
``synchronize``; the plain ones wait. CUDA tensors travel through host
memory on this route. Autograd works through allreduce, allgather,
broadcast, alltoall and reducescatter as in Horovod.
"""
import itertools
import threading
import warnings

import torch

from . import runtime
from .compression.base import Compression
from .engine import Op
from .errors import CollectiveNotInitializedError, HorovodInternalError
from . import exchange  # noqa: F401  (registers the sparse executor)
from .ops import EXECUTORS, dtype_name
from .runtime import global_process_set

# Horovod's reduction op constants
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
_OP_NAMES = {Average: "average", Sum: "sum", Min: "min", Max: "max", Product: "product"}

_counters = {}
_counter_lock = threading.Lock()
_post = {}  # handle -> function turning the engine's result into what synchronize returns


def _auto_name(prefix, process_set=None):
    """Horovod-style name for an unnamed op. Counted per process set, so that ranks outside a
    set (which never submit its ops) keep the same count as the members for the others."""
    set_id = getattr(process_set, "process_set_id", 0) or 0
    with _counter_lock:
        n = _counters.setdefault((prefix, set_id), itertools.count())
        return "%s.noname.%d" % (prefix, next(n)) if not set_id else "%s.set%d.noname.%d" % (prefix, set_id, next(n))


def _engine(what):
    rt = runtime._runtime
    if rt is None:
        raise CollectiveNotInitializedError(what)
    return rt.engine


def _pset(process_set, what):
    if not isinstance(process_set, runtime.ProcessSet):
        raise ValueError("%s: process_set must be an hvd.ProcessSet, not %r" % (what, type(process_set).__name__))
    if process_set.process_set_id is None:
        raise ValueError("%s: Process set provided does not exist, or has not been registered." % what)
    if process_set.comms is None:
        raise ValueError("%s: Rank %d is not a member of the provided process set." % (what, runtime._runtime.rank))
    return process_set


def handle_average_backwards_compatibility(op, average):
    if op is not None:
        if average is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one of them.")
        return op
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed", DeprecationWarning)
        return Average if average else Sum
    return Average


def _op_name(op, dtype):
    if op == Adasum:
        raise NotImplementedError("stella_mpi does not implement Adasum yet; use op=hvd.Average or hvd.Sum")
    try:
        name = _OP_NAMES[op]
    except KeyError:
        raise ValueError("unknown reduction op %r; use hvd.Average, Sum, Min, Max or Product" % (op,)) from None
    if dtype == torch.bool and name in ("average", "sum", "product"):
        raise TypeError("op %s is not defined for bool tensors; use hvd.Min (and) or hvd.Max (or)" % name)
    return name


def _check_tensor(t, what):
    if not isinstance(t, torch.Tensor):
        raise TypeError("%s expects a torch.Tensor, got %s" % (what, type(t).__name__))
    if t.is_sparse:
        raise ValueError("%s: sparse tensors are not supported here; convert with .to_dense() "
                         "(DistributedOptimizer(sparse_as_dense=True))" % what)
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError("%s: tensors on %s are not supported (CPU and CUDA are)" % (what, t.device))
    dtype_name(t.dtype)


def _host(t):
    """A contiguous CPU tensor with the data of ``t`` (``t`` itself when possible)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous()


def _staged(outputs, hosts):
    """Host buffers the engine writes into (the outputs themselves when they are contiguous CPU
    tensors), and the function that copies them back into ``outputs`` when the op is done."""
    host_outs = [o if (o.device.type == "cpu" and o.is_contiguous()) else torch.empty_like(h)
                 for o, h in zip(outputs, hosts)]

    def post(result):
        for o, h in zip(outputs, host_outs):
            if o is not h:
                o.copy_(h)
        return outputs
    return host_outs, post


def _submit(kind, name, desc, inputs, pset, post):
    eng = _engine("hvd.%s" % kind)
    hid = eng.submit(Op(kind, name, desc, inputs, EXECUTORS[kind][0], pset))
    _post[hid] = post
    return hid


def poll(handle):
    """True when the op behind ``handle`` has finished (``synchronize`` will not wait)."""
    return _engine("hvd.poll").poll(handle)


def synchronize(handle):
    """Wait for an async op and return its output (None for an unknown handle, as in Horovod)."""
    eng = _engine("hvd.synchronize")
    if not eng.known(handle):
        return None
    post = _post.pop(handle, None)
    result = eng.wait(handle)
    return post(result) if post else result


# ---------------- allreduce ----------------

def _allreduce_async(tensors, outputs_from, name, op, prescale, postscale, process_set, prefix, wire=None):
    what = "hvd." + prefix
    _engine(what)
    pset = _pset(process_set, what)
    if not tensors:
        raise ValueError("%s needs at least one tensor" % what)
    for t in tensors:
        _check_tensor(t, what)
    dtype, device = tensors[0].dtype, tensors[0].device
    for t in tensors:
        if t.dtype != dtype:
            raise ValueError("%s: all tensors of a group must share one dtype (got %s and %s)" % (what, dtype, t.dtype))
        if t.device != device:
            raise RuntimeError("Tensors in list must be on same device.")
    opname = _op_name(op, dtype)
    if dtype == torch.bool and (prescale != 1.0 or postscale != 1.0):
        raise TypeError("%s: prescale/postscale factors do not apply to bool tensors" % what)
    name = name or _auto_name(prefix, pset)
    desc = {"kind": "allreduce", "name": name, "dtype": dtype_name(dtype),
            "shapes": [list(t.shape) for t in tensors], "op": opname,
            "prescale": float(prescale), "postscale": float(postscale), "wire": wire}
    hosts = [_host(t) for t in tensors]
    outputs = outputs_from(tensors, hosts)
    host_outs, post = _staged(outputs, hosts)

    return _submit("allreduce", name, desc, (hosts, host_outs), pset, post)


def _new_outputs(tensors, hosts):
    return [torch.empty_like(t) for t in tensors]


def _inplace_outputs(tensors, hosts):
    return list(tensors)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set):
    op = handle_average_backwards_compatibility(op, average)
    hid = _allreduce_async([tensor], _new_outputs, name, op, prescale_factor, postscale_factor, process_set,
                           "allreduce")
    _unwrap_single(hid)
    return hid


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set):
    op = handle_average_backwards_compatibility(op, average)
    hid = _allreduce_async([tensor], _inplace_outputs, name, op, prescale_factor, postscale_factor, process_set,
                           "allreduce")
    _unwrap_single(hid)
    return hid


def _unwrap_single(hid):
    inner = _post[hid]
    _post[hid] = lambda result: inner(result)[0]


class _AllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale, postscale, process_set):
        ctx.args = (op, prescale, postscale, process_set)
        return synchronize(allreduce_async(tensor, None, name, op, prescale, postscale, process_set))

    @staticmethod
    def backward(ctx, grad):
        op, prescale, postscale, process_set = ctx.args
        return allreduce(grad, op=op, prescale_factor=prescale, postscale_factor=postscale,
                         process_set=process_set), None, None, None, None, None


def _dense_compression(compression, what):
    if getattr(compression, "sparse", False):
        raise ValueError("%s: %s is a sparse (WAN) compressor; use it with hvd.allreduce or "
                         "DistributedOptimizer" % (what, compression.name))
    return compression


def sparse_allreduce_async(tensors, compression, name, op=Average, prescale_factor=1.0, postscale_factor=1.0,
                           process_set=global_process_set, memory=None, step=None, inplace=False):
    """Reduce float32 tensors (fused) over all ranks through a sparse compressor on the
    cross-cluster hop: dense inside each cluster, compressed across clusters (see exchange.py).

    ``name`` keys the error-feedback residual (kept in ``memory``, by default the runtime's);
    ``step`` feeds the compressor's context (random-k draws), by default a per-name counter."""
    what = "hvd.allreduce(compression=%s)" % compression.name
    _engine(what)
    pset = _pset(process_set, what)
    rt = runtime._runtime
    if not name:
        raise ValueError("%s: a sparse compressor keeps an error-feedback residual per tensor, so the tensor "
                         "needs a stable name=" % what)
    for t in tensors:
        _check_tensor(t, what)
        if t.dtype != torch.float32:
            raise TypeError("%s: sparse compression takes float32 tensors, got %s" % (what, t.dtype))
    if op not in (Average, Sum):
        raise ValueError("%s: sparse compression sums; op must be hvd.Average or hvd.Sum" % what)
    if step is None:
        step = rt.sparse_steps.get(name, 0)
        rt.sparse_steps[name] = step + 1
    desc = {"kind": "sparse_allreduce", "name": name, "dtype": "float32",
            "shapes": [list(t.shape) for t in tensors], "op": _OP_NAMES[op], "prescale": float(prescale_factor),
            "postscale": float(postscale_factor), "compressor": list(compression.settings()), "step": int(step),
            "seed": rt.config.seed}
    hosts = [_host(t) for t in tensors]
    outputs = list(tensors) if inplace else [torch.empty_like(t) for t in tensors]
    host_outs, post = _staged(outputs, hosts)

    mem = rt.sparse_memory if memory is None else memory
    return _submit("sparse_allreduce", name, desc, (hosts, host_outs, compression, mem, rt.wan_stats), pset, post)


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """Reduce ``tensor`` over all ranks of ``process_set`` and return the result (a new tensor)."""
    _check_tensor(tensor, "hvd.allreduce")
    op = handle_average_backwards_compatibility(op, average)
    if getattr(compression, "sparse", False) and tensor.dtype == torch.float32:
        if tensor.requires_grad and torch.is_grad_enabled():
            raise ValueError("hvd.allreduce: autograd does not pass through a sparse compressor; detach the "
                             "tensor (sparse compression is meant for gradients)")
        return synchronize(sparse_allreduce_async([tensor], compression, name, op, prescale_factor,
                                                  postscale_factor, process_set))[0]
    if getattr(compression, "sparse", False):
        compression = Compression.none  # integer and 16-bit tensors take the dense route
    compression = _dense_compression(compression, "hvd.allreduce")
    compressed, ctx = compression.compress(tensor)
    if compressed.requires_grad and torch.is_grad_enabled():
        out = _AllreduceFn.apply(compressed, name, op, prescale_factor, postscale_factor, process_set)
    else:
        out = synchronize(allreduce_async(compressed, None, name, op, prescale_factor, postscale_factor, process_set))
    return compression.decompress(out, ctx)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set):
    """In-place allreduce; returns ``tensor``."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                            process_set=global_process_set):
    op = handle_average_backwards_compatibility(op, average)
    return _allreduce_async(list(tensors), _new_outputs, name, op, prescale_factor, postscale_factor, process_set,
                            "grouped_allreduce")


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set):
    op = handle_average_backwards_compatibility(op, average)
    return _allreduce_async(list(tensors), _inplace_outputs, name, op, prescale_factor, postscale_factor,
                            process_set, "grouped_allreduce")


class _GroupedAllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, prescale, postscale, process_set, *tensors):
        ctx.args = (op, prescale, postscale, process_set)
        return tuple(synchronize(grouped_allreduce_async(list(tensors), None, name, op, prescale, postscale,
                                                         process_set)))

    @staticmethod
    def backward(ctx, *grads):
        op, prescale, postscale, process_set = ctx.args
        reduced = grouped_allreduce(list(grads), op=op, prescale_factor=prescale, postscale_factor=postscale,
                                    process_set=process_set)
        return (None, None, None, None, None) + tuple(reduced)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """Reduce a list of tensors in one fused collective; returns a list."""
    op = handle_average_backwards_compatibility(op, average)
    compression = _dense_compression(compression, "hvd.grouped_allreduce")
    for t in tensors:
        _check_tensor(t, "hvd.grouped_allreduce")
    pairs = [compression.compress(t) for t in tensors]
    compressed = [p[0] for p in pairs]
    if torch.is_grad_enabled() and any(t.requires_grad for t in compressed):
        outs = _GroupedAllreduceFn.apply(name, op, prescale_factor, postscale_factor, process_set, *compressed)
    else:
        outs = synchronize(grouped_allreduce_async(compressed, None, name, op, prescale_factor, postscale_factor,
                                                   process_set))
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, pairs)]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set):
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


# ---------------- allgather ----------------

def allgather_async(tensor, name=None, process_set=global_process_set):
    what = "hvd.allgather"
    _engine(what)
    pset = _pset(process_set, what)
    _check_tensor(tensor, what)
    if tensor.dim() == 0:
        raise ValueError("%s: cannot allgather a rank-zero (scalar) tensor; reshape it to 1-D" % what)
    name = name or _auto_name("allgather", pset)
    desc = {"kind": "allgather", "name": name, "dtype": dtype_name(tensor.dtype), "trailing": list(tensor.shape[1:])}
    device = tensor.device

    def post(result):
        out, _rows = result
        return out.to(device) if device.type != "cpu" else out

    return _submit("allgather", name, desc, (_host(tensor),), pset, post)


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
    _check_tensor(tensor, "hvd.allgather")
    if tensor.requires_grad and torch.is_grad_enabled():
        return _AllgatherFn.apply(tensor, name, process_set)
    return synchronize(allgather_async(tensor, name, process_set))


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    base = name or _auto_name("grouped_allgather", process_set)
    return [allgather(t, "%s_%dof%d" % (base, i + 1, len(tensors)), process_set) for i, t in enumerate(tensors)]


# ---------------- broadcast ----------------

def _broadcast_async(tensor, root_rank, name, process_set, inplace):
    what = "hvd.broadcast"
    _engine(what)
    pset = _pset(process_set, what)
    _check_tensor(tensor, what)
    if not isinstance(root_rank, int) or root_rank not in pset.ranks:
        raise ValueError("%s: root_rank %r is not a rank of the process set (ranks %s)"
                         % (what, root_rank, pset.ranks))
    name = name or _auto_name("broadcast", pset)
    desc = {"kind": "broadcast", "name": name, "dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape),
            "root": root_rank}
    host = _host(tensor)
    out = tensor if inplace else torch.empty_like(tensor)
    host_out = out if (out.device.type == "cpu" and out.is_contiguous()) else torch.empty_like(host)

    def post(result):
        if out is not host_out:
            out.copy_(host_out)
        return out

    return _submit("broadcast", name, desc, (host, host_out), pset, post)


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
        if runtime.rank() != ctx.root_rank:
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Return ``root_rank``'s ``tensor`` on every rank (a new tensor)."""
    _check_tensor(tensor, "hvd.broadcast")
    if tensor.requires_grad and torch.is_grad_enabled():
        return _BroadcastFn.apply(tensor, root_rank, name, process_set)
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """In-place broadcast; returns ``tensor``."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# ---------------- alltoall ----------------

def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    what = "hvd.alltoall"
    _engine(what)
    pset = _pset(process_set, what)
    _check_tensor(tensor, what)
    if tensor.dim() == 0:
        raise ValueError("%s: cannot alltoall a rank-zero (scalar) tensor" % what)
    n = pset.nranks
    if splits is None:
        if tensor.shape[0] % n:
            raise ValueError("splits not provided, but first dimension of tensor is not an even multiple of "
                             "the number of workers.")
        split_list = [tensor.shape[0] // n] * n
    else:
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
    name = name or _auto_name("alltoall", pset)
    desc = {"kind": "alltoall", "name": name, "dtype": dtype_name(tensor.dtype), "trailing": list(tensor.shape[1:]),
            "size": n}
    device = tensor.device
    splits_like = splits if isinstance(splits, torch.Tensor) else None
    host = _host(tensor)[:sum(split_list)]

    def post(result):
        out, recv = result
        if device.type != "cpu":
            out = out.to(device)
        if splits_like is not None:
            recv = recv.to(splits_like.device)
        return out, recv

    return _submit("alltoall", name, desc, (host, split_list), pset, post)


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
    _check_tensor(tensor, "hvd.alltoall")
    if tensor.requires_grad and torch.is_grad_enabled():
        out, recv = _AlltoallFn.apply(tensor, splits, name, process_set)
    else:
        out, recv = synchronize(alltoall_async(tensor, splits, name, process_set))
    return out if splits is None else (out, recv)


# ---------------- reducescatter ----------------

def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0):
    what = "hvd.reducescatter"
    _engine(what)
    pset = _pset(process_set, what)
    _check_tensor(tensor, what)
    if tensor.dim() == 0:
        raise ValueError("%s: cannot reducescatter a rank-zero (scalar) tensor" % what)
    opname = _op_name(op, tensor.dtype)
    name = name or _auto_name("reducescatter", pset)
    desc = {"kind": "reducescatter", "name": name, "dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape),
            "op": opname, "prescale": float(prescale_factor), "postscale": float(postscale_factor), "wire": None}
    device = tensor.device
    return _submit("reducescatter", name, desc, (_host(tensor),), pset,
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
    _check_tensor(tensor, "hvd.reducescatter")
    compression = _dense_compression(compression, "hvd.reducescatter")
    compressed, ctx = compression.compress(tensor)
    if compressed.requires_grad and torch.is_grad_enabled():
        out = _ReducescatterFn.apply(compressed, name, op, process_set, prescale_factor, postscale_factor)
    else:
        out = synchronize(reducescatter_async(compressed, name, op, process_set, prescale_factor, postscale_factor))
    return compression.decompress(out, ctx)


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    base = name or _auto_name("grouped_reducescatter", process_set)
    return [reducescatter(t, "%s_%dof%d" % (base, i + 1, len(tensors)), compression, op, process_set,
                          prescale_factor, postscale_factor) for i, t in enumerate(tensors)]


# ---------------- barrier and join ----------------

def barrier(process_set=global_process_set):
    """Wait until every rank of the process set has reached the barrier."""
    _engine("hvd.barrier")
    pset = _pset(process_set, "hvd.barrier")
    synchronize(_submit("barrier", _auto_name("barrier", pset), {"kind": "barrier", "name": "barrier"}, (), pset,
                        None))


def join(device=-1):
    """Declare that this rank has no more batches: until every rank has joined it takes part in
    the others' allreduces with zeros (Average still divides by the full size). Returns the
    rank that joined last."""
    eng = _engine("hvd.join")
    if not eng.config.check_collectives:
        raise HorovodInternalError("hvd.join() needs the agreement round; unset STELLA_CHECK_COLLECTIVES=0")
    hid = eng.submit(Op("join", _auto_name("join"), {"kind": "join", "name": "join"}, (), None, global_process_set))
    return eng.wait(hid)


__all__ = [n for n in dir() if not n.startswith("_") and n not in ("itertools", "threading", "warnings", "torch",
                                                                     "runtime", "Op", "EXECUTORS", "exchange")]
