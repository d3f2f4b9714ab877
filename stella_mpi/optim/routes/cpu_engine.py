"""The CPU engine: ``DistributedOptimizer(opt, ..., engine="cpu", staleness=1)``.

The user's SGD/Adam/AdamW is replaced by the C sparse optimizer (:mod:`.sparse_optim`)
running on a pool of worker threads pinned to their own cores (:mod:`stella_mpi._native.pool`).
Each rank keeps a float32 master copy of its shard of every bucket. For one bucket and step t,
on the collective thread, while the training thread goes on::

    gradient (copied at hook time) -> reduce-scatter inside the cluster -> this rank's shard
    -> [more than one cluster] sparse selection with error feedback, WAN exchange, merge
    -> sparse optimizer step on the master shard (worker pool)
    -> all-gather of the updated shards inside the cluster -> staging buffer of step t

The training thread copies a staged update into the model's parameters itself, in a
forward pre-hook of the module that owns them, so a forward never sees a half-applied
update.

CUDA models (StellaTrain's pipeline): with several clusters and a sparse compressor the gradient
of a bucket stays on the GPU, where the collective thread reduce-scatters it inside the cluster
and selects from it with error feedback (on the device's side stream), so only the selection
crosses PCIe; otherwise (one cluster, the dense rung) it goes device-to-host into a pinned buffer
on that stream as soon as its hook fires (the collective thread waits for that copy, not for
backward). The master, the optimizer and the exchange stay on the CPU. An update goes back
host-to-device on a copy stream of its own, queued in ``step()`` when it is already done (else in
the pre-hook), and each module's forward pre-hook makes the compute stream wait only for its own
buckets' copies. A pinned staging slot is written again only after its copy has run.

Staleness s: the forward after t steps needs the updates of steps 0..t-1-s. With
s = 1 the update of step t runs while step t+1 computes; with s = 0 ``step()`` waits.
Exactly the required update is applied (not a newer one that happens to be ready), so
every rank computes with the same parameters.

Stale prediction (``stale_prediction``, default with exact semantics): for staleness 1 the staged
weights are not the master but the master one zero-gradient step ahead
(``SparseOptimizer.lookahead``: momentum and weight decay of the next update are known before its
gradient), so the forward of step t misses only gradient t-1, not the whole update t-1. A
one-step-stale update without it costs ~10 % validation loss on the byte-LM of
tests/test_convergence.py; with it ~4 %. ``staleness_warmup=K`` runs the first K steps
synchronously. ``drain()`` puts the exact master weights into the model (a collective when the
model holds predicted weights).
"""
import logging
import time

import torch

from ..._native.pool import CpuPool
from ...api.allgather import allgather
from ...api.functions import broadcast_object
from ...api.handles import synchronize
from ...api.handles import poll
from ...api.queries import rank
from ...base import timeline
from ...base.devices import DeviceRoute, one_device, route_for
from ...base.errors import HorovodInternalError, NonFiniteGradientError
from ...comm.buffers import split_counts
from ...comm.sparse_exchange import dense_rung, residual_key, sparse_reduce
from ...core import state
from ...core.collective_thread import Op
from ...core.executors.dense import on_device
from ..buckets import Bucket, plan_by_size
from .sync import density_warmup
from ..sparse_optim import SparseAdam, SparseAdamW, SparseSGD

log = logging.getLogger("stella_mpi")

SUPPORTED = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
# seconds, summed over buckets: collective thread (reduce-scatter + WAN exchange + merge; optimizer
# step and prediction; intra-cluster all-gather) and training thread (blocked waiting for an update;
# copying staged updates into the parameters)
TIMES = ("exchange_s", "optimizer_s", "allgather_s", "wait_s", "copy_s")


