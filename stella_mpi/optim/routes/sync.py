"""The synchronous gradient routes (Horovod's semantics): gradients averaged over the route's
process set in fused buckets, reduced in the background while backward goes on, then the
user's own optimizer steps on the result.

* :class:`DenseRoute`: Horovod's allreduce with a dense compressor (none, fp16, bf16) and any
  op. On the cluster's own process set it is the route of local steps (``kind="cluster"``).
* :class:`RankRoute`: no reduction: the route of local steps with ``inner="rank"``.
* :class:`SparseRoute`: the cross-cluster hop of each bucket through a sparse compressor with
  error feedback (dense inside each cluster): DGC's momentum correction for SGD with momentum
  (the route carries velocities, optim/momentum_correction.py) and the density warm-up.
* :class:`THCRoute`: the same hop through homomorphic quantization (``Compression.thc``).

A route talks to the optimizer it serves (``opt``) through: ``_names``, ``_params``,
``param_groups``, ``_memory`` (the error-feedback residuals, kept across routes), ``_mc`` and
``_mc_groups`` (momentum correction, kept across routes), ``_step_count``, ``_session`` (the
adjuster's telemetry, or None), ``backward_passes_per_step``, ``_buckets`` and ``_user_step``.
"""
import logging
import time

import torch

from ...api.allreduce import allreduce_tensors_async, compressed_allreduce_async, inplace_outputs
from ...api.handles import synchronize
from ...api.reduce_ops import Average, Sum
from ...api.sparse_tensors import sparse_allreduce_async
from ...base.errors import NonFiniteGradientError
from ...comm.hierarchy import compute_dtype
from ...compression import Compression
from ...core import state
from ...core.fusion import scale
from ...core.nonfinite import has_nonfinite
from ..buckets import Bucket
from ..cluster_channel import ClusterChannel
from ..momentum_correction import plain_sgd_step

log = logging.getLogger("stella_mpi")

WARMUP_START = 0.25   # the density DGC's warm-up starts from


def density_warmup(comp, step, steps, cap=1.0):
    """The compressor of step ``step`` under DGC's exponential density warm-up over ``steps``
    steps: the density falls geometrically from 25 % to ``comp``'s own, never above ``cap`` (the
    adjuster's step-time budget: optim/tuning.py) nor below ``comp``'s. THC sends every entry:
    nothing to warm up."""
    if step >= steps or getattr(comp, "homomorphic", False) or comp.density >= min(WARMUP_START, cap):
        return comp
    frac = step / steps
    return comp.with_density(min(cap, WARMUP_START ** (1 - frac) * comp.density ** frac))


# bytes per sent entry on the wire, by compressor (values 4 B plus index bytes; cache-aware sends
# one 2-4 byte block id per 16 values; random-k sends no indices); a dense entry costs 4 B
ENTRY_BYTES = {"cacheaware": 4.25, "topk": 6.0, "threshold": 6.0, "randomk": 4.0}


def reduce_alone(tensors, name, prescale, postscale):
    """The grouped allreduce of ``tensors`` (in place) over a process set of this rank alone,
    without the collective thread: NaN/Inf is refused as the agreement round refuses it, then
    any op over one rank is the identity and the scaling follows (in the reduction's dtype, as
    the executor does). The collective would cost a negotiation round with every rank of the job
    (local steps with clusters of one rank: one per inner step, queued behind an outer exchange
    in flight). Returns the handle: a function that ``synchronize`` calls, which does the work
    then, so that a CUDA check's wait for the device comes after backward, not inside it."""
    check = state.current().config.nonfinite != "off"

    def reduced():
        if check and has_nonfinite(tensors):
            rank = state.current().rank
            raise NonFiniteGradientError("rank %d: a non-finite gradient (NaN or Inf) on rank %d in the grouped "
                                         "allreduce %r; refused on every rank" % (rank, rank, name))
        if prescale != 1.0 or postscale != 1.0:
            for t in tensors:
                buf = t if t.dtype == compute_dtype(t.dtype) else t.to(compute_dtype(t.dtype))
                for factor in (prescale, postscale):
                    if factor != 1.0:
                        scale(buf, factor)
                if buf is not t:
                    t.copy_(buf)
        return tensors
    return reduced


class SyncBucket(Bucket):
    def __init__(self, index, params):
        super().__init__(index, params)
        self.handle = None       # the bucket's collective in flight
        self.compressed = None   # [(tensor reduced, compression context)] per parameter of ``dense``
        self.dense = params      # the parameters whose gradients go through ``handle``
        self.sparse = []         # [(parameter, wait)]: sparse gradients, gathered as Horovod does
        self.small = None        # (handle, parameters, tensors): small tensors reduced densely beside a sparse route


