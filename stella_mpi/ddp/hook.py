"""A DistributedDataParallel communication hook that sends DDP's gradient buckets through
stella's hierarchy: dense inside each cluster, the cross-cluster route across clusters.

    import stella_mpi as hvd
    from stella_mpi import ddp

    ddp.init_process_group()                       # torch.distributed from the MPI job
    model = torch.nn.parallel.DistributedDataParallel(net)
    state = ddp.StellaHookState(net, compression=hvd.Compression.cacheaware(density=0.01))
    model.register_comm_hook(state, ddp.stella_hook)
    optimizer = ddp.skip_refused_steps(torch.optim.SGD(model.parameters(), lr=0.1), state)

As torch's ``PowerSGDState`` and its hooks: a state object (the error-feedback residuals, the
step count, the route) and a plain function. Each bucket becomes one stella allreduce, named
after the parameters it holds (so a residual follows its parameters when DDP rebuilds its
buckets after the first step, and across a checkpoint), queued on stella's collective thread
while backward goes on; the future DDP waits for is completed by a small waiter thread when
the allreduce is done.

The first step a state sees is sent dense: DDP rebuilds its buckets after its first step (in
the order gradients became ready), so what a sparse route left in the first layout's residuals
would never be sent. A checkpoint's residuals, restored by :meth:`StellaHookState.load_state_dict`,
are those of the rebuilt layout: untouched by that dense step, they are sent from the next.

The route across clusters (``compression``):

* a stella sparse compressor (``Compression.cacheaware``, ``topk``, ``threshold``, ``randomk``)
  or ``Compression.thc(bits=...)``: that route, with error feedback (residuals in the state);
* ``Compression.none``, ``fp16``, ``bf16``: Horovod's dense allreduce (16-bit on the wire);
* ``None`` (the default): the route the optimizer's automatic route starts with: dense with one
  cluster or ``STELLA_WAN_ROUTE=dense``, else cache-aware 1 % with error feedback. The adjuster
  does not drive the hook: the density stays what it starts with (``state.compression``, which
  may be changed between steps).

Non-finite gradients follow ``STELLA_NONFINITE`` as on the Horovod path: the agreement round
refuses a bucket holding NaN/Inf on any rank, on every rank alike, before anything is selected
(the residuals stay finite). ``skip`` (the default): the bucket's result is NaN on every rank,
as an allreduce would have made it (a GradScaler then skips alike everywhere), ``state.skipped``
is set for the step, and an optimizer wrapped by :func:`skip_refused_steps` does not update;
``raise``: backward raises ``NonFiniteGradientError`` on every rank; ``off``: no check. Any other
failure of a bucket's allreduce (a peer gone, a deadline) is raised from backward, with its type.
"""
import hashlib
import logging
import queue
import threading

import torch
import torch.distributed as dist

from ..api.allreduce import allreduce_tensors_async, compressed_allreduce_async, inplace_outputs
from ..api.functions import allgather_object
from ..api.handles import synchronize
from ..api.reduce_ops import Average
from ..base.config import wan_route_setting
from ..base.errors import NonFiniteGradientError
from ..compression import Compression
from ..compression.memory import Memory
from ..core import state as runtime
from ..core.process_sets import global_process_set
from ..optim.routes.sync import density_warmup

log = logging.getLogger("stella_mpi")

AUTO_DENSITY = 0.01   # the automatic route's first rung (optim/tuning.py's AUTO_DENSITY)


def automatic_compression(process_set):
    """What ``compression=None`` sends across clusters (see the module's docstring)."""
    if process_set.topology.num_clusters < 2 or wan_route_setting() == "dense":
        return Compression.none
    return Compression.cacheaware(density=AUTO_DENSITY)


def _checked_compression(compression):
    if compression is None:
        return None
    if isinstance(compression, type) and getattr(compression, "sparse", True) is False:
        return compression   # Horovod's dense compressors are classes: none, fp16, bf16
    if getattr(compression, "sparse", False):
        return compression
    raise TypeError("StellaHookState(compression=%r): expected hvd.Compression.none, fp16, bf16, a stella "
                    "compressor such as hvd.Compression.cacheaware(density=0.01) or thc(bits=4), or None (the "
                    "automatic route)" % (compression,))