def _hparams_of(rule, group, momentum_corrected):
    """The C optimizer's hyper-parameters for ``group`` now (at its construction, and at every
    step, so that a scheduler of lr, momentum, betas or weight decay is followed). With momentum
    correction the route applies momentum and weight decay, so the C optimizer runs without."""
    if momentum_corrected:
        group = dict(group, momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0)
    if rule is torch.optim.SGD:
        return dict(lr=float(group["lr"]), momentum=group["momentum"], dampening=group["dampening"],
                    weight_decay=group["weight_decay"], nesterov=group["nesterov"],
                    maximize=group.get("maximize", False))
    return dict(lr=float(group["lr"]), betas=tuple(group["betas"]), eps=group["eps"],
                weight_decay=group["weight_decay"], amsgrad=group["amsgrad"], maximize=group.get("maximize", False))


def _sparse_optimizer_for(rule, group, master, mode, momentum_corrected=False):
    """The C optimizer doing what ``rule`` (SGD, Adam or AdamW) does with ``group``'s settings
    (torch's Adam with ``decoupled_weight_decay=True`` is AdamW)."""
    hp = _hparams_of(rule, group, momentum_corrected)
    if rule is torch.optim.SGD:
        return SparseSGD([master], mode=mode, **hp)
    decoupled = rule is torch.optim.AdamW or bool(group.get("decoupled_weight_decay", False))
    return (SparseAdamW if decoupled else SparseAdam)([master], mode=mode, **hp)


class _CpuBucket(Bucket):
    def __init__(self, index, params, group_index):
        super().__init__(index, params, group_index)
        self.shapes = [(tuple(p.shape), p.device, p.dtype) for p in params]
        self.mc_momentum = 0.0  # momentum correction: the group's momentum, applied by the route (0: off)
        self.previous = None    # momentum correction: the master before the last step (prediction)
        self.handles = {}       # step -> handle of that step's update
        self.applied = -1       # last step whose update is in the model's parameters
        self.predicted_in_model = False
        self.predicts = False   # stale prediction where it differs from the master (set at init)
        self.master = None      # this rank's shard, float32 (created at the first launch)
        self.sopt = None
        self.staged = [None, None]
        self.predicted = None   # this rank's shard of the predicted weights (stale_prediction)
        self.counts = None
        # CUDA models: pinned host copies of the gradient per step parity, and events of the
        # side stream: staged[slot] copied into the parameters (the slot may be written again)
        self.grad_host = [None, None]
        self.copied = [None, None]
        self.in_params = None   # event: the last update copied into the parameters
        self.times = dict.fromkeys(TIMES, 0.0)


def _copy_into_params(flat, params, non_blocking=False):
    """Copy the flat float32 ``flat`` into ``params`` (in order, each its numel)."""
    off = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            p.view(-1).copy_(flat[off:off + n], non_blocking=non_blocking)
            off += n


def _sparse_across(comp, nclusters):
    """Whether the update's cross-cluster step selects (several clusters, density below 1): then
    a CUDA model's gradient is selected on its GPU, else the whole shard goes to the host."""
    return nclusters > 1 and comp is not None and comp.density < 1.0


def execute_cpu_update(pset, desc, inputs, joined):
    """Collective thread: reduce-scatter, cross-cluster step (sparse or dense), optimizer step,
    all-gather (module docstring)."""
    grad = inputs[0]
    if grad.device.type == "cuda":   # to be selected on the GPU (_sparse_across)
        return on_device(pset, grad.device, lambda: _cpu_update(pset, desc, inputs))
    return _cpu_update(pset, desc, inputs)