class SyncRoute:
    """Shared by the synchronous routes: the launch of a complete bucket (torch sparse
    gradients gathered as Horovod does, the others through :meth:`_reduce`), the wait for every
    bucket with the non-finite policy, and the user's step."""
    kind = None
    bucket_class = SyncBucket
    channel = None   # the cluster route's ClusterLane (DenseRoute kind "cluster", on a cluster of several ranks)

    def __init__(self, opt, process_set, op=Average, predivide=1.0, local_clip=None):
        self.opt = opt
        self.process_set = process_set
        self.op = op
        self.predivide = float(predivide)
        self.local_clip = None if local_clip is None else float(local_clip)   # deprecated (no gain measured)
        self.skip = False            # the reduced gradients of this step held NaN/Inf somewhere: no update
        self.corrected = False       # momentum correction carried this step's velocities
        self._densified = set()      # parameters whose sparse gradient was made dense for this step
        # seconds the callers spent starting this route's reductions and waiting for them (copies,
        # checks, scaling and copy back included), whatever carries them: the cluster's channel,
        # the negotiation, NCCL or a GPU staged through the host. What the automatic route saves
        # by making each rank a replica (optim/tuning.py reads the cluster route's)
        self.busy_s = 0.0

    def describe(self):
        return self.kind

    @property
    def active(self):
        """Whether this rank exchanges anything (in the set, more than one rank in the job)."""
        return self.process_set.included() and state.current().size > 1

    def hooked_params(self):
        """The parameters whose gradient hook hands gradients to this route during backward."""
        return self.opt._params if self.active else []

    def launch_in_backward(self):
        """With ``local_clip`` the buckets leave at synchronize(), once the norm is known."""
        return self.local_clip is None

    def _before_launch(self):
        """DGC's local gradient clipping: this rank's gradient is scaled to a norm of at most
        ``local_clip / sqrt(size)`` before it enters the reduction (and so the residual). A
        non-finite norm is left alone: the non-finite check refuses the step."""
        if self.local_clip is None:
            return
        grads = [p.grad for p in self.opt._params if p.grad is not None]
        if not grads:
            return
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.detach().to_dense()
                                                                              if g.is_sparse else g.detach())
                                                     for g in grads]))
        limit = self.local_clip / self.process_set.size() ** 0.5
        if bool(torch.isfinite(norm)) and float(norm) > limit:
            coef = limit / (float(norm) + 1e-6)
            for g in grads:
                g.mul_(coef)

    def grad_ready(self, p):
        """Backward produced ``p``'s gradient (Horovod's pass counting, then the bucket)."""
        opt = self.opt
        if opt._passes[p] <= 0:
            raise AssertionError("Gradients were computed more than backward_passes_per_step times before call "
                                 "to step(). Increase backward_passes_per_step to accumulate gradients locally.")
        opt._passes[p] -= 1
        if opt._passes[p] > 0:
            return
        opt._grad_final(p)

    def _grad_of(self, p):
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        elif p.grad.is_sparse:   # sparse_as_dense: reduced dense, handed back sparse (SparseAdam needs that)
            p.grad = p.grad.to_dense()
            self._densified.add(p)
        return p.grad

    def _scales(self):
        if self.op == Average:
            return 1.0 / self.predivide, self.predivide
        return 1.0, 1.0

    def launch(self, bucket):
        """Start reducing a complete bucket (from backward's hook, or at synchronize)."""
        opt = self.opt
        bucket.sparse, bucket.dense = [], []
        for p in bucket.params:
            if p.grad is not None and p.grad.is_sparse and not opt._spec.sparse_as_dense:
                if p in opt._mc_groups:
                    raise ValueError("DistributedOptimizer(momentum_correction=...): parameter %r has a sparse "
                                     "gradient, whose momentum the correction cannot carry; pass "
                                     "sparse_as_dense=True" % opt._names[p])
                if self.op not in (Average, Sum):
                    raise ValueError("DistributedOptimizer: parameter %r has a sparse gradient, which is gathered "
                                     "and summed; op must be Average or Sum (or pass sparse_as_dense=True)"
                                     % opt._names[p])
                bucket.sparse.append((p, sparse_allreduce_async(p.grad, "DistributedOptimizer.sparse." + opt._names[p],
                                                                self.op, self.process_set)))
            else:
                bucket.dense.append(p)
        if not bucket.dense:
            return
        grads = [self._grad_of(p) for p in bucket.dense]
        self._reduce(bucket, grads, bucket.name("DistributedOptimizer.bucket", opt._names))

    def _reduce(self, bucket, grads, name):
        """Start the reduction of ``grads`` (of ``bucket.dense``): set ``bucket.handle`` and
        ``bucket.compressed``."""
        raise NotImplementedError

    def _dense(self, bucket, grads, name, compression=Compression.none):
        """Horovod's grouped allreduce of ``grads`` through a dense compressor (on a set of one
        rank, the same result computed here: :func:`reduce_alone`)."""
        t0 = time.perf_counter()
        try:
            self._start_dense(bucket, grads, name, compression)
        finally:
            self.busy_s += time.perf_counter() - t0

    def _start_dense(self, bucket, grads, name, compression):
        """:meth:`_dense`'s work, which it times."""
        prescale, postscale = self._scales()
        pairs = [compression.compress(g) for g in grads]
        tensors = [c.contiguous() for c, _ in pairs]
        bucket.compressed = list(zip(tensors, [ctx for _, ctx in pairs]))
        bucket.decompress = compression.decompress
        if self.process_set.size() == 1:
            bucket.handle = reduce_alone(tensors, name, prescale, postscale)
            return
        if self.channel is not None and not bucket.sparse and self.op in (Average, Sum) \
                and ClusterChannel.takes(tensors):
            bucket.handle = self.channel.allreduce(tensors, name, self.op == Average, prescale, postscale,
                                                   bucket.index)
            return
        bucket.handle = allreduce_tensors_async(tensors, inplace_outputs, name, self.op, prescale, postscale,
                                                self.process_set, "grouped_allreduce", gradients=True)

    def synchronize(self):
        """Finish the reduction of every gradient (launching any bucket whose hooks did not
        fire); the step's counters close here."""
        opt = self.opt
        self.skip = False
        rt = state.current()
        if not self.active:
            if rt.size == 1 and rt.config.nonfinite != "off" and \
                    has_nonfinite([p.grad for p in opt._params if p.grad is not None]):
                self._nonfinite([(b, NonFiniteGradientError("rank 0: a non-finite gradient (NaN or Inf) on rank 0"))
                                 for b in opt._buckets])
            return
        session = opt._session
        if session is not None:
            session.enter()
        self._before_launch()
        opt._launch_remaining()
        refused = []
        masked = []   # momentum correction: parameters that went the sparse way (masking applies to them)
        waited = time.perf_counter()
        for bucket in opt._buckets:
            if bucket.handle is not None:
                t0 = time.perf_counter()
                try:
                    synchronize(bucket.handle)
                except NonFiniteGradientError as e:
                    refused.append((bucket, e))
                else:
                    for p, (c, ctx) in zip(bucket.dense, bucket.compressed):
                        out = c if ctx is None else bucket.decompress(c, ctx)
                        if out is not p.grad:
                            p.grad.copy_(out)
                        if opt._mc is not None and p in opt._mc_groups:
                            masked.append(p)
                if session is not None:
                    session.idle(time.perf_counter() - t0)
            if bucket.small is not None:
                handle, small_params, small_tensors = bucket.small
                bucket.small = None
                try:
                    synchronize(handle)
                except NonFiniteGradientError as e:
                    refused.append((bucket, e))
                else:
                    for p, t in zip(small_params, small_tensors):
                        if t is not p.grad:
                            p.grad.copy_(t)
                bucket.dense = bucket.dense + small_params
            for p, wait in bucket.sparse:
                p.grad = wait()
            for p in bucket.dense:
                if p in self._densified:
                    p.grad = p.grad.to_sparse()
            bucket.handle = None
            bucket.compressed = None
            bucket.sparse = []
        self.busy_s += time.perf_counter() - waited
        self._densified.clear()
        if self.corrected:
            # the step is agreed (or refused) as a whole: every velocity of it is kept or rolled back
            masked = set(masked)
            for p in opt._mc_groups:
                if refused:
                    opt._mc.refused(opt._names[p])
                else:
                    opt._mc.applied(opt._names[p], p.grad if p in masked else None)
            if refused:
                self.corrected = False
        opt._start_step()
        opt._step_count += 1
        if refused:
            self._nonfinite(refused)   # before the step's counters close: a skip is counted in it
        rt.wan_stats.end_step()

    def _nonfinite(self, refused):
        """A gradient held NaN/Inf on some rank; every rank decides the same. ``skip`` (default):
        the step is skipped (the refused buckets moved nothing, so no residual saw the values), and
        their gradients are set to NaN on every rank, as an allreduce would have made them, so that
        a GradScaler or a clipping step decides alike everywhere. ``raise``: the error is raised
        (the optimizer stays usable)."""
        opt = self.opt
        rt = state.current()
        mine = [opt._names[p] for bucket, _ in refused for p in bucket.params
                if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
        first = refused[0][1]
        if rt.config.nonfinite == "raise":
            opt._synchronized = False
            raise first
        for bucket, _ in refused:
            for p in bucket.params:
                if p.grad is not None:
                    p.grad.fill_(float("nan"))
        self.skip = True
        rt.wan_stats.add(skipped_nonfinite=1)
        log.warning("stella_mpi: step %d skipped on %s: %s%s", opt._step_count - 1, self._where(),
                    str(first).split(": ", 1)[-1], "; on this rank: %s" % ", ".join(mine) if mine else "")

    def _where(self):
        """Which ranks take the same decision: the route's set (local steps: one cluster)."""
        if self.kind == "cluster":
            topo = self.opt._spec.process_set.topology
            return ("every rank of cluster %d (local steps: the other clusters' steps go on, and the period's "
                    "count does not change)" % topo.cluster_id)
        if self.kind == "rank":
            return ("rank %d alone (local steps with inner=\"rank\": the other ranks' steps go on, and the period's "
                    "count does not change)" % state.current().rank)
        if self.process_set.ranks is not None and self.process_set.size() < state.current().size:
            return "every rank of process set %s" % self.process_set.ranks
        return "every rank"

    def update(self, closure=None):
        """The user's optimizer on the reduced gradients (nothing on a skipped step; with
        momentum correction, SGD applies the carried velocities as they are)."""
        opt = self.opt
        skip, self.skip = self.skip, False
        corrected, self.corrected = self.corrected, False
        if corrected:
            groups = [g for g in opt.param_groups if any(g is h for h in opt._mc_groups.values())]

            def user_step(c):
                return plain_sgd_step(opt._user_step, groups, c)
        else:
            user_step = opt._user_step
        t0 = time.perf_counter()
        loss = None if skip else user_step(closure)
        if opt._session is not None:
            opt._session.optimizer_time(time.perf_counter() - t0)
        return loss

    def reset(self):
        """After a checkpoint is loaded: what is in flight completes, nothing is carried over."""
        self.skip = self.corrected = False
        for b in self.opt._buckets:
            if b.handle is not None:
                synchronize(b.handle)
            b.handle, b.compressed = None, None


class DenseRoute(SyncRoute):
    """Horovod's route: every gradient allreduced (a dense compressor: none, fp16, bf16), any
    op. ``kind="cluster"``: on this rank's cluster only (the gradient route of local steps)."""

    def __init__(self, opt, process_set, compression=Compression.none, op=Average, predivide=1.0, kind="dense",
                 local_clip=None):
        super().__init__(opt, process_set, op, predivide, local_clip)
        self.compression = compression
        self.kind = kind
        if kind == "cluster" and process_set.included() and ClusterChannel.usable(process_set):
            self.channel = ClusterChannel.shared(process_set).lane(
                [(opt._names[p], p) for p in opt._params], [b.params for b in opt._sync_buckets])

    def _reduce(self, bucket, grads, name):
        self._dense(bucket, grads, name, self.compression)


class RankRoute(SyncRoute):
    """The gradient route of ``LocalSteps(inner="rank")``: nothing is reduced at the inner step.
    Each rank steps on its own gradients, as a replica of its own between two exchanges (the
    exchange then averages over every rank). A NaN or Inf is refused as on a set of this rank
    alone (:func:`reduce_alone`); a torch sparse gradient is left as it is (the identity)."""
    kind = "rank"

    def launch(self, bucket):
        bucket.sparse = []   # (a parameter without a gradient keeps none: no other rank's is averaged in)
        bucket.dense = [p for p in bucket.params if p.grad is not None and not p.grad.is_sparse]
        if not bucket.dense:
            return
        grads = [p.grad for p in bucket.dense]
        bucket.compressed = [(g, None) for g in grads]
        bucket.decompress = None
        bucket.handle = reduce_alone(grads, bucket.name("DistributedOptimizer.bucket", self.opt._names), 1.0, 1.0)


class SparseRoute(SyncRoute):
    """The cross-cluster hop through a sparse compressor with error feedback (residuals in the
    optimizer's ``_memory``). ``compression`` is the compressor of the next step (the adjuster
    changes its density between steps: :meth:`set_compression`); ``warmup``: DGC's density
    warm-up, steps; ``dense_below`` and ``local_clip``: deprecated options."""
    kind = "sparse"

    def __init__(self, opt, process_set, compression, op=Average, predivide=1.0, warmup=0, dense_below=0,
                 local_clip=None):
        super().__init__(opt, process_set, op, predivide, local_clip)
        self.warmup = int(warmup or 0)
        self.warmup_cap = 1.0   # under the adjuster: the densest rung its step-time budget allows
        self.dense_below = int(dense_below or 0)
        self.compression = self._budgeted(compression) if self.dense_below else compression

    def describe(self):
        c = self.compression
        if getattr(c, "homomorphic", False):
            return "thc %d bits" % c.bits
        if c.density >= 1.0:
            return "dense (density 1, %s)" % c.name
        return "%s %g %%" % (c.name, 100 * c.density)

    def set_compression(self, compression):
        self.compression = compression

    # ---- deprecated: dense_below

    def _budgeted(self, comp):
        """``dense_below=N``: tensors of fewer than N elements are reduced densely; the large ones
        get the density that keeps the step's bytes what ``comp`` alone would send. Raises when
        the small ones alone would exceed the budget."""
        params = [p for p in self.opt._params if p.dtype == torch.float32]
        total = sum(p.numel() for p in params)
        small = sum(p.numel() for p in params if p.numel() < self.dense_below)
        if not small or small == total:
            return comp
        per_entry = getattr(comp, "entry_bytes", None) or ENTRY_BYTES.get(comp.name, 6.0)
        budget = comp.density * total * per_entry
        density = (budget - 4.0 * small) / ((total - small) * per_entry)
        if density <= 0:
            raise ValueError("dense_below=%d: the %d elements of the small tensors cost more than the byte budget "
                             "of density %g; lower dense_below" % (self.dense_below, small, comp.density))
        log.info("dense_below=%d: %d elements go dense, the other %d at density %.5f (was %g)", self.dense_below,
                 small, total - small, density, comp.density)
        return comp.with_density(min(1.0, density))

    # ---- the step's compressor

    def step_compression(self):
        """The compressor of this step (:func:`density_warmup`); the adjuster's session is told
        the density actually sent."""
        comp = density_warmup(self.compression, self.opt._step_count, self.warmup, self.warmup_cap)
        if self.opt._session is not None and comp is not self.compression:
            self.opt._session.note_density(self.opt._step_count, comp.density)
        return comp

    def _reduce(self, bucket, grads, name):
        opt = self.opt
        if grads[0].dtype != torch.float32:   # integer and 16-bit gradients take the dense way
            self._dense(bucket, grads, name)
            return
        prescale, postscale = self._scales()
        if opt._mc is not None:
            for p, g in zip(bucket.dense, grads):
                group = opt._mc_groups.get(p)
                if group is not None:
                    opt._mc.transform(opt._names[p], p, g, group)   # the route carries velocities
                    self.corrected = True
        if self.dense_below:
            # small tensors go dense (dense_below): one grouped allreduce beside the sparse route
            small = [(p, g) for p, g in zip(bucket.dense, grads) if p.numel() < self.dense_below]
            if small:
                keep = [(p, g) for p, g in zip(bucket.dense, grads) if p.numel() >= self.dense_below]
                bucket.dense, grads = [p for p, _ in keep], [g for _, g in keep]
                tensors = [g.contiguous() for _, g in small]
                bucket.small = (allreduce_tensors_async(tensors, inplace_outputs, name + ".dense", self.op, prescale,
                                                        postscale, self.process_set, "grouped_allreduce",
                                                        gradients=True), [p for p, _ in small], tensors)
                if not grads:
                    return
        tensors = [g.contiguous() for g in grads]
        bucket.compressed = [(t, None) for t in tensors]
        bucket.handle = compressed_allreduce_async(tensors, self.step_compression(), name, self.op, prescale, postscale,
                                                   self.process_set, memory=opt._memory, step=opt._step_count,
                                                   inplace=True)


class THCRoute(SparseRoute):
    """The cross-cluster hop through THC (``Compression.thc``): every entry, quantized with
    agreed scales, summed on the wire; its rounding error fed back (residuals in ``_memory``)."""
    kind = "thc"