class StellaHookState:
    """The hook's state: the route, the error-feedback residuals, the step count.

    ``module``: the model DDP wraps (or the DDP model): the hook names each bucket after the
    parameters it holds, by their place in ``module.parameters()``. ``compression``: the
    cross-cluster route (module docstring). ``process_set``: stella's set the buckets are
    reduced over; it must hold the same ranks as ``process_group`` (default: torch's default
    group, e.g. from :func:`init_process_group`), the group DDP reduces over."""

    def __init__(self, module, compression=None, process_set=global_process_set, process_group=None):
        if not isinstance(module, torch.nn.Module):
            raise TypeError("StellaHookState(module=%r): pass the model DDP wraps (a torch.nn.Module); the hook names "
                            "each bucket after the parameters it holds" % (module,))
        runtime.current("stella_mpi.ddp.StellaHookState")
        self.module = module.module if isinstance(module, torch.nn.parallel.DistributedDataParallel) else module
        self.process_set = process_set
        self.process_group = process_group
        self.compression = (automatic_compression(process_set) if compression is None
                            else _checked_compression(compression))
        self.memory = Memory()      # error-feedback residuals, by bucket name
        self.step = 0               # optimizer steps seen (last buckets launched)
        self.skipped_steps = 0      # steps whose gradients were refused (STELLA_NONFINITE=skip)
        self._refused = set()       # of those, the recent ones
        self._index = None          # id(parameter) -> its place in module.parameters()
        self._layouts = {}          # bucket index -> parameter places, as agreed with the other ranks
        self._checked_group = False
        self._seen_a_step = False   # see _launch
        self._step_futures = []     # the futures of the step whose backward is running
        self._errors = {}           # future -> the exception backward raises
        self._pending = queue.Queue()
        self._waiter = None
        self._lock = threading.Lock()

    # ---- checkpoints

    def state_dict(self):
        """The residuals (by bucket name), the step count and the route's settings."""
        return {"residuals": self.memory.state_dict(), "step": self.step,
                "compression": list(getattr(self.compression, "settings", lambda: (self.compression.__name__,))())}

    def load_state_dict(self, sd):
        """Restore :meth:`state_dict`'s residuals and step count (the route is the constructor's)."""
        if not isinstance(sd, dict) or "residuals" not in sd or "step" not in sd:
            raise ValueError("StellaHookState.load_state_dict: expected a dict from state_dict() with 'residuals' and "
                             "'step', got %r" % (sorted(sd) if isinstance(sd, dict) else type(sd).__name__,))
        self.memory.load_state_dict(sd["residuals"])
        self.step = int(sd["step"])

    # ---- the hook's parts

    def _check_group(self):
        if self._checked_group:
            return
        pg = self.process_group
        if not dist.is_initialized():
            raise RuntimeError("stella_hook: torch.distributed is not initialised; call "
                               "stella_mpi.ddp.init_process_group() before building DistributedDataParallel")
        ranks = dist.get_process_group_ranks(pg if pg is not None else dist.group.WORLD)
        rt = runtime.current("stella_hook")
        mine = self.process_set.ranks if self.process_set.ranks is not None else list(range(rt.size))
        if dist.get_rank() != rt.rank or sorted(ranks) != sorted(mine):
            raise ValueError("stella_hook: DDP reduces over torch ranks %s (this is torch rank %d, MPI rank %d), but "
                             "the hook's process set holds ranks %s; build DDP on the job's group "
                             "(stella_mpi.ddp.init_process_group()) or pass StellaHookState(process_set=...) with the "
                             "same ranks" % (sorted(ranks), dist.get_rank(), rt.rank, sorted(mine)))
        self._checked_group = True

    def _bucket_name(self, bucket):
        """The bucket's name: its index and a digest of its parameters' places. A new layout of
        an index (DDP rebuilds its buckets after the first step) is compared across ranks once."""
        if self._index is None:
            self._index = {id(p): i for i, p in enumerate(self.module.parameters())}
        try:
            places = tuple(self._index[id(p)] for p in bucket.parameters())
        except KeyError:
            raise ValueError("stella_hook: a parameter of DDP's bucket %d is not in the module given to "
                             "StellaHookState; pass the model DDP wraps" % bucket.index()) from None
        index = bucket.index()
        if self._layouts.get(index) != places:
            self._agree_layout(index, places, bucket.buffer().numel())
            self._layouts[index] = places
        digest = hashlib.sha1(repr(places).encode()).hexdigest()[:10]
        return "ddp.bucket%d.%s" % (index, digest)

    def _agree_layout(self, index, places, numel):
        layouts = allgather_object((places, numel), name="ddp.layout%d.%d" % (index, len(self._layouts)),
                                   process_set=self.process_set)
        if len({tuple(l) for l in layouts}) > 1:
            ranks = self.process_set.ranks or list(range(len(layouts)))
            groups = {}
            for r, (p, n) in zip(ranks, layouts):
                groups.setdefault((tuple(p), n), []).append(r)
            lines = ["ranks %s: parameters %s (%d entries)" % (", ".join(map(str, rs)), _short(list(p)), n)
                     for (p, n), rs in sorted(groups.items(), key=lambda kv: kv[1])]
            raise ValueError("stella_hook: DDP's bucket %d differs between ranks (same model and bucket_cap_mb on "
                             "every rank?):\n  %s" % (index, "\n  ".join(lines)))

    def _launch(self, bucket):
        self._check_group()
        name = self._bucket_name(bucket)
        buf = bucket.buffer()
        comp = self.compression
        # the first step this state sees goes dense: DDP rebuilds its buckets after its first
        # step, so a residual kept for the first layout would never be sent
        if getattr(comp, "sparse", False) and buf.dtype == torch.float32 and self._seen_a_step:
            comp = density_warmup(comp, self.step, int(getattr(comp, "warmup", 0) or 0))
            handle = compressed_allreduce_async([buf], comp, name, Average, process_set=self.process_set,
                                                memory=self.memory, step=self.step, inplace=True)
            finish = None
        else:   # dense: Horovod's allreduce, 16-bit on the wire with fp16/bf16
            dense = comp if isinstance(comp, type) else Compression.none
            sent, ctx = dense.compress(buf)
            handle = allreduce_tensors_async([sent], inplace_outputs, name, Average, 1.0, 1.0, self.process_set,
                                             "ddp", single=True, gradients=True)

            def finish(out, dense=dense, ctx=ctx, buf=buf):
                if out is not buf:
                    buf.copy_(dense.decompress(out, ctx))
        fut = torch.futures.Future()
        if not self._step_futures:
            # after backward, before it returns: a refusal or failure of this step is raised from
            # backward with its own type (an exception set on DDP's future reaches the user as
            # "Unable to cast ... to Tensor"). Queued from a callback, it runs after DDP's own
            # (finalize_backward, queued once the last bucket is launched), so DDP is ready for the
            # next step when it raises.
            futures = self._step_futures
            queue = torch.autograd.Variable._execution_engine.queue_callback
            queue(lambda: queue(lambda: self._end_of_backward(futures)))
        self._step_futures.append(fut)
        self._pending.put((handle, finish, buf, fut, self.step))
        self._start_waiter()
        if bucket.is_last():
            self._step_futures = []
            self.step += 1
            self._seen_a_step = True
        return fut

    @property
    def skipped(self):
        """Whether the gradients of the last step that finished backward were refused on every
        rank (``STELLA_NONFINITE=skip``); :func:`skip_refused_steps` reads it."""
        return (self.step - 1) in self._refused

    def _start_waiter(self):
        with self._lock:
            if self._waiter is None or not self._waiter.is_alive():
                self._waiter = threading.Thread(target=self._wait_loop, name="stella-ddp-hook", daemon=True)
                self._waiter.start()

    def _wait_loop(self):
        while True:
            handle, finish, buf, fut, step = self._pending.get()
            try:
                out = synchronize(handle)
                if finish is not None:
                    finish(out[0] if isinstance(out, list) else out)
            except NonFiniteGradientError as e:
                buf.fill_(float("nan"))   # as an allreduce would have made it: a GradScaler decides alike
                if runtime.current().config.nonfinite == "raise":
                    self._errors[fut] = e
                elif step not in self._refused:
                    self._refused = {s for s in self._refused if s > step - 8} | {step}
                    self.skipped_steps += 1
                    log.warning("stella_mpi: step %d refused on every rank (DDP hook; an optimizer wrapped by "
                                "skip_refused_steps does not update): %s", step, str(e).split(": ", 1)[-1])
            except BaseException as e:  # noqa: BLE001 - raised from backward by _end_of_backward
                self._errors[fut] = e
            fut.set_result(buf)

    def _end_of_backward(self, futures):
        """Every bucket of the step is back: close the step in ``hvd.stats()`` (as the Horovod
        path's synchronize() does), then raise the first failure, if any, from backward."""
        for fut in futures:
            fut.wait()
        runtime.current().wan_stats.end_step()
        errors = [self._errors.pop(f) for f in futures if f in self._errors]
        if errors:
            raise errors[0]