def _cpu_update(pset, desc, inputs):
    grad, bucket, comp, memory, pool, hparams, catch_up, predict = inputs
    hier = pset.hierarchy
    step, size = desc["step"], pset.nranks
    counts = bucket.counts
    clock = time.perf_counter
    t0 = clock()
    shard, _ = hier.cluster_shard(grad, "sum", counts)
    if _sparse_across(comp, hier.topo.num_clusters):
        merged = sparse_reduce(hier, shard, comp, memory if comp.error_feedback else None, desc["name"], step,
                               desc["seed"], hier.comms.shard, "shard")
        idx, val = merged.indices, merged.values.mul_(1.0 / size)
    else:
        if hier.topo.num_clusters > 1 and comp is not None:   # density 1 (the adjuster's top rung): no indices
            dense_rung(hier, shard, comp, memory if comp.error_feedback else None,
                       residual_key(desc["name"], "shard", hier.topo), hier.comms.shard)
        elif hier.topo.num_clusters > 1:
            hier.cross_reduce(shard, "sum", hier.comms.shard)
        idx = torch.arange(shard.numel(), dtype=torch.int32)
        val = shard.mul(1.0 / size)
    t1 = clock()
    changed = {k: v for k, v in hparams.items() if bucket.sopt.hparams[k] != v}
    if changed:   # a scheduler moved them (the C optimizer takes them from this step on)
        bucket.sopt.set_hparams(**changed)
    bucket.sopt.step([(idx, val)] if idx.numel() else [None], pool=pool, catch_up=catch_up,
                     timeout_ms=int(1000 * pset.deadline.timeout_s))
    # what the model gets: the master, or (prediction) the master one zero-gradient step ahead; with
    # momentum correction the velocity is the ranks', so the last update is extrapolated instead:
    # master + momentum * (master - master before this step)
    staged = bucket.staged[step % 2]
    if bucket.copied[step % 2] is not None:
        bucket.copied[step % 2].synchronize()   # CUDA model: step-2's copy out of this slot has run
    # one rank per cluster: the prediction is written straight into the staging slot (the
    # all-gather below then copies nothing)
    predicted = staged if hier.topo.cluster_size == 1 else bucket.predicted
    if bucket.mc_momentum:
        if predict:
            torch.sub(bucket.master, bucket.previous, out=predicted)
            predicted.mul_(bucket.mc_momentum).add_(bucket.master)
        bucket.previous.copy_(bucket.master)
        src = predicted if predict else bucket.master
    else:
        src = bucket.sopt.lookahead([predicted], caught_up=True)[0] if predict else bucket.master
    t2 = clock()
    timeline.record("CPU_OPTIMIZER", t1, t2, step=step, entries=int(idx.numel()))
    hier.gather_shards(src, counts, staged)
    t3 = clock()
    hier.stats.add(engine_s=t3 - t0)
    times = bucket.times
    times["exchange_s"] += t1 - t0
    times["optimizer_s"] += t2 - t1
    times["allgather_s"] += t3 - t2
    return step


def execute_cpu_master(pset, desc, inputs, joined):
    """Collective thread: the cluster's master shards of one bucket, all-gathered into ``out``."""
    bucket, out = inputs
    pset.hierarchy.gather_shards(bucket.master, bucket.counts, out)
    return out


