"""The synchronous DistributedOptimizer (Horovod's semantics): gradients averaged over all
ranks, in fused buckets reduced in the background while backward goes on, then the user's own
optimizer steps. A sparse compressor takes the cross-cluster hop of each bucket."""
import logging
import time
import warnings
from contextlib import contextmanager

import torch

from ..adjust.session import AdjustedOptimizer, adjust_session
from ..api.allreduce import allreduce_tensors_async, compressed_allreduce_async, inplace_outputs
from ..api.handles import synchronize
from ..api.sparse_tensors import sparse_allreduce_async
from ..api.reduce_ops import Average, Max, Min, Product, Sum, op_name
from ..base.errors import NonFiniteGradientError
from ..compression import Compression, Memory
from ..core import state
from ..core.nonfinite import has_nonfinite
from .buckets import Bucket, BucketedOptimizer, parameter_names, plan_by_groups, plan_by_size
from .momentum_correction import MomentumCorrectionState, plain_sgd_step

log = logging.getLogger("stella_mpi")


class _SyncBucket(Bucket):
    def __init__(self, index, params):
        super().__init__(index, params)
        self.handle = None       # the bucket's collective in flight
        self.compressed = None   # [(tensor reduced, compression context)] per parameter of ``dense``
        self.dense = params      # the parameters whose gradients go through ``handle``
        self.sparse = []         # [(parameter, wait)]: sparse gradients, gathered as Horovod does
        self.small = None        # (handle, parameters): small tensors reduced densely beside a sparse route


