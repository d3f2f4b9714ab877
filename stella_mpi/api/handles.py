"""Handing an op to the collective thread and getting its result back: host staging of the
tensors, the integer handles of Horovod's ``*_async`` calls, ``poll`` and ``synchronize``.

Allreduces (dense and sparse) take CUDA tensors as they are (:func:`on_device`): the collective
thread reads them after an event of the caller's stream and works on a side stream
(base/devices.py). The other collectives move bytes over MPI: their CUDA inputs are staged on
the host, and the handle's post-processing copies the result back where the caller wants it."""
import torch

from ..base.devices import ready_event
from ..core.collective_thread import Op
from ..core.executors import EXECUTORS
from .validation import running


def collective_thread(what):
    """The running collective thread; Horovod's error for a collective before ``init()``."""
    return running(what).collective_thread


def auto_name(prefix, process_set=None):
    """Horovod-style name of an unnamed op (counted per process set, reset by ``shutdown()``)."""
    return running("hvd.%s" % prefix).auto_name(prefix, process_set)


def host(t):
    """A contiguous CPU tensor with the data of ``t`` (``t`` itself when possible)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous()


def staged(outputs, hosts):
    """Host buffers the collective thread writes into (the outputs themselves when they are
    contiguous CPU tensors), and the function that copies them back into ``outputs`` when the
    op is done."""
    host_outs = [o if (o.device.type == "cpu" and o.is_contiguous()) else torch.empty_like(h)
                 for o, h in zip(outputs, hosts)]

    def post(result):
        with torch.no_grad():   # (an in-place op's output may be a parameter)
            for o, h in zip(outputs, host_outs):
                if o is not h:
                    o.copy_(h)
        return outputs
    return host_outs, post


def on_device(tensors, outputs):
    """Inputs and outputs of an allreduce of CUDA tensors, handed over as they are (the
    collective thread waits for the caller's stream: see :func:`submit`)."""
    return [t.detach() for t in tensors], list(outputs), (lambda result: outputs)


def submit(kind, name, desc, inputs, pset, post, finite=None, device_inputs=None):
    """Queue an op of the public API; returns its handle. ``finite``: tensors (gradients) that
    must hold no NaN/Inf on any rank, checked in the agreement round (see core/nonfinite.py).
    ``device_inputs``: CUDA tensors the op reads on the device; an event recorded now on the
    caller's stream tells the collective thread when they are written."""
    thread = collective_thread("hvd.%s" % kind)
    ready = ready_event(device_inputs) if device_inputs else None
    return thread.submit(Op(kind, name, desc, inputs, EXECUTORS[kind].run, pset, finite, ready), post)


class GroupHandle:
    """The handle of a grouped call that runs one collective per tensor (``grouped_allgather_async``,
    ``grouped_reducescatter_async``): ``synchronize`` returns the list of outputs."""
    __slots__ = ("handles",)

    def __init__(self, handles):
        self.handles = list(handles)


def poll(handle):
    """True when the op behind ``handle`` has finished (``synchronize`` will not wait)."""
    if isinstance(handle, GroupHandle):
        return all(poll(h) for h in handle.handles)
    return collective_thread("hvd.poll").poll(handle)


def finished_at(handle):
    """The time.perf_counter() at which the op behind ``handle`` ended (a group's: its last
    member's), or None while it runs (stella_mpi's own: not part of Horovod's API)."""
    if isinstance(handle, GroupHandle):
        times = [finished_at(h) for h in handle.handles]
        return None if any(t is None for t in times) else max(times, default=None)
    return collective_thread("hvd.finished_at").finished_at(handle)


def synchronize(handle):
    """Wait for an async op and return its output (None for an unknown handle, as in Horovod).
    The function ``sparse_allreduce_async`` returns is a handle too: it is called."""
    if isinstance(handle, GroupHandle):
        outputs, error = [], None
        for h in handle.handles:   # every member is waited for, even after one failed
            try:
                outputs.append(synchronize(h))
            except Exception as e:  # noqa: BLE001 - re-raised below, after the others
                error = error or e
        if error is not None:
            raise error
        return outputs
    if callable(handle):
        return handle()
    thread = collective_thread("hvd.synchronize")
    if not thread.known(handle):
        return None
    return thread.wait(handle)