def _short(xs, n=8):
    return str(xs) if len(xs) <= n else "[%s, ... %d more]" % (", ".join(map(str, xs[:n])), len(xs) - n)


def stella_hook(state, bucket):
    """DDP's communication hook: ``ddp_model.register_comm_hook(state, stella_hook)`` with a
    :class:`StellaHookState`. Returns the future of the bucket's average over the process set."""
    if not isinstance(state, StellaHookState):
        raise TypeError("stella_hook's state must be a stella_mpi.ddp.StellaHookState, got %s"
                        % type(state).__name__)
    if not isinstance(bucket, dist.GradBucket):
        raise TypeError("stella_hook is a DistributedDataParallel communication hook: it takes DDP's GradBucket, "
                        "got %s. FSDP, DeepSpeed and Lightning's other strategies call their hooks otherwise; use "
                        "DDP (Lightning: stella_mpi.ddp.lightning.StellaDDPStrategy)" % type(bucket).__name__)
    return state._launch(bucket)


def skip_refused_steps(optimizer, state):
    """Make ``optimizer.step()`` a no-op on a step whose gradients the hook refused
    (``STELLA_NONFINITE=skip``: a NaN/Inf gradient on some rank), as the Horovod path's
    ``DistributedOptimizer`` skips it; returns the optimizer. A closure (Lightning's) runs first,
    so the refusal is known when the update is decided."""
    inner = optimizer.step

    def step(closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if state.skipped:
            return loss
        return inner()
    optimizer.step = step
    return optimizer
