"""``hvd.allreduce`` and its variants (in place, async, grouped, sparse), with autograd."""
import torch

from ..compression import Compression
from ..core import state
from ..core.dtypes import dtype_name
from ..core.process_sets import global_process_set
from ..base.devices import device_name, one_device
from .handles import auto_name, collective_thread, host, on_device, staged, submit, synchronize
from .reduce_ops import OP_NAMES, Average, Sum, handle_average_backwards_compatibility, op_name
from .validation import check_tensor, checked_process_set, dense_compression


def allreduce_tensors_async(tensors, outputs_from, name, op, prescale, postscale, process_set, prefix, single=False,
                            gradients=False):
    """Queue one fused allreduce of ``tensors`` into ``outputs_from(tensors)``; ``single``: the
    handle returns the one output tensor instead of a list; ``gradients``: NaN/Inf on any rank
    refuses the op on every rank (NonFiniteGradientError), unless ``STELLA_NONFINITE=off``."""
    what = "hvd." + prefix
    collective_thread(what)
    pset = checked_process_set(process_set, what)
    if not tensors:
        raise ValueError("%s needs at least one tensor" % what)
    for t in tensors:
        check_tensor(t, what)
    dtype, device = tensors[0].dtype, tensors[0].device
    for i, t in enumerate(tensors):
        if t.dtype != dtype:
            raise ValueError("%s: all tensors of a group must share one dtype (got %s and %s)" % (what, dtype, t.dtype))
        if t.device != device:
            raise RuntimeError("Tensors in list must be on same device. (%s: tensor %d is on %s, tensor 0 on %s)"
                               % (what, i, t.device, device))
    opname = op_name(op, dtype)
    if dtype == torch.bool and (prescale != 1.0 or postscale != 1.0):
        raise TypeError("%s: prescale/postscale factors do not apply to bool tensors" % what)
    name = name or auto_name(prefix, pset)
    desc = {"kind": "allreduce", "name": name, "dtype": dtype_name(dtype),
            "shapes": [list(t.shape) for t in tensors], "op": opname,
            "prescale": float(prescale), "postscale": float(postscale), "device": device_name(device)}
    if device.type == "cuda" and opname != "adasum":
        hosts, host_outs, post = on_device(tensors, outputs_from(tensors))
    else:
        hosts = [host(t) for t in tensors]
        host_outs, post = staged(outputs_from(tensors), hosts)
    if single:
        post_all = post
        post = lambda result: post_all(result)[0]  # noqa: E731
    check = gradients and state.current().config.nonfinite != "off"
    return submit("allreduce", name, desc, (hosts, host_outs), pset, post, finite=hosts if check else None,
                  device_inputs=hosts if device.type == "cuda" else None)


def new_outputs(tensors):
    return [torch.empty_like(t) for t in tensors]


def inplace_outputs(tensors):
    return list(tensors)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set):
    op = handle_average_backwards_compatibility(op, average)
    return allreduce_tensors_async([tensor], new_outputs, name, op, prescale_factor, postscale_factor, process_set,
                            "allreduce", single=True)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set):
    op = handle_average_backwards_compatibility(op, average)
    return allreduce_tensors_async([tensor], inplace_outputs, name, op, prescale_factor, postscale_factor, process_set,
                            "allreduce", single=True)


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


def compressed_allreduce_async(tensors, compression, name, op=Average, prescale_factor=1.0, postscale_factor=1.0,
                           process_set=global_process_set, memory=None, step=None, inplace=False):
    """Reduce float32 tensors (fused) over all ranks through a sparse compressor on the
    cross-cluster hop: dense inside each cluster, compressed across clusters
    (stella_mpi/comm/sparse_exchange.py).

    ``name`` keys the error-feedback residual (kept in ``memory``, by default the runtime's);
    ``step`` feeds the compressor's context (random-k draws), by default a per-name counter.
    A NaN or Inf on any rank refuses the op on every rank before anything is selected, so the
    residual stays finite (NonFiniteGradientError), unless ``STELLA_NONFINITE=off``."""
    what = "hvd.allreduce(compression=%s)" % compression.name
    collective_thread(what)
    pset = checked_process_set(process_set, what)
    rt = state.current()
    if not name:
        raise ValueError("%s: a sparse compressor keeps an error-feedback residual per tensor, so the tensor "
                         "needs a stable name=" % what)
    for t in tensors:
        check_tensor(t, what)
        if t.dtype != torch.float32:
            raise TypeError("%s: sparse compression takes float32 tensors, got %s" % (what, t.dtype))
    if op not in (Average, Sum):
        raise ValueError("%s: sparse compression sums; op must be hvd.Average or hvd.Sum" % what)
    device = one_device(tensors, what)
    if step is None:
        step = rt.sparse_steps.get(name, 0)
        rt.sparse_steps[name] = step + 1
    desc = {"kind": "sparse_allreduce", "name": name, "dtype": "float32",
            "shapes": [list(t.shape) for t in tensors], "op": OP_NAMES[op], "prescale": float(prescale_factor),
            "postscale": float(postscale_factor), "compressor": list(compression.settings()), "step": int(step),
            "seed": rt.config.seed, "device": device_name(device)}
    outputs = list(tensors) if inplace else [torch.empty_like(t) for t in tensors]
    if device.type == "cuda":
        hosts, host_outs, post = on_device(tensors, outputs)
    else:
        hosts = [host(t) for t in tensors]
        host_outs, post = staged(outputs, hosts)
    mem = rt.sparse_memory if memory is None else memory
    return submit("sparse_allreduce", name, desc, (hosts, host_outs, compression, mem), pset, post,
                  finite=hosts if rt.config.nonfinite != "off" else None,
                  device_inputs=hosts if device.type == "cuda" else None)


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """Reduce ``tensor`` over all ranks of ``process_set`` and return the result (a new tensor)."""
    check_tensor(tensor, "hvd.allreduce")
    op = handle_average_backwards_compatibility(op, average)
    if getattr(compression, "sparse", False) and tensor.dtype == torch.float32:
        if tensor.requires_grad and torch.is_grad_enabled():
            raise ValueError("hvd.allreduce: autograd does not pass through a sparse compressor; detach the "
                             "tensor (sparse compression is meant for gradients)")
        return synchronize(compressed_allreduce_async([tensor], compression, name, op, prescale_factor,
                                                  postscale_factor, process_set))[0]
    if getattr(compression, "sparse", False):
        compression = Compression.none  # integer and 16-bit tensors take the dense route
    compression = dense_compression(compression, "hvd.allreduce")
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
    return allreduce_tensors_async(list(tensors), new_outputs, name, op, prescale_factor, postscale_factor, process_set,
                            "grouped_allreduce")


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set):
    op = handle_average_backwards_compatibility(op, average)
    return allreduce_tensors_async(list(tensors), inplace_outputs, name, op, prescale_factor, postscale_factor,
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
    compression = dense_compression(compression, "hvd.grouped_allreduce")
    for t in tensors:
        check_tensor(t, "hvd.grouped_allreduce")
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