class CpuEngineRoute:
    """The CPU engine as the optimizer's gradient route: its own buckets (per param group), its
    own update (the C optimizer; the user's optimizer never steps), and its whole state sharded
    over the ranks (so ``state_dict()`` is collective, and broadcast_optimizer_state and elastic
    sync send all of it: ``sharded_state``)."""
    kind = "cpu"
    sharded_state = True

    def __init__(self, opt, process_set, compression, engine):
        self.opt = opt
        self._compression = compression if getattr(compression, "sparse", False) else None
        self.warmup_cap = 1.0   # under the adjuster: the densest rung its step-time budget allows
        self._staleness = engine.staleness
        self._warmup = engine.warmup_steps if engine.staleness == 1 else 0
        # DGC's density warm-up only where the engine has no synchronous first steps (warmup=0 or
        # staleness 0): they take its place (bench/bench_parity.py at staleness 1 over four seeds,
        # cache-aware 1 %: +2.2 % without it, +2.1 % with it, 43 % fewer WAN bytes; top-k 1 %:
        # +0.6 to +1.5 % without it, +4.1 % with it on seed 0)
        self._density_warmup = getattr(compression, "warmup", 0) \
            if self._compression is not None and self._warmup == 0 else 0
        self._predict = engine.predicts
        self._semantics = engine.semantics
        self._process_set = process_set
        self._steps = 0
        self._loaded = None   # the state last loaded, until the next step
        sequences = [list(reversed([q for q in g["params"] if q.requires_grad])) for g in opt.param_groups]
        flat_params = [p for seq in sequences for p in seq]
        for p in flat_params:
            if p.dtype != torch.float32 or p.device.type not in ("cpu", "cuda"):
                raise ValueError("engine='cpu' keeps float32 master weights on the CPU for float32 CPU or CUDA "
                                 "parameters; parameter %r is %s on %s" % (opt._names[p], p.dtype, p.device))
            if not p.is_contiguous():
                raise ValueError("engine='cpu' copies each update into the parameter's memory in order; parameter "
                                 "%r is not contiguous (channels_last?): make the model's parameters contiguous, or "
                                 "use engine=None" % opt._names[p])
        self._device = one_device(flat_params, "engine='cpu'", [opt._names[p] for p in flat_params]) \
            if flat_params else torch.device("cpu")
        self._cuda = route_for(self._device) if self._device.type == "cuda" else None
        # the updates' copies into the parameters get a stream of their own: on the collective
        # thread's side stream they would queue behind the next step's selection kernels
        self._copies = DeviceRoute(self._device) if self._cuda is not None else None
        rt = state.current()
        # the pool first: if its cores are refused, no hook is left on the model's parameters
        self._pool = CpuPool.for_rank(process_set.topology.local_rank, process_set.topology.local_size)
        log.debug("rank %d: CPU engine workers pinned to cores %s", rt.rank, list(self._pool.cores))
        planned = plan_by_size(sequences, rt.config.fusion_threshold)
        self.buckets = [_CpuBucket(i, ps, gi) for i, (gi, ps) in enumerate(planned)]
        self._module_hooks = []

    @property
    def process_set(self):
        return self._process_set

    @property
    def compression(self):
        return self._compression

    def set_compression(self, compression):
        self._compression = compression

    def describe(self):
        c = self._compression
        return "CPU engine, staleness %d%s" % (self._staleness, ", %s %g %%" % (c.name, 100 * c.density) if c else "")

    def launch_in_backward(self):
        return True

    # -------- model hooks

    def attach(self, model):
        """Apply updates in forward pre-hooks of ``model``'s modules (called by DistributedOptimizer
        when the model is known; otherwise updates are applied in step())."""
        for module in model.modules():
            own = [p for p in module.parameters(recurse=False) if p in self.opt._bucket_of]
            if own:
                buckets = sorted({self.opt._bucket_of[p].index for p in own})
                self._module_hooks.append(module.register_forward_pre_hook(
                    lambda mod, args, b=buckets: self._ensure_buckets(b)))
        return self

    def _staleness_at(self, step):
        """The staleness of the forward of ``step`` (0 during the synchronous warm-up)."""
        return 0 if step < self._warmup else self._staleness

    def _required(self):
        return self._steps - 1 - self._staleness_at(self._steps)

    def _ensure_buckets(self, indices):
        need = self._required()
        for i in indices:
            bucket = self.opt._buckets[i]
            self._apply_through(bucket, need)
            self._wait_copied(bucket)

    def _wait_copied(self, bucket):
        """CUDA model: the compute stream waits for this bucket's last copy into its parameters
        (only this one: the other layers' copies go on meanwhile)."""
        if bucket.in_params is not None:
            torch.cuda.current_stream(self._device).wait_event(bucket.in_params)
            bucket.in_params = None

    def _copy_update(self, bucket, slot):
        """Put staged update ``slot`` into the parameters: a plain copy on the CPU; for a CUDA
        model, host-to-device on the copy stream after what the compute stream has queued so far
        (the parameters' last readers), with events for the slot and for the forward."""
        if self._cuda is None:
            _copy_into_params(bucket.staged[slot], bucket.params)
            return
        route = self._copies
        route.after(torch.cuda.current_stream(self._device).record_event())
        with route.context():
            _copy_into_params(bucket.staged[slot], bucket.params, non_blocking=True)
        bucket.copied[slot] = bucket.in_params = route.record()

    def _apply_done(self, need):
        """CUDA model, in step(): queue the copies of the updates up to ``need`` that are done
        already, so they overlap the forward of the layers before theirs."""
        for bucket in self.opt._buckets:
            while bucket.applied < need and bucket.applied + 1 in bucket.handles \
                    and poll(bucket.handles[bucket.applied + 1]):
                self._apply_through(bucket, bucket.applied + 1)

    def _apply_through(self, bucket, step):
        """Copy the staged updates of ``bucket`` up to ``step`` into the parameters, in order."""
        while bucket.applied < step:
            s = bucket.applied + 1
            handle = bucket.handles.pop(s, None)
            if handle is None:
                raise HorovodInternalError("CPU engine: the update of step %d for bucket %d was never launched"
                                           % (s, bucket.index))
            t0 = time.perf_counter()
            try:
                synchronize(handle)
            except NonFiniteGradientError as e:
                bucket.applied = s   # nothing was updated or staged: the parameters stay as they are
                if bucket.mc_momentum:
                    self.opt._mc.refused(bucket.name("cpu_engine.bucket", self.opt._names), tag=s)
                self._nonfinite(bucket, s, e)
                continue
            if bucket.mc_momentum:
                self.opt._mc.applied(bucket.name("cpu_engine.bucket", self.opt._names), tag=s)
            t1 = time.perf_counter()
            if self.opt._session is not None:
                self.opt._session.idle(t1 - t0)
            self._copy_update(bucket, s % 2)
            bucket.applied = s
            bucket.times["wait_s"] += t1 - t0
            bucket.times["copy_s"] += time.perf_counter() - t1
            bucket.predicted_in_model = self._predicted_at(bucket, s)

    def _nonfinite(self, bucket, step, error):
        """The update of ``bucket`` at ``step`` was refused on every rank (a NaN/Inf gradient):
        it is skipped (the master, the optimizer state and the residual never saw the values),
        or with ``STELLA_NONFINITE=raise`` the error is raised."""
        if state.current().config.nonfinite == "raise":
            raise error
        state.current().wan_stats.add(skipped_nonfinite=1)
        log.warning("stella_mpi: the update of step %d skipped on every rank for %s: %s", step,
                    bucket.name("cpu_engine.bucket", self.opt._names), str(error).split(": ", 1)[-1])

    # -------- launching

    def _init_bucket(self, bucket):
        topo = self._process_set.topology
        bucket.counts = split_counts(bucket.numel, topo.cluster_size)
        start = sum(bucket.counts[:topo.cluster_rank])
        flat = torch.cat([p.detach().reshape(-1) for p in bucket.params]).cpu()
        bucket.master = flat[start:start + bucket.counts[topo.cluster_rank]].clone()
        group = self.opt.param_groups[bucket.group_index]
        bucket.mc_momentum = group["momentum"] if self.opt._mc is not None and group.get("momentum", 0.0) > 0 else 0.0
        if bucket.mc_momentum:
            bucket.previous = bucket.master.clone()
        bucket.sopt = _sparse_optimizer_for(self.opt._spec.base, group, bucket.master, self._semantics,
                                            bool(bucket.mc_momentum))
        pinned = self._cuda is not None
        bucket.staged = [torch.empty(bucket.numel, pin_memory=pinned), torch.empty(bucket.numel, pin_memory=pinned)]
        if pinned:
            bucket.grad_host = [torch.empty(bucket.numel, pin_memory=True), torch.empty(bucket.numel, pin_memory=True)]
        else:
            bucket.grad_cat = [torch.empty(bucket.numel), torch.empty(bucket.numel)]
            bucket.weights_cat = torch.empty(bucket.numel) if bucket.mc_momentum else None
        # with momentum correction the forward's prediction extrapolates the last update by the momentum
        bucket.predicts = self._predict and (bool(bucket.mc_momentum) or bucket.sopt.moves_without_gradient())
        if bucket.predicts and topo.cluster_size > 1:   # one rank per cluster: predicted into the staging slot
            bucket.predicted = torch.empty_like(bucket.master)

    def _predicted_at(self, bucket, step):
        """Whether the staged update of ``step`` holds predicted weights: where the forward of
        ``step + 1`` runs one step stale (the update is then first read at ``step + 2``)."""
        return bucket.predicts and self._staleness_at(step + 1) == 1

    def launch(self, bucket):
        step = self._steps
        for p, (shape, device, dtype) in zip(bucket.params, bucket.shapes):
            if tuple(p.shape) != shape or p.device != device or p.dtype != dtype:
                raise ValueError("parameter %r changed from %s %s on %s to %s %s on %s after DistributedOptimizer "
                                 "wrapped it" % (self.opt._names[p], dtype, list(shape), device, p.dtype,
                                                 list(p.shape), p.device))
        # the staging slot of step-2 is reused now: its update must be in the model already
        self._apply_through(bucket, step - 2)
        if bucket.master is None:
            self._init_bucket(bucket)
        grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1) for p in bucket.params]
        if self._cuda is None:
            # CPU model: fused into this step's slot (the update of step-2, which read it, is
            # applied), not a fresh buffer: new pages cost their faults on every step
            grad = torch.cat(grads, out=bucket.grad_cat[step % 2])
        else:
            grad = torch.cat(grads)
        if bucket.mc_momentum:
            weights = torch.cat([p.detach().reshape(-1) for p in bucket.params],
                                out=bucket.weights_cat if self._cuda is None else None)
            self.opt._mc.transform(bucket.name("cpu_engine.bucket", self.opt._names), weights, grad,
                               self.opt.param_groups[bucket.group_index], tag=step)
        ready = None
        comp = warmed = self._compression
        if comp is not None and self._density_warmup:   # DGC's warm-up, as on the synchronous sparse route
            warmed = density_warmup(comp, step, self._density_warmup, self.warmup_cap)
        if self._cuda is not None and _sparse_across(warmed, self._process_set.topology.num_clusters):
            # several clusters, sparse: the gradient stays on the GPU. The collective thread
            # reduce-scatters it inside the cluster and selects there (comm/sparse_exchange.py's
            # device route); only the selection crosses PCIe, not the whole gradient
            route = self._cuda
            ready = torch.cuda.current_stream(self._device).record_event()
            grad.record_stream(route.stream)
        elif self._cuda is not None:
            # device-to-host on the side stream, after the kernels that wrote the gradients; the
            # collective thread waits for this copy only (slot step%2 is free: step-2 is applied)
            route, host = self._cuda, bucket.grad_host[step % 2]
            route.after(torch.cuda.current_stream(self._device).record_event())
            with route.context():
                host.copy_(grad, non_blocking=True)
                grad.record_stream(route.stream)
            ready = route.record()
            grad = host
        rt = state.current()
        name = bucket.name("cpu_engine.bucket", self.opt._names)
        desc = {"kind": "cpu_update", "name": name, "dtype": "float32", "shapes": [list(s) for s, _, _ in bucket.shapes],
                "op": "average", "step": step, "seed": rt.config.seed, "staleness": self._staleness,
                "compressor": list(warmed.settings()) if warmed else ["none"]}
        hparams = _hparams_of(self.opt._spec.base, self.opt.param_groups[bucket.group_index], bool(bucket.mc_momentum))
        # the update of step t is first read by the forward of step t+1 (synchronous) or t+2 (stale):
        # predicted weights only for the stale case
        predict = self._predicted_at(bucket, step)
        desc["predict"] = predict
        if step > 0:   # the updates of one bucket run in step order (ops are matched by name)
            desc["after"] = name + ".step%d" % (step - 1)
        if warmed is not comp and self.opt._session is not None:
            self.opt._session.note_density(step, warmed.density)
        inputs = (grad, bucket, warmed, self.opt._memory, self._pool, hparams, self._semantics == "exact", predict)
        finite = [grad] if rt.config.nonfinite != "off" else None
        bucket.handles[step] = rt.collective_thread.submit(Op("cpu_update", name + ".step%d" % step, desc, inputs,
                                                              execute_cpu_update, self._process_set, finite, ready))

    def grad_ready(self, p):
        if p not in self.opt._bucket_of[p].pending:
            raise AssertionError("engine='cpu': the gradient of %r was computed twice before step(); the engine takes "
                                 "one backward pass per step and started that step's update at the first"
                                 % self.opt._names[p])
        self.opt._grad_final(p)

    # -------- Horovod's optimizer API

    def synchronize(self):
        """Launch every bucket of this step that backward did not (e.g. unused parameters)."""
        self.opt._launch_remaining()

    needs_synchronize = False   # update() launches what backward did not

    def hooked_params(self):
        return [p for b in self.buckets for p in b.params]

    def skip_synchronize_refusal(self):
        """Refused: the engine reads each gradient when backward produces it, so code between
        ``synchronize()`` and ``step()`` (a clip_grad_norm_) cannot change the update."""
        return ValueError("engine='cpu' takes each gradient when backward produces it, so changing gradients between "
                         "synchronize() and step() would not change the update; use engine=None for Horovod's "
                         "synchronize(); clip; with opt.skip_synchronize(): step() pattern")

    def update(self, closure=None):
        """The step: the remaining buckets launched, the updates the next forward needs applied
        (all of them at staleness 0 or without the model's hooks)."""
        loss = closure() if closure is not None else None
        if self.opt._session is not None:
            self.opt._session.enter()
        self.synchronize()
        self._steps += 1
        self.opt._step_count = self._steps
        self._loaded = None
        self.opt._start_step()
        need = self._required()
        if self._staleness_at(self._steps) == 0 or not self._module_hooks:
            for b in self.opt._buckets:
                self._apply_through(b, need)
                self._wait_copied(b)
        elif self._cuda is not None:
            self._apply_done(need)
        state.current().wan_stats.end_step()
        return loss

    def engine_times(self):
        """Seconds spent so far, summed over buckets (see TIMES): where the CPU engine's time goes.
        The collective-thread entries are updated by that thread; read them after drain()."""
        return {k: sum(b.times[k] for b in self.opt._buckets) for k in TIMES}

    def wait_updates(self):
        """Wait for every launched update and put it in the parameters (with stale prediction,
        the predicted weights: see drain)."""
        for b in self.opt._buckets:
            self._apply_through(b, max(b.handles) if b.handles else b.applied)
            self._wait_copied(b)

    def drain(self):
        """Wait for every launched update and put it in the parameters. With stale prediction
        the model holds predicted weights; drain then puts the master weights in instead, which
        is a collective (call it on every rank, like state_dict)."""
        self.wait_updates()
        thread = state.current().collective_thread
        for b in self.opt._buckets:
            if not b.predicted_in_model:
                continue
            slot = (b.applied + 1) % 2
            if b.copied[slot] is not None:
                b.copied[slot].synchronize()       # a CUDA model's copy out of it has run
            out = b.staged[slot]   # free: nothing is in flight now
            name = b.name("cpu_engine.bucket", self.opt._names)
            synchronize(thread.submit(Op("cpu_master", name + ".master",
                                         {"kind": "cpu_master", "name": name, "step": b.applied}, (b, out),
                                         execute_cpu_master, self._process_set)))
            _copy_into_params(out, b.params)
            b.predicted_in_model = False

    def sync_state(self, root_rank):
        """broadcast_optimizer_state: ``root_rank``'s whole engine state on every rank (collective).
        The state is sharded over the cluster's ranks, so after Horovod's "rank 0 loads a
        checkpoint" only rank 0's shard holds it: the checkpoint rank 0 loaded since its last
        step is what goes out, else the state gathered from the shards."""
        sd = broadcast_object(self._loaded if rank() == root_rank else None, root_rank, name="cpu_engine.loaded")
        if sd is None:
            sd = self.state_dict()
            sd = broadcast_object(sd if rank() == root_rank else None, root_rank, name="cpu_engine.state")
        self.load_state_dict(sd)

    def state_dict(self):
        """Collective (call it on every rank): the full master weights and optimizer state of every
        bucket, gathered from the cluster's shards, plus the step count."""
        self.drain()
        topo = self._process_set.topology
        out = {"engine": "cpu", "steps": self._steps, "semantics": self._semantics, "buckets": []}
        if self.opt._mc is not None:
            out["stella_momentum_correction"] = self.opt._mc.state_dict()   # this rank's velocities
        for b in self.opt._buckets:
            if b.master is None:
                out["buckets"].append(None)
                continue
            sd = b.sopt.state_dict()
            full = {}
            for key, t in [("master", b.master)] + [(k, v.reshape(-1)) for k, v in sd["state"][0].items()]:
                gathered = allgather(t.reshape(-1).contiguous(), name="cpu_engine.state.%d.%s" % (b.index, key),
                                         process_set=self._process_set)
                # pieces come in world-rank order; rank r holds shard cluster_rank(r) of its cluster
                shard_of = [topo.cluster_members[topo.cluster_of_rank[r]].index(r) for r in range(topo.size)]
                pieces = torch.split(gathered, [b.counts[shard_of[r]] for r in range(topo.size)])
                full[key] = torch.cat([pieces[r] for r in topo.cluster_members[0]])  # cluster 0, shard order
            out["buckets"].append({"full": full, "step": sd["step"], "hparams": sd["hparams"],
                                   "optimizer": sd["optimizer"], "mode": sd["mode"]})
        return out

    def load_state_dict(self, state):
        """Load a state_dict() of an engine with the same buckets (checked, every bucket before
        any is changed). A bucket saved before its first update starts afresh from the model's
        parameters at the next step."""
        if state.get("engine") != "cpu":
            raise ValueError("not a state_dict of a CPU-engine optimizer")
        if len(state["buckets"]) != len(self.opt._buckets):
            raise ValueError("engine='cpu': the checkpoint has %d buckets, this optimizer %d (another fusion "
                             "threshold or other trainable parameters)" % (len(state["buckets"]), len(self.opt._buckets)))
        for b, sb in zip(self.opt._buckets, state["buckets"]):
            if sb is not None and any(t.numel() != b.numel for t in sb["full"].values()):
                raise ValueError("engine='cpu': bucket %d of the checkpoint (parameters %s) holds %s entries, this "
                                 "optimizer's %d (another fusion threshold or other trainable parameters)"
                                 % (b.index, ", ".join(repr(self.opt._names[p]) for p in b.params),
                                    sorted({t.numel() for t in sb["full"].values()}), b.numel))
        self.drain()
        self.opt._memory.reset()   # (residuals of steps after the checkpoint, for parameters it no longer holds)
        self._loaded = state   # (what broadcast_optimizer_state sends until the next step)
        topo = self._process_set.topology
        for b, sb in zip(self.opt._buckets, state["buckets"]):
            if sb is None:   # saved before its first update: start it afresh, as then
                b.master = b.sopt = b.previous = b.predicted = None
                b.applied = state["steps"] - 1
                b.predicted_in_model = False
                continue
            if b.master is None:
                self._init_bucket(b)
            start = sum(b.counts[:topo.cluster_rank])
            mine = {k: v[start:start + b.counts[topo.cluster_rank]].clone() for k, v in sb["full"].items()}
            b.master.copy_(mine.pop("master"))
            b.sopt.load_state_dict({"optimizer": sb["optimizer"], "mode": sb["mode"], "step": sb["step"],
                                    "hparams": sb["hparams"], "state": [mine]})
            _copy_into_params(sb["full"]["master"], b.params)
            if b.previous is not None:
                b.previous.copy_(b.master)   # the prediction extrapolates from the loaded weights
            b.applied = state["steps"] - 1
            b.predicted_in_model = False
        self._steps = self.opt._step_count = state["steps"]
        if self.opt._mc is not None and "stella_momentum_correction" in state:
            self.opt._mc.load_state_dict(state["stella_momentum_correction"])