class _DistributedOptimizer(BucketedOptimizer, AdjustedOptimizer):
    """Methods of the optimizer DistributedOptimizer returns (mixed in before the user's class)."""

    def __init__(self, params, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, groups, sparse_as_dense, process_set, adjuster=None,
                 momentum_correction=False, density_warmup=0, dense_below=0, local_clip=None):
        super().__init__(params)
        self._compression = compression
        self._sparse = bool(getattr(compression, "sparse", False))
        self._memory = Memory()   # error-feedback residuals of the sparse route, per bucket shard
        self._step_count = 0
        if self._sparse and op not in (Average, Sum):
            raise ValueError("DistributedOptimizer: a sparse compressor sums gradients; op must be Average or Sum")
        if op not in (Average, Sum, Min, Max, Product):
            op_name(op, torch.float32)  # raises the right error (Adasum, unknown)
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        self._op = op
        self._predivide = float(gradient_predivide_factor)
        self._process_set = process_set
        self._sparse_as_dense = sparse_as_dense
        self._densified = set()   # parameters whose sparse gradient was made dense for this step
        self.backward_passes_per_step = backward_passes_per_step

        self._names = parameter_names(self.param_groups, named_parameters)
        self._parameter_names = self._names   # Horovod's attribute: {parameter: name}
        self._params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        if groups is None or groups == 0:
            cap = state.current().config.fusion_threshold
            planned = [b for _, b in plan_by_size([list(reversed(self._params))], cap)]
        else:
            planned = plan_by_groups(self._params, groups)
        self._passes = {p: backward_passes_per_step for p in self._params}
        self._skip_step = False   # the reduced gradients of this step held NaN/Inf somewhere: no update
        self._synchronized = False
        self._should_synchronize = True
        self._warmup = int(density_warmup or 0)
        if self._warmup < 0 or (self._warmup and not self._sparse):
            raise ValueError("density_warmup is a number of steps >= 0 for a sparse compression")
        if (self._warmup or dense_below) and adjuster is not None:
            raise ValueError("density_warmup and dense_below set the density, as the adjuster does: use one")
        self._dense_below = int(dense_below or 0)
        if self._dense_below < 0 or (self._dense_below and not self._sparse):
            raise ValueError("dense_below is a number of elements >= 0 for a sparse compression")
        if self._dense_below:
            compression = self._compression = self._budgeted(self._compression)
        self._local_clip = None
        if local_clip is not None:
            if isinstance(local_clip, bool) or not isinstance(local_clip, (int, float)) or not local_clip > 0:
                raise ValueError("local_clip is the global max norm (a number > 0), got %r" % (local_clip,))
            self._local_clip = float(local_clip)
        self._mc, self._mc_groups, self._mc_this_step = None, {}, False
        if momentum_correction:
            self._mc = MomentumCorrectionState(masking=momentum_correction == "masking")
            self._setup_momentum_correction()
        # (the checks above come before any hook is put on the model's parameters)
        hooked = self._params if process_set.included() and state.current().size > 1 else []
        self._use_buckets([_SyncBucket(i, b) for i, b in enumerate(planned)], hooked)
        self._adjust = adjust_session(adjuster, compression, process_set, overlap=False,
                                      passes=backward_passes_per_step)
        if self._adjust is not None:
            self._compression = self._adjust.compression

    def _setup_momentum_correction(self):
        what = "DistributedOptimizer(momentum_correction=...)"
        if not issubclass(self._stella_base_class, torch.optim.SGD):
            raise ValueError("%s corrects SGD's momentum; the optimizer is %s" % (what, self._stella_base_class.__name__))
        if not self._sparse:
            raise ValueError("%s needs a sparse compression (the dense route sends every velocity anyway)" % what)
        if self._op not in (Average, Sum) or self.backward_passes_per_step != 1:
            raise ValueError("%s: op must be Average or Sum, with backward_passes_per_step=1" % what)
        for group in self.param_groups:
            if MomentumCorrectionState.check_group(group, what):
                for p in group["params"]:
                    if p.requires_grad and p.dtype != torch.float32:
                        raise ValueError("%s: parameter %r is %s; the sparse route (and so the correction) takes "
                                         "float32" % (what, self._names.get(p, "?"), p.dtype))
                    self._mc_groups[p] = group

    # bytes per sent entry on the wire, by compressor (values 4 B plus index bytes; cache-aware sends
    # one 2-4 byte block id per 16 values; random-k sends no indices); a dense entry costs 4 B
    ENTRY_BYTES = {"cacheaware": 4.25, "topk": 6.0, "threshold": 6.0, "randomk": 4.0}

    def _budgeted(self, comp):
        """``dense_below=N``: tensors of fewer than N elements are reduced densely (they cost
        little on the wire and lose most to sparsification); the large ones get the density that
        keeps the step's bytes what ``comp`` alone would send. Raises when the small ones alone
        would exceed the budget."""
        params = [p for p in self._params if p.dtype == torch.float32]
        total = sum(p.numel() for p in params)
        small = sum(p.numel() for p in params if p.numel() < self._dense_below)
        if not small or small == total:
            return comp
        per_entry = self.ENTRY_BYTES.get(comp.name, 6.0)
        budget = comp.density * total * per_entry
        density = (budget - 4.0 * small) / ((total - small) * per_entry)
        if density <= 0:
            raise ValueError("dense_below=%d: the %d elements of the small tensors cost more than the byte budget "
                             "of density %g; lower dense_below" % (self._dense_below, small, comp.density))
        log.info("dense_below=%d: %d elements go dense, the other %d at density %.5f (was %g)", self._dense_below,
                 small, total - small, density, comp.density)
        return comp.with_density(min(1.0, density))

    WARMUP_START = 0.25   # the density the warm-up starts from (DGC starts at 25 %)

    def _warmed(self, comp):
        """The compressor of this step: during ``density_warmup`` steps the density falls
        geometrically from 25 % to the compressor's own (DGC's exponential warm-up)."""
        t = self._step_count
        if t >= self._warmup or comp.density >= self.WARMUP_START:
            return comp
        frac = t / self._warmup
        return comp.with_density(self.WARMUP_START ** (1 - frac) * comp.density ** frac)

    def state_dict(self):
        out = super().state_dict()
        if self._mc is not None:
            out["stella_momentum_correction"] = self._mc.state_dict()
        return out

    def _grad_final(self, p):
        if self._local_clip is None:
            return super()._grad_final(p)
        self._bucket_of[p].pending.discard(p)   # all buckets go at synchronize(), once the norm is known

    def _clip_locally(self):
        """DGC's local gradient clipping: this rank's gradient is scaled to a norm of at most
        ``local_clip / sqrt(size)`` before it enters the reduction (and so the residual). A
        non-finite norm is left alone: the non-finite check refuses the step."""
        grads = [p.grad for p in self._params if p.grad is not None]
        if not grads:
            return
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.detach().to_dense()
                                                                              if g.is_sparse else g.detach())
                                                     for g in grads]))
        limit = self._local_clip / self._process_set.size() ** 0.5
        if bool(torch.isfinite(norm)) and float(norm) > limit:
            coef = limit / (float(norm) + 1e-6)
            for g in grads:
                g.mul_(coef)

    def _on_grad_ready(self, p):
        if self._passes[p] <= 0:
            raise AssertionError("Gradients were computed more than backward_passes_per_step times before call "
                                 "to step(). Increase backward_passes_per_step to accumulate gradients locally.")
        self._passes[p] -= 1
        if self._passes[p] > 0:
            return
        self._grad_final(p)

    def _grad_of(self, p):
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        elif p.grad.is_sparse:   # sparse_as_dense: reduced dense, handed back sparse (SparseAdam needs that)
            p.grad = p.grad.to_dense()
            self._densified.add(p)
        return p.grad

    def _launch(self, bucket):
        bucket.sparse, bucket.dense = [], []
        for p in bucket.params:
            if p.grad is not None and p.grad.is_sparse and not self._sparse_as_dense:
                if p in self._mc_groups:
                    raise ValueError("DistributedOptimizer(momentum_correction=...): parameter %r has a sparse "
                                     "gradient, whose momentum the correction cannot carry; pass "
                                     "sparse_as_dense=True" % self._names[p])
                if self._op not in (Average, Sum):
                    raise ValueError("DistributedOptimizer: parameter %r has a sparse gradient, which is gathered "
                                     "and summed; op must be Average or Sum (or pass sparse_as_dense=True)"
                                     % self._names[p])
                bucket.sparse.append((p, sparse_allreduce_async(p.grad, "DistributedOptimizer.sparse." + self._names[p],
                                                                self._op, self._process_set)))
            else:
                bucket.dense.append(p)
        if not bucket.dense:
            return
        grads = [self._grad_of(p) for p in bucket.dense]
        name = bucket.name("DistributedOptimizer.bucket", self._names)
        if self._op == Average:
            prescale, postscale = 1.0 / self._predivide, self._predivide
        else:
            prescale, postscale = 1.0, 1.0
        sparse_route = self._sparse and grads[0].dtype == torch.float32
        if sparse_route and self._mc is not None and self._process_set.included() and state.current().size > 1:
            for p, g in zip(bucket.dense, grads):
                group = self._mc_groups.get(p)
                if group is not None:
                    self._mc.transform(self._names[p], p, g, group)   # the route carries velocities
                    self._mc_this_step = True
        if sparse_route and self._dense_below:
            # small tensors go dense (dense_below): one grouped allreduce beside the sparse route
            small = [(p, g) for p, g in zip(bucket.dense, grads) if p.numel() < self._dense_below]
            if small:
                keep = [(p, g) for p, g in zip(bucket.dense, grads) if p.numel() >= self._dense_below]
                bucket.dense, grads = [p for p, _ in keep], [g for _, g in keep]
                tensors = [g.contiguous() for _, g in small]
                bucket.small = (allreduce_tensors_async(tensors, inplace_outputs, name + ".dense", self._op, prescale,
                                                        postscale, self._process_set, "grouped_allreduce",
                                                        gradients=True), [p for p, _ in small], tensors)
                if not grads:
                    return
        if sparse_route:
            tensors = [g.contiguous() for g in grads]
            bucket.compressed = [(t, None) for t in tensors]
            bucket.handle = compressed_allreduce_async(
                tensors, self._warmed(self._compression), name, self._op, prescale, postscale, self._process_set,
                memory=self._memory, step=self._step_count, inplace=True)
            return
        compression = self._compression if not self._sparse else Compression.none
        pairs = [compression.compress(g) for g in grads]
        tensors = [c.contiguous() for c, _ in pairs]
        bucket.compressed = list(zip(tensors, [ctx for _, ctx in pairs]))
        bucket.handle = allreduce_tensors_async(tensors, inplace_outputs, name, self._op, prescale, postscale,
                                                self._process_set, "grouped_allreduce", gradients=True)

    # ---------------- Horovod's optimizer API ----------------

    def synchronize(self):
        """Finish the reduction of every gradient (launching any bucket whose hooks did not fire)."""
        self._skip_step = False
        rt = state.current()
        if not self._process_set.included() or rt.size == 1:
            self._synchronized = True
            if rt.size == 1 and rt.config.nonfinite != "off" and \
                    has_nonfinite([p.grad for p in self._params if p.grad is not None]):
                self._nonfinite([(b, NonFiniteGradientError("rank 0: a non-finite gradient (NaN or Inf) on rank 0"))
                                 for b in self._buckets])
            return
        if self._adjust is not None:
            self._adjust.enter()
        if self._local_clip is not None:
            self._clip_locally()
        self._launch_remaining()
        refused = []
        masked = []   # momentum correction: parameters that went the sparse way (masking applies to them)
        for bucket in self._buckets:
            if bucket.handle is not None:
                t0 = time.perf_counter()
                try:
                    synchronize(bucket.handle)
                except NonFiniteGradientError as e:
                    refused.append((bucket, e))
                else:
                    for p, (c, ctx) in zip(bucket.dense, bucket.compressed):
                        out = c if ctx is None else self._compression.decompress(c, ctx)
                        if out is not p.grad:
                            p.grad.copy_(out)
                        if self._mc is not None and p in self._mc_groups:
                            masked.append(p)
                if self._adjust is not None:
                    self._adjust.idle(time.perf_counter() - t0)
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
        self._densified.clear()
        if self._mc_this_step:
            # the step is agreed (or refused) as a whole: every velocity of it is kept or rolled back
            masked = set(masked)
            for p in self._mc_groups:
                if refused:
                    self._mc.refused(self._names[p])
                    self._mc_this_step = False
                else:
                    self._mc.applied(self._names[p], p.grad if p in masked else None)
        self._start_step()
        for p in self._params:
            self._passes[p] = self.backward_passes_per_step
        self._step_count += 1
        if refused:
            self._nonfinite(refused)   # before the step's counters close: a skip is counted in it
        rt.wan_stats.end_step()
        self._synchronized = True

    def _nonfinite(self, refused):
        """A gradient held NaN/Inf on some rank; every rank decides the same. ``skip`` (default):
        the step is skipped (the refused buckets moved nothing, so no residual saw the values), and
        their gradients are set to NaN on every rank, as an allreduce would have made them, so that
        a GradScaler or a clipping step decides alike everywhere. ``raise``: the error is raised
        (the optimizer stays usable)."""
        rt = state.current()
        mine = [self._names[p] for bucket, _ in refused for p in bucket.params
                if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
        first = refused[0][1]
        if rt.config.nonfinite == "raise":
            self._synchronized = False
            raise first
        for bucket, _ in refused:
            for p in bucket.params:
                if p.grad is not None:
                    p.grad.fill_(float("nan"))
        self._skip_step = True
        rt.wan_stats.add(skipped_nonfinite=1)
        log.warning("stella_mpi: step %d skipped on every rank: %s%s", self._step_count - 1,
                    str(first).split(": ", 1)[-1], "; on this rank: %s" % ", ".join(mine) if mine else "")

    @contextmanager
    def skip_synchronize(self):
        """Inside this block ``step()`` does not synchronize (call ``synchronize()`` yourself)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                              "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in "
                              "your code.")
            self.synchronize()
        self._synchronized = False
        skip, self._skip_step = self._skip_step, False
        corrected, self._mc_this_step = self._mc_this_step, False
        # momentum correction: the route carried velocities, so SGD applies them as they are
        corrected_groups = [g for g in self.param_groups if any(g is h for h in self._mc_groups.values())]
        user_step = (lambda c: plain_sgd_step(super(_DistributedOptimizer, self).step, corrected_groups, c)) \
            if corrected else super().step
        if self._adjust is None:
            return None if skip else user_step(closure)
        t0 = time.perf_counter()
        loss = None if skip else user_step(closure)
        self._adjust.optimizer_time(time.perf_counter() - t0)
        decision = self._adjust.end_step(self._step_count, self.backward_passes_per_step)
        if decision is not None:
            self._compression = self._adjust.compression
            if decision.passes != self.backward_passes_per_step:
                self.set_backward_passes_per_step(decision.passes)
        return loss

    def zero_grad(self, set_to_none=True):
        if any(b.handle is not None for b in self._buckets):
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(). This is prohibited as it can cause "
                                 "a race condition.")
        return super().zero_grad(set_to_none)

    def set_backward_passes_per_step(self, passes):
        self.backward_passes_per_step = passes
        for p in self._params:
            self._passes[p] = passes

    def load_state_dict(self, state_dict):
        """Load a checkpoint; the error-feedback residuals start over (they were left by steps
        after the checkpoint, for parameters it no longer holds)."""
        self._skip_step = False
        if "stella_momentum_correction" in state_dict:
            state_dict = dict(state_dict)
            mc = state_dict.pop("stella_momentum_correction")
            if self._mc is not None:
                self._mc.load_state_dict(mc)
        for b in self._buckets:
            if b.handle is not None:
                synchronize(b.handle)
            b.handle, b.compressed = None, None
        self._memory.reset()
        self._start_step()
        self._synchronized = False
        for p in self._params:
            self._passes[p] = self.backward_passes_per_step
        return super().load_state_dict(state_dict)
