"""A DistributedDataParallel communication hook that sends DDP's gradient buckets through
stella's hierarchy: dense inside each cluster, the cross-cluster route across clusters.

    import stella_mpi as hvd
    from stella_mpi import ddp

    ddp.init_process_group()                       # torch.distributed from the MPI job
    model = torch.nn.parallel.DistributedDataParallel(net)
    state = ddp.StellaHookState(net, compression=hvd.Compression.cacheaware(density=0.01))
    model.register_comm_hook(state, ddp.stella_hook)
    optimizer = ddp.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), state)

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
* ``None`` (the default): the automatic route's synchronous part. With one cluster or
  ``STELLA_WAN_ROUTE=dense``: dense. Otherwise it starts with cache-aware 1 % and the adjuster
  (``adjuster=hvd.Adjuster(...)`` to set it; THC rungs of 2, 4 and 8 bits by default) chooses,
  from each window's measured compute, link and backlog, the density, THC bits or dense by time
  to loss, the same on every rank at the same step, as on the Horovod path. Local steps and
  the CPU engine are not among its choices: they need stella's optimizer, and a DDP hook cannot
  skip DDP's exchange. ``state.compression`` is the route of the next step.
* a stella compressor with ``adjuster=hvd.Adjuster(...)``: the adjuster tunes its density.

The compressor's density warm-up (DGC's) applies as on the Horovod path, and so does DGC's
momentum correction (``optim/momentum_correction.py``) for SGD with momentum on a sparse route
(and the automatic route), when the optimizer is wrapped by :func:`wrap_optimizer`: the hook turns each gradient
into the rank's velocity before it is sent, and the wrapped step applies the average with
momentum and weight decay switched off for that step, so that at density 1 the update is dense
momentum SGD's. Without the wrapper the hook sends gradients as they are.

Non-finite gradients follow ``STELLA_NONFINITE`` as on the Horovod path: the agreement round
refuses a bucket holding NaN/Inf on any rank, on every rank alike, before anything is selected
(the residuals stay finite). ``skip`` (the default): the bucket's result is NaN on every rank,
as an allreduce would have made it (a GradScaler then skips alike everywhere), ``state.skipped``
is set for the step, and an optimizer wrapped by :func:`wrap_optimizer` does not update;
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
from ..adjust.session import adjust_session
from ..adjust.settings import AdjusterSettings
from ..base.config import wan_route_setting
from ..base.errors import NonFiniteGradientError
from ..compression import Compression
from ..compression.memory import Memory
from ..core import state as runtime
from ..core.process_sets import global_process_set
from ..optim.momentum_correction import MomentumCorrectionState, plain_sgd_step
from ..optim.routes.sync import density_warmup
# the automatic route's first rung and THC rungs; "sparse, not THC" (what holds entries back)
from ..optim.tuning import AUTO_DENSITY, AUTO_THC_BITS, selective as _selective

log = logging.getLogger("stella_mpi")
route_log = logging.getLogger("stella_mpi.route")   # shown by default on rank 0 (core/state.py)


def automatic_compression(process_set):
    """What ``compression=None`` starts with across clusters (see the module's docstring)."""
    if process_set.topology.num_clusters < 2 or wan_route_setting() == "dense":
        return Compression.none
    return Compression.cacheaware(density=AUTO_DENSITY)


def _checked_adjuster(adjuster, automatic):
    """The adjuster's settings for the hook, or None. The hook tunes the synchronous rungs
    (densities, THC bits, dense); what needs the optimizer is refused."""
    if adjuster is None:
        return AdjusterSettings(thc_bits=AUTO_THC_BITS) if automatic else None
    if not isinstance(adjuster, AdjusterSettings):
        raise TypeError("StellaHookState(adjuster=%r): expected hvd.Adjuster(...) or None" % (adjuster,))
    refused = [(name, why) for name, why in (
        ("modes", "local steps need stella's DistributedOptimizer: a DDP hook cannot skip DDP's exchanges"),
        ("allow_accumulation", "the backward passes per step are the training loop's under DDP (no_sync)"),
        ("batch_split", "the batch size is the training loop's under DDP")) if getattr(adjuster, name)]
    if refused:
        raise ValueError("StellaHookState: hvd.Adjuster(%s=...) is not for the DDP hook: %s"
                         % (refused[0][0], refused[0][1]))
    if automatic and not adjuster.thc_bits:
        return AdjusterSettings(**{**adjuster.__dict__, "thc_bits": AUTO_THC_BITS})
    return adjuster


def _checked_compression(compression):
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
    cross-cluster route; ``adjuster``: ``hvd.Adjuster(...)`` settings (module docstring; its
    ``modes``, ``allow_accumulation`` and ``batch_split`` are refused: they need the
    optimizer). ``process_set``: stella's set the buckets are reduced over; it must hold the
    same ranks as ``process_group`` (default: torch's default group, e.g. from
    :func:`init_process_group`), the group DDP reduces over. ``name`` prefixes the names of the
    buckets' allreduces and residuals: give each state its own when several DDP models train at
    once (a GAN's two), and the same one when a checkpoint is restored."""

    def __init__(self, module, compression=None, process_set=global_process_set, process_group=None, adjuster=None,
                 name="ddp"):
        if not isinstance(module, torch.nn.Module):
            raise TypeError("StellaHookState(module=%r): pass the model DDP wraps (a torch.nn.Module); the hook names "
                            "each bucket after the parameters it holds" % (module,))
        runtime.current("stella_mpi.ddp.StellaHookState")
        self.module = module.module if isinstance(module, torch.nn.parallel.DistributedDataParallel) else module
        if not isinstance(name, str) or not name:
            raise ValueError("StellaHookState(name=%r): a non-empty string, the same on every rank" % (name,))
        self.name = name
        self.process_set = process_set
        self.process_group = process_group
        automatic = compression is None
        self.compression = automatic_compression(process_set) if automatic else _checked_compression(compression)
        settings = _checked_adjuster(adjuster, automatic) if getattr(self.compression, "sparse", False) else None
        if adjuster is not None and settings is None:
            raise ValueError("StellaHookState(adjuster=...) tunes a stella compressor's density (or the automatic "
                             "route's); with %s there is nothing to tune" % getattr(self.compression, "__name__",
                                                                                     self.compression))
        # the adjuster's telemetry and decisions (adjust/session.py), as on the Horovod path
        self.session = adjust_session(settings, self.compression, process_set, False, 1) if settings else None
        if self.session is not None:
            self.compression = self.session.compression   # its ladder's rung nearest the start
        # how far the density warm-up may raise the density: under the adjuster, its budget (before
        # its first estimate, the start's density), as optim/tuning.py does for the Horovod path
        self._warmup_cap = self.compression.density if self.session is not None else 1.0
        self.memory = Memory()      # error-feedback residuals, by bucket name
        self.step = 0               # optimizer steps seen (last buckets launched)
        self.skipped_steps = 0      # steps whose gradients were refused (STELLA_NONFINITE=skip)
        self._refused = set()       # of those, the recent ones
        self._index = None          # id(parameter) -> its place in module.parameters()
        self._layouts = {}          # bucket index -> parameter places, as agreed with the other ranks
        self._checked_group = False
        self._seen_a_step = False   # see _launch
        self._step_futures = []     # the futures of the step whose backward is running
        self._step_velocities = []  # names of the velocities the step changed (momentum correction)
        self._mc = None             # MomentumCorrectionState, set by wrap_optimizer where it applies
        self._mc_groups = {}        # id(parameter) -> its SGD param group (momentum correction)
        self._mc_loaded = None      # velocities from load_state_dict() before wrap_optimizer()
        self._errors = {}           # future -> the exception backward raises
        self._pending = queue.Queue()
        self._waiter = None
        self._lock = threading.Lock()

    # ---- checkpoints

    def state_dict(self):
        """The residuals (by bucket name), the step count and the route's settings."""
        out = {"residuals": self.memory.state_dict(), "step": self.step,
               "compression": list(getattr(self.compression, "settings", lambda: (self.compression.__name__,))())}
        if self._mc is not None:
            out["momentum_correction"] = self._mc.state_dict()
        return out

    def load_state_dict(self, sd):
        """Restore :meth:`state_dict`'s residuals and step count (the route is the constructor's)."""
        if not isinstance(sd, dict) or "residuals" not in sd or "step" not in sd:
            raise ValueError("StellaHookState.load_state_dict: expected a dict from state_dict() with 'residuals' and "
                             "'step', got %r" % (sorted(sd) if isinstance(sd, dict) else type(sd).__name__,))
        self.memory.load_state_dict(sd["residuals"])
        self.step = int(sd["step"])
        mc = sd.get("momentum_correction")
        if mc is not None:
            if self._mc is not None:
                self._mc.load_state_dict(mc)
            else:
                self._mc_loaded = mc

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
        return "%s.bucket%d.%s" % (self.name, index, digest)

    def _agree_layout(self, index, places, numel):
        layouts = allgather_object((places, numel), name="%s.layout%d.%d" % (self.name, index, len(self._layouts)),
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
        if self._mc is not None and getattr(comp, "sparse", False):
            # DGC: this rank's velocity is what crosses (the gradients are views of the buffer)
            for p, g in zip(bucket.parameters(), bucket.gradients()):
                group = self._mc_groups.get(id(p))
                if group is not None:
                    velocity = "p%d" % self._index[id(p)]
                    self._mc.transform(velocity, p, g, group)
                    self._step_velocities.append(velocity)
        # the first step this state sees goes dense: DDP rebuilds its buckets after its first
        # step, so a residual kept for the first layout would never be sent
        if getattr(comp, "sparse", False) and buf.dtype == torch.float32 and self._seen_a_step:
            warmed = density_warmup(comp, self.step, int(getattr(comp, "warmup", 0) or 0), self._warmup_cap)
            if warmed is not comp and self.session is not None:
                self.session.note_density(self.step, warmed.density)
            comp = warmed
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
            futures, velocities, step = self._step_futures, self._step_velocities, self.step
            queue = torch.autograd.Variable._execution_engine.queue_callback
            queue(lambda: queue(lambda: self._end_of_backward(futures, velocities, step)))
        self._step_futures.append(fut)
        self._pending.put((handle, finish, buf, fut, self.step))
        self._start_waiter()
        if bucket.is_last():
            self._step_futures, self._step_velocities = [], []
            if self.step == 1 and bucket.index() > 0 and _selective(self.compression) \
                    and runtime.current().rank == 0:   # (DDP's rebuilt buckets: the second step)
                route_log.info("DDP hook: DDP cut the gradients into %d buckets, and the sparse route selects "
                               "within each: at equal steps one bucket trained better here (held-out loss 2.418 "
                               "against 2.536 after 200 steps, docs/guides/ddp.md). "
                               "DistributedDataParallel(..., bucket_cap_mb=64) gives one bucket per 64 MB, as "
                               "Horovod's fusion does", bucket.index() + 1)
            self.step += 1
            self._seen_a_step = True
        return fut

    def _adjust(self, decision):
        """The adjuster's decision takes effect from the next step: its rung's compressor, and
        how far the density warm-up may go (optim/tuning.py's budget, as on the Horovod path)."""
        if decision is None:
            return
        self.compression = self.session.compression
        est = decision.estimate
        self._warmup_cap = self.session.controller.budget_density(est) if est is not None else \
            getattr(self.compression, "density", 1.0)
        if decision.changed and runtime.current().rank == 0:
            route_log.info("DDP hook, from step %d: %s (%s)", self.step, _describe(self.compression), decision.reason)

    @property
    def skipped(self):
        """Whether the gradients of the last step that finished backward were refused on every
        rank (``STELLA_NONFINITE=skip``); :func:`wrap_optimizer` reads it."""
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
                                "wrap_optimizer does not update): %s", step, str(e).split(": ", 1)[-1])
            except BaseException as e:  # noqa: BLE001 - raised from backward by _end_of_backward
                self._errors[fut] = e
            fut.set_result(buf)

    def _end_of_backward(self, futures, velocities, step):
        """Every bucket of the step is back: close the step in ``hvd.stats()`` (as the Horovod
        path's synchronize() does), then raise the first failure, if any, from backward."""
        if self.session is not None:
            self.session.enter()   # from here the training thread waits on the step's exchange
        for fut in futures:
            fut.wait()
        runtime.current().wan_stats.end_step()
        if velocities:   # a refused step leaves no trace in the velocities, as on the Horovod path
            refused = step in self._refused or any(isinstance(self._errors.get(f), NonFiniteGradientError)
                                                   for f in futures)
            for v in velocities:
                (self._mc.refused if refused else self._mc.applied)(v)
        if self.session is not None:
            self._adjust(self.session.end_step(self.step, 1))
        errors = [self._errors.pop(f) for f in futures if f in self._errors]
        if errors:
            raise errors[0]


def _describe(comp):
    if getattr(comp, "homomorphic", False):
        return "thc %d bits" % comp.bits
    if getattr(comp, "sparse", False):
        return "dense (density 1)" if comp.density >= 1.0 else "%s %g %%" % (comp.name, 100 * comp.density)
    return "dense (%s)" % getattr(comp, "__name__", comp)


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


def wrap_optimizer(optimizer, state):
    """What stella's DistributedOptimizer does around the user's step, for a DDP model with
    :func:`stella_hook` and ``state``; returns ``optimizer``, whose ``step()`` then:

    * does nothing on a step whose gradients the hook refused (``STELLA_NONFINITE=skip``: a
      NaN/Inf gradient on some rank), on every rank alike;
    * with DGC's momentum correction (SGD with momentum, float32, on a sparse route or the
      automatic route, whose THC rungs keep it; the compressor's ``momentum_correction``, "auto"
      by default, as on the Horovod path; THC alone holds nothing back and has none): applies
      the average of the velocities the hook sent, with momentum, dampening, nesterov and
      weight decay off for that step (the velocities already hold them).

    A closure (Lightning's) runs first, so the step's gradients are known when the update is
    decided."""
    if not isinstance(state, StellaHookState):
        raise TypeError("wrap_optimizer(optimizer, state): state must be a StellaHookState, got %s"
                        % type(state).__name__)
    comp = state.compression
    setting = getattr(comp, "momentum_correction", "auto")
    selective = _selective(comp)   # (THC holds none back)
    groups = []
    if selective and setting is not False and isinstance(optimizer, torch.optim.SGD):
        groups = [g for g in optimizer.param_groups if MomentumCorrectionState.check_group(g)
                  and all(p.dtype == torch.float32 for p in g["params"])]
    elif setting is True:
        raise ValueError("wrap_optimizer: momentum_correction=True needs torch.optim.SGD with momentum on a sparse "
                         "or THC route; got %s on %s" % (type(optimizer).__name__, _describe(state.compression)))
    if groups:
        state._mc = MomentumCorrectionState()
        state._mc_groups = {id(p): g for g in groups for p in g["params"]}
        if state._mc_loaded is not None:
            state._mc.load_state_dict(state._mc_loaded)
            state._mc_loaded = None
    inner = optimizer.step

    def step(closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if state.skipped:
            return loss
        if groups:
            plain_sgd_step(lambda c: inner(), groups)
        else:
            inner()
        return loss
    optimizer.step = step
    return optimizer
