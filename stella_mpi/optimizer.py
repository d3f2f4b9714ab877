"""DistributedOptimizer: Horovod's wrapper, with gradients fused into buckets.

Gradients are handed over by a post-accumulate hook on each parameter as soon
as backward produces them. Parameters are cut into buckets (reverse
registration order, which is roughly the order backward produces them; at
most ``STELLA_FUSION_THRESHOLD`` bytes each, one dtype per bucket, or the
user's ``groups``). A full bucket is reduced by one fused grouped allreduce
in the background while backward goes on. Buckets are launched strictly in
bucket order, so every rank submits the same collectives in the same order
whatever order its hooks fire in.
"""
import time
import warnings
from contextlib import contextmanager

import torch

from . import api, runtime
from .api import Average, Sum, grouped_allreduce_async_, synchronize
from .compression.base import Compression
from .compression.memory import Memory
from .runtime import global_process_set


def launch_in_order(opt, force=False):
    """Launch ``opt``'s buckets strictly in bucket order, each once all its gradients are ready
    (all of them with ``force``), so that every rank submits the same collectives in the same
    order whatever order its hooks fire in. ``opt`` has _buckets, _next_launch and _launch."""
    while opt._next_launch < len(opt._buckets):
        bucket = opt._buckets[opt._next_launch]
        if bucket.pending and not force:
            return
        opt._launch(bucket)
        opt._next_launch += 1


def _split_list(items, n):
    d, r = divmod(len(items), n)
    out, start = [], 0
    for i in range(n):
        size = d + (1 if i < r else 0)
        out.append(items[start:start + size])
        start += size
    return [g for g in out if g]


class _Bucket:
    __slots__ = ("index", "params", "pending", "handle", "compressed")

    def __init__(self, index, params):
        self.index = index
        self.params = params
        self.pending = set(params)
        self.handle = None
        self.compressed = None


