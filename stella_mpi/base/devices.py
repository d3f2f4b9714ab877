"""CUDA tensors on the collective routes: when their data is ready, a side stream per device,
and pinned host buffers for what must cross PCIe.

The rules every route follows (and the CPU engine's copies too):

* **Ready.** A collective submitted with CUDA tensors records an event on the caller's current
  stream (:func:`ready_event`). The collective thread waits for it (host side) before it reads
  the tensors: the gradient kernels that backward queued before the hook are finished then,
  whatever stream they ran on.
* **Side stream.** Everything the collective thread queues on a device runs on that device's
  side stream (:class:`DeviceRoute`), never on the caller's stream, so backward keeps the compute
  stream busy meanwhile. Before the op's handle completes the side stream is synchronized, so a
  caller that waited on the handle may use the outputs on any stream.
* **Pinned staging.** Data bound for MPI goes device-to-host into page-locked buffers kept per
  route and slot (reused from step to step), and comes back host-to-device from them.

On a CPU tensor every method is a plain copy or nothing, so the same code runs (and is tested)
without a GPU. ``STELLA_DEVICE_PATH=torch`` sends CPU tensors through the device route (torch-op
selection, device-side scatter) so that a machine without CUDA exercises it end to end.
"""
import threading
from contextlib import nullcontext

import torch

from .config import device_path_setting


def device_path_forced():
    """Whether CPU tensors take the device route (``STELLA_DEVICE_PATH=torch``; tests and debugging)."""
    return device_path_setting() == "torch"


def on_device_route(tensor):
    """Whether ``tensor`` takes the device route: it is a CUDA tensor, or the route is forced."""
    return tensor.device.type == "cuda" or device_path_forced()


def device_name(device):
    """"cuda" or "cpu": what the negotiation compares across ranks (ranks of one collective must
    agree; the device index is each rank's own business)."""
    return torch.device(device).type


def one_device(tensors, what, names=None):
    """The device all ``tensors`` are on; a ValueError naming the first that is elsewhere."""
    device = None
    for i, t in enumerate(tensors):
        if device is None:
            device = t.device
        elif t.device != device:
            label = repr(names[i]) if names is not None else "tensor %d" % i
            first = repr(names[0]) if names is not None else "tensor 0"
            raise ValueError("%s: %s is on %s but %s is on %s; one collective (or one CPU-engine optimizer) "
                             "takes tensors of one device" % (what, label, t.device, first, device))
    return device


class ReadyEvent:
    """An event recorded on the caller's current stream of a CUDA device; ``synchronize()``
    blocks the calling (collective) thread until everything queued before it has run."""
    __slots__ = ("event",)

    def __init__(self, device):
        self.event = torch.cuda.Event()
        self.event.record(torch.cuda.current_stream(device))

    def synchronize(self):
        self.event.synchronize()


def ready_event(tensors):
    """A :class:`ReadyEvent` for CUDA ``tensors`` (None for CPU ones: nothing to wait for)."""
    for t in tensors:
        if t.device.type == "cuda":
            return ReadyEvent(t.device)
    return None


class DeviceRoute:
    """The side stream and pinned staging buffers of one device (see the module docstring)."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._pinned = {}
        self._lock = threading.Lock()

    def context(self):
        """Queue work on the side stream (nothing on a CPU route)."""
        return torch.cuda.stream(self.stream) if self.cuda else nullcontext()

    def after(self, event):
        """Make the side stream wait for ``event`` (a torch.cuda.Event; None: nothing)."""
        if self.cuda and event is not None:
            self.stream.wait_event(event)

    def record(self):
        """An event marking what the side stream has queued so far (None on a CPU route)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def finish(self):
        """Wait (host side) until the side stream has run everything queued on it."""
        if self.cuda:
            self.stream.synchronize()

    def host_buffer(self, slot, n, dtype):
        """A host buffer of ``n`` elements for ``slot``, page-locked on a CUDA route, reused while
        large enough. A slot is used by one op at a time (the collective thread's, or one bucket's)."""
        with self._lock:
            buf = self._pinned.get((slot, dtype))
            if buf is None or buf.numel() < n:
                buf = torch.empty(max(int(n), 1), dtype=dtype, pin_memory=self.cuda)
                self._pinned[(slot, dtype)] = buf
            return buf[:n]

    def to_host(self, tensor, slot, wait=True):
        """The data of flat ``tensor`` in host memory: copied device-to-host on the side stream into
        the pinned buffer of ``slot`` (waited for unless ``wait`` is False); a CPU tensor is
        returned as it is."""
        if tensor.device.type == "cpu":
            return tensor
        out = self.host_buffer(slot, tensor.numel(), tensor.dtype)
        with self.context():
            out.copy_(tensor.reshape(-1), non_blocking=True)
        if wait:
            self.finish()
        return out

    def to_device(self, host, out=None):
        """Copy host tensor ``host`` to this route's device on the side stream (into ``out`` when
        given). Pinned sources copy asynchronously: call :meth:`finish` (or wait on
        :meth:`record`) before ``host`` is written again."""
        if not self.cuda:
            if out is None:
                return host
            out.copy_(host)
            return out
        with self.context():
            if out is None:
                return host.to(self.device, non_blocking=True)
            out.copy_(host, non_blocking=True)
            return out


_ROUTES = {}
_ROUTES_LOCK = threading.Lock()


def route_for(device):
    """The one :class:`DeviceRoute` of ``device`` in this process."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _ROUTES_LOCK:
        route = _ROUTES.get(device)
        if route is None:
            route = DeviceRoute(device)
            _ROUTES[device] = route
        return route