class _DistributedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, groups, sparse_as_dense, process_set, adjuster=None):
        super(self.__class__, self).__init__(params)
        self._compression = compression
        self._sparse = bool(getattr(compression, "sparse", False))
        self._memory = Memory()   # error-feedback residuals of the sparse route, per bucket shard
        self._step_count = 0
        if self._sparse and op not in (Average, Sum):
            raise ValueError("DistributedOptimizer: a sparse compressor sums gradients; op must be Average or Sum")
        if op not in (Average, Sum, api.Min, api.Max, api.Product):
            api._op_name(op, torch.float32)  # raises the right error (Adasum, unknown)
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        self._op = op
        self._predivide = float(gradient_predivide_factor)
        self._process_set = process_set
        self._sparse_as_dense = sparse_as_dense
        self.backward_passes_per_step = backward_passes_per_step

        all_params = [p for g in self.param_groups for p in g["params"]]
        if named_parameters is not None:
            named_parameters = list(named_parameters)
        else:
            named_parameters = [("allreduce.noname.%d.%d" % (i, j), p)
                                for i, g in enumerate(self.param_groups) for j, p in enumerate(g["params"])]
        if any(not isinstance(p, tuple) for p in named_parameters):
            raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                             "usually produced by model.named_parameters().")
        names = [n for n, _ in named_parameters]
        dups = sorted({n for n in names if names.count(n) > 1})
        if dups:
            raise ValueError("Parameter names in named_parameters must be unique. Found duplicates: %s"
                             % ", ".join(dups))
        named_ids = {id(p) for _, p in named_parameters}
        unnamed = [id(p) for p in all_params if id(p) not in named_ids]
        if unnamed:
            raise ValueError("named_parameters was specified, but one or more model parameters were not named. "
                             "Python object ids: %s" % ", ".join(str(i) for i in unnamed))
        self._names = {p: n for n, p in named_parameters}
        self._params = [p for p in all_params if p.requires_grad]
        self._buckets, self._bucket_of = self._make_buckets(groups)
        self._next_launch = 0
        self._passes = {p: backward_passes_per_step for p in self._params}
        self._synchronized = False
        self._should_synchronize = True
        self._hooks = []
        if process_set.included() and runtime.size() > 1:
            for p in self._params:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))
        from .telemetry import adjust_session
        self._adjust = adjust_session(adjuster, compression, process_set, overlap=False,
                                      passes=backward_passes_per_step)
        if self._adjust is not None:
            self._compression = self._adjust.compression

    # ---------------- buckets ----------------

    def _make_buckets(self, groups):
        params = self._params
        if groups is None or groups == 0:
            cap = runtime.current().config.fusion_threshold
            ordered = list(reversed(params))
            buckets, cur, cur_bytes = [], [], 0
            for p in ordered:
                nbytes = p.numel() * p.element_size()
                if cur and (cur_bytes + nbytes > cap or p.dtype != cur[0].dtype or p.device != cur[0].device):
                    buckets.append(cur)
                    cur, cur_bytes = [], 0
                cur.append(p)
                cur_bytes += nbytes
            if cur:
                buckets.append(cur)
        elif isinstance(groups, int):
            if groups < 0:
                raise ValueError("groups should be a non-negative integer or a list of list of torch.Tensor.")
            buckets = _split_list(list(reversed(params)), groups)
        else:
            seen, buckets = set(), []
            for g in groups:
                if any(not isinstance(p, torch.Tensor) for p in g):
                    raise ValueError("groups must consist of torch.Tensor.")
                if any(id(p) in seen for p in g):
                    raise ValueError("A parameter can only appear once in groups.")
                seen.update(id(p) for p in g)
                buckets.append([p for p in g if p.requires_grad])
            buckets += [[p] for p in reversed(params) if id(p) not in seen]
            buckets = [b for b in buckets if b]
        # a bucket holds one dtype and one device (it is reduced as one buffer)
        split = []
        for b in buckets:
            by_kind = {}
            for p in b:
                by_kind.setdefault((p.dtype, p.device), []).append(p)
            split.extend(by_kind.values())
        objs = [_Bucket(i, b) for i, b in enumerate(split)]
        return objs, {p: bk for bk in objs for p in bk.params}

    def _on_grad_ready(self, p):
        if self._passes[p] <= 0:
            raise AssertionError("Gradients were computed more than backward_passes_per_step times before call "
                                 "to step(). Increase backward_passes_per_step to accumulate gradients locally.")
        self._passes[p] -= 1
        if self._passes[p] > 0:
            return
        self._bucket_of[p].pending.discard(p)
        launch_in_order(self)

    def _grad_of(self, p):
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        elif p.grad.is_sparse:
            if not self._sparse_as_dense:
                raise ValueError("parameter %r has a sparse gradient; pass sparse_as_dense=True to "
                                 "DistributedOptimizer" % self._names.get(p))
            p.grad = p.grad.to_dense()
        return p.grad

    def _launch(self, bucket):
        grads = [self._grad_of(p) for p in bucket.params]
        name = "DistributedOptimizer.bucket.%d.%s" % (bucket.index, self._names[bucket.params[0]])
        if self._op == Average:
            prescale, postscale = 1.0 / self._predivide, self._predivide
        else:
            prescale, postscale = 1.0, 1.0
        if self._sparse and grads[0].dtype == torch.float32:
            tensors = [g.contiguous() for g in grads]
            bucket.compressed = [(t, None) for t in tensors]
            bucket.handle = api.sparse_allreduce_async(
                tensors, self._compression, name, self._op, prescale, postscale, self._process_set,
                memory=self._memory, step=self._step_count, inplace=True)
            return
        compression = self._compression if not self._sparse else Compression.none
        pairs = [compression.compress(g) for g in grads]
        tensors = [c.contiguous() for c, _ in pairs]
        bucket.compressed = list(zip(tensors, [ctx for _, ctx in pairs]))
        bucket.handle = grouped_allreduce_async_(
            tensors, name=name, op=self._op, prescale_factor=prescale, postscale_factor=postscale,
            process_set=self._process_set)

    # ---------------- Horovod's optimizer API ----------------

    def synchronize(self):
        """Finish the reduction of every gradient (launching any bucket whose hooks did not fire)."""
        if not self._process_set.included() or runtime.size() == 1:
            self._synchronized = True
            return
        if self._adjust is not None:
            self._adjust.enter()
        for bucket in self._buckets:
            bucket.pending.clear()
        launch_in_order(self, force=True)
        for bucket in self._buckets:
            if bucket.handle is not None:
                t0 = time.perf_counter()
                synchronize(bucket.handle)
                if self._adjust is not None:
                    self._adjust.idle(time.perf_counter() - t0)
                for p, (c, ctx) in zip(bucket.params, bucket.compressed):
                    out = c if ctx is None else self._compression.decompress(c, ctx)
                    if out is not p.grad:
                        p.grad.copy_(out)
            bucket.handle = None
            bucket.compressed = None
            bucket.pending = set(bucket.params)
        self._next_launch = 0
        for p in self._params:
            self._passes[p] = self.backward_passes_per_step
        self._step_count += 1
        runtime.current().wan_stats.end_step()
        self._synchronized = True

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
        if self._adjust is None:
            return super(self.__class__, self).step(closure)
        t0 = time.perf_counter()
        loss = super(self.__class__, self).step(closure)
        self._adjust.optimizer_time(time.perf_counter() - t0)
        decision = self._adjust.end_step(self._step_count, self.backward_passes_per_step)
        if decision is not None:
            self._compression = self._adjust.compression
            if decision.passes != self.backward_passes_per_step:
                self.set_backward_passes_per_step(decision.passes)
        return loss

    def local_batch_size(self):
        """Samples per backward pass for this rank: the adjuster's batch split
        (``hvd.Adjuster(batch_split=True, global_batch=N)``), or None without one."""
        return self._adjust.batch if self._adjust is not None else None

    @property
    def adjust_decisions(self):
        """[(step, Decision)] taken by the adjuster so far (the same list on every rank)."""
        return list(self._adjust.decisions) if self._adjust is not None else []

    def zero_grad(self, set_to_none=True):
        if any(b.handle is not None for b in self._buckets):
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(). This is prohibited as it can cause "
                                 "a race condition.")
        return super(self.__class__, self).zero_grad(set_to_none)

    def set_backward_passes_per_step(self, passes):
        self.backward_passes_per_step = passes
        for p in self._params:
            self._passes[p] = passes

    def load_state_dict(self, state_dict):
        for b in self._buckets:
            if b.handle is not None:
                synchronize(b.handle)
            b.handle, b.compressed, b.pending = None, None, set(b.params)
        self._next_launch = 0
        self._synchronized = False
        for p in self._params:
            self._passes[p] = self.backward_passes_per_step
        return super(self.__class__, self).load_state_dict(state_dict)


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none, backward_passes_per_step=1,
                         op=Average, gradient_predivide_factor=1.0, num_groups=0, groups=None,
                         sparse_as_dense=False, process_set=global_process_set, engine=None, staleness=0,
                         cpu_semantics="exact", model=None, adjuster=None, staleness_warmup=0,
                         stale_prediction=None):
    """Wrap a torch optimizer so that ``step()`` uses gradients averaged over all ranks
    (Horovod's signature and behaviour). The returned object is an instance of a subclass of
    ``type(optimizer)`` built from its param groups (its state starts empty).

    ``engine="cpu"`` (stella_mpi's CPU engine, see cpu_engine.py) applies SGD/Adam/AdamW in C on
    a pinned worker pool to a float32 master copy of each rank's shard, with ``staleness`` 0
    (synchronous) or 1 (the update of step t runs while step t+1 computes; pass ``model=`` so
    that each layer waits only for its own update), ``cpu_semantics`` "exact" or "lazy".
    With staleness 1, ``stale_prediction`` (default: on with exact semantics) gives the forward the
    master weights one zero-gradient step ahead, and ``staleness_warmup=K`` runs the first K steps
    synchronously (see cpu_engine.py).

    ``adjuster=hvd.Adjuster(min_density=..., max_density=...)`` (with a sparse ``compression``)
    re-tunes the density of the cross-cluster exchange from the measured bandwidth, on every
    rank at the same step (stella_mpi/adjuster.py). With ``allow_accumulation=True`` it may
    raise ``backward_passes_per_step`` when even ``min_density`` cannot be hidden: run
    ``opt.backward_passes_per_step`` backward passes before each ``step()``. Learning rate:
    gradients of the passes are summed (Horovod's semantics), so with an unscaled loss SGD
    already follows the linear scaling rule (lr x passes on the mean gradient of the larger
    batch); if your loss is divided by the number of passes, multiply lr by it yourself.
    With ``batch_split=True`` read ``opt.local_batch_size()`` each step and weight this rank's
    loss by ``local_batch_size * size() / global_batch`` so the average stays a sample mean."""
    runtime.current("hvd.DistributedOptimizer")
    from .adjuster import Adjuster
    if adjuster is not None and not isinstance(adjuster, Adjuster):
        raise ValueError("adjuster must be an hvd.Adjuster(...), not %r" % type(adjuster).__name__)
    if adjuster is not None and not getattr(compression, "sparse", False):
        raise ValueError("adjuster= tunes the density of a sparse compressor; pass compression="
                         "hvd.Compression.cacheaware(density=...) (or topk, threshold, randomk)")
    if engine not in (None, "cpu"):
        raise ValueError("engine must be None or 'cpu', not %r" % (engine,))
    if engine == "cpu":
        if op != Average or backward_passes_per_step != 1 or gradient_predivide_factor != 1.0:
            raise ValueError("engine='cpu' averages one backward pass per step: op=Average, "
                             "backward_passes_per_step=1, gradient_predivide_factor=1.0")
        if adjuster is not None and adjuster.allow_accumulation:
            raise ValueError("engine='cpu' runs one backward pass per step: use an Adjuster with "
                             "allow_accumulation=False")
        from .cpu_engine import make_cpu_engine_optimizer
        return make_cpu_engine_optimizer(optimizer, named_parameters, compression, staleness, cpu_semantics,
                                         process_set, model, adjuster, staleness_warmup, stale_prediction)
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed.", DeprecationWarning)
        if groups is None:
            groups = num_groups
    if op == api.Adasum:
        raise NotImplementedError("stella_mpi does not implement Adasum yet; use op=hvd.Average")
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedOptimizer.__dict__))
    cls._stella_base_class = optimizer.__class__
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, groups, sparse_as_dense, process_set, adjuster)
