"""``hvd.DistributedOptimizer``: the single subclass of the user's optimizer that Horovod's
drop-in promises, composed of strategies.

The function checks what the user asked (:mod:`.spec`: one frozen spec, one table of refusals),
then builds ``type(optimizer)``'s subclass with :class:`_DistributedOptimizer` mixed in before
it, so ``isinstance``, ``param_groups`` and ``state_dict`` keep working. Inside, three objects do
the work:

* the gradient route (:mod:`.routes`): how a step's gradients cross between ranks and become an
  update: dense, sparse, THC, the cluster's own (local steps), Adasum, or the CPU engine;
* the outer synchronization (:mod:`.outer_sync`): none, or local steps with a torch optimizer
  as the outer step;
* the adjuster's glue (:mod:`.tuning`): its session decides density, THC bits and H, and, on
  the automatic route or with ``hvd.Adjuster(modes=("sync", "local"))``, moves between the
  synchronous route and local steps by replacing the route and the outer synchronization
  (:class:`.tuning.ModeSwitch`).

A switch replaces objects; nothing rewrites another class's fields. What survives a switch is
the optimizer's own: the parameter names, the bucket hooks, the error-feedback residuals
(``_memory``), momentum correction's velocities (``_mc``) and the step count.
"""
import logging
import warnings
from contextlib import contextmanager

from ..api.functions import broadcast_object
from ..api.queries import rank
from ..api.reduce_ops import Average
from ..base.errors import NonFiniteGradientError
from ..compression import Compression, Memory
from ..core import state
from ..core.process_sets import global_process_set
from .buckets import BucketedOptimizer, parameter_names, plan_by_groups, plan_gradient_buckets
from .momentum_correction import MomentumCorrectionState
from .routes.sync import SyncBucket
from .spec import build_spec, refuse
from .tuning import compose

log = logging.getLogger("stella_mpi")


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none, backward_passes_per_step=1,
                         op=Average, gradient_predivide_factor=1.0, num_groups=0, groups=None,
                         sparse_as_dense=False, process_set=global_process_set, engine=None, local_steps=None,
                         adjuster=None, **deprecated):
    """Wrap a torch optimizer so that ``step()`` uses gradients averaged over all ranks
    (Horovod's signature and behaviour). The returned object is an instance of a subclass of
    ``type(optimizer)`` built from its param groups (its state starts empty).

    Horovod's arguments mean what they mean there. stella_mpi adds three, each an object that
    holds its own settings:

    ``engine=hvd.CpuEngine(staleness=1, model=model)``: the CPU engine (SGD/Adam/AdamW in C on a
    pinned worker pool, a float32 master copy of each rank's shard; optim/routes/cpu_engine.py).

    ``local_steps=hvd.LocalSteps(every=H, outer="average" | "nesterov" | a torch optimizer)``:
    gradients averaged inside each cluster at every step, the pseudo-gradient exchanged across
    clusters every H steps and applied by the outer optimizer (optim/outer_sync.py); with
    ``fragments=F, delay=tau`` Streaming DiLoCo's: the model in F fragments exchanged in turn, each
    in flight for tau inner steps; with ``inner="rank"`` nothing is reduced at an inner step (each
    rank a replica) and the exchange averages every rank's pseudo-gradient.

    ``adjuster=hvd.Adjuster(...)``: the bandwidth-driven adjuster's settings (adjust/settings.py).

    The cross-cluster route:

    * a stella compressor (``hvd.Compression.cacheaware(density=0.01)``, ``topk``, ``threshold``,
      ``randomk``, ``thc(bits=4)``) means exactly what it says; momentum correction (SGD with
      momentum) and the density warm-up are the sparse compressor's options, on by default;
    * with none of them (Horovod's ``Compression.none``, ``fp16`` or ``bf16``) and two or more
      clusters the route is automatic: the adjuster chooses dense, a sparse density, THC bits or
      local steps with a compressed pseudo-gradient, on every rank at the same step, by the
      time-to-loss objective (optim/tuning.py). ``STELLA_WAN_ROUTE=dense`` (``stellarun
      --wan-route dense``) gives Horovod's exact dense numerics instead. With one cluster
      nothing changes.

    ``opt.route`` says what crosses now, ``opt.mode`` ("sync" or "local"), ``opt.route_changes``
    lists every change with its step and reason (the same on every rank).

    The keyword arguments of the previous release (``staleness``, ``cpu_semantics``,
    ``staleness_warmup``, ``stale_prediction``, ``model``, ``momentum_correction``,
    ``density_warmup``, ``dense_below``, ``local_clip``, ``engine="cpu"``) still work, with a
    ``DeprecationWarning`` that names their new place."""
    state.current("hvd.DistributedOptimizer")
    spec = build_spec(optimizer, compression, backward_passes_per_step, op, gradient_predivide_factor, num_groups,
                      groups, sparse_as_dense, process_set, engine, local_steps, adjuster, deprecated)
    refuse(spec, optimizer)
    cls = type(optimizer.__class__.__name__, (_DistributedOptimizer, optimizer.__class__), {})
    cls._stella_base_class = optimizer.__class__
    return cls(optimizer.param_groups, spec, named_parameters)


class _DistributedOptimizer(BucketedOptimizer):
    """The methods of the optimizer DistributedOptimizer returns (mixed in before the user's
    class): Horovod's optimizer API over the current gradient route and outer synchronization."""

    def __init__(self, params, spec, named_parameters):
        super().__init__(params)
        self._spec = spec
        self._names = parameter_names(self.param_groups, named_parameters)
        self._parameter_names = self._names   # Horovod's attribute: {parameter: name}
        self._params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        self.backward_passes_per_step = spec.passes
        self._passes = {p: spec.passes for p in self._params}
        self._memory = Memory()     # error-feedback residuals, per bucket shard, kept across routes
        self._step_count = 0
        self._synchronized = False
        self._should_synchronize = True
        self._session = None        # the adjuster's session while a synchronous route it tunes runs
        self._tuner = None          # the adjuster's glue (optim/tuning.py), or None
        self.route_changes = []     # [(step, route, reason)]: the same on every rank
        self._mc, self._mc_groups = None, {}
        if spec.wants_momentum_correction(self.param_groups):
            self._mc = MomentumCorrectionState(masking=spec.momentum_correction == "masking")
        # (the spec was checked before any hook is put on the model's parameters)
        self._sync_buckets = self._plan()
        compose(self)

    def _plan(self):
        """The synchronous routes' buckets: by size over the parameters in reverse order, or the
        user's ``groups``."""
        groups = self._spec.groups
        if groups is None or groups == 0:
            cap = state.current().config.fusion_threshold
            planned = plan_gradient_buckets(self._params, cap)
        else:
            planned = plan_by_groups(self._params, groups)
        return [SyncBucket(i, b) for i, b in enumerate(planned)]

    def _install(self, route, outer):
        """Make ``route`` and ``outer`` the ones of the next step (at a step boundary)."""
        self._route, self._outer = route, outer
        self._use_buckets(getattr(route, "buckets", None) or self._sync_buckets)
        self._start_step()
        self._hook_parameters(route.hooked_params())

    def _on_grad_ready(self, p):
        self._synchronized = False   # a new backward: the next synchronize() closes a new step
        self._route.grad_ready(p)

    def _user_step(self, closure=None):
        """The user's optimizer's own step."""
        return super(_DistributedOptimizer, self).step(closure)

    def _start_step(self):
        super()._start_step()
        for p in self._params:
            self._passes[p] = self.backward_passes_per_step
        if self._mc is not None and self._spec.engine is None:
            # {parameter: its group} where momentum correction applies, from the groups as they are now
            # (a load_state_dict replaces the group dicts; a scheduler may change momentum)
            self._mc_groups = {p: g for g in self.param_groups if MomentumCorrectionState.check_group(g)
                               for p in g["params"] if p.requires_grad}

    # ---------------- what runs

    @property
    def route(self):
        """What crosses between clusters now, in words ("cacheaware 1 %", "thc 4 bits", "local
        steps H=8, thc 4 bits", "dense", ...)."""
        return self._tuner.describe() if self._tuner is not None else self._route.describe()

    @property
    def mode(self):
        """"sync" (a synchronous route) or "local" (local steps): the route of the next step."""
        return "local" if self._outer.kind == "local" else "sync"

    @property
    def mode_switches(self):
        """[(step, mode, reason)]: the moves between "sync" and "local" (the same on every rank)."""
        return self._tuner.switches if self._tuner is not None else []

    @property
    def mode_reason(self):
        return self._tuner.reason if self._tuner is not None else None

    @property
    def adjust_decisions(self):
        """[(step, Decision)] taken by the adjuster so far (the same list on every rank)."""
        session = self._tuner.session if self._tuner is not None else self._session
        return list(session.decisions) if session is not None else []

    @property
    def local_steps_every(self):
        """H now: local steps between two exchanges across clusters (None outside local steps,
        also while the automatic route is on its synchronous route)."""
        return self._outer.every if self._outer.kind == "local" else None

    @property
    def local_steps_exchanges(self):
        """Exchanges across clusters that local steps have landed so far (None outside local
        steps). After the same exchange every rank holds the same count, whatever steps each
        took: with ``LocalSteps(pace="time")`` clusters take different numbers of steps, so a
        collective across clusters in the training loop (a logged loss, an evaluation) must be
        issued where this count has just changed, or ranks wait on different collectives."""
        return self._outer.progress.exchanges if self._outer.kind == "local" else None

    @property
    def local_steps_reason(self):
        local = self._tuner.local if self._tuner is not None else self._outer
        return getattr(local, "reason", None)

    @property
    def outer_optimizer(self):
        """The outer torch optimizer of local steps (give it an LR scheduler), or None. With
        ``LocalSteps(fragments=F)``, F > 1, each fragment has its own: ``outer_optimizers``."""
        outers = self.outer_optimizers
        if outers is not None and len(outers) > 1:
            raise ValueError("LocalSteps(fragments=%d) has one outer optimizer per fragment: use opt.outer_optimizers "
                             "(a list, fragment 0 first)" % len(outers))
        return outers[0] if outers else None

    @property
    def outer_optimizers(self):
        """[the outer torch optimizer of each fragment] of local steps, or None."""
        local = self._tuner.local if self._tuner is not None else self._outer
        return list(local.outers) if getattr(local, "kind", None) == "local" else None

    @property
    def _stella_sharded_state(self):
        """The CPU engine's whole state is its own, sharded over the ranks: state_dict() is
        collective, and broadcast_optimizer_state and elastic sync send all of it."""
        return getattr(self._route, "sharded_state", False)

    def local_batch_size(self):
        """Samples per backward pass for this rank: the adjuster's batch split
        (``hvd.Adjuster(batch_split=True, global_batch=N)``), or None without one."""
        return self._session.batch if self._session is not None else None

    def exclude_time(self, seconds):
        """Leave ``seconds`` the training loop spent outside training (an evaluation, a
        checkpoint) out of the adjuster's timing of the next step and of local steps' period."""
        if self._session is not None:
            self._session.exclude(seconds)
        if hasattr(self._outer, "exclude_time"):
            self._outer.exclude_time(seconds)

    def sync_clusters(self):
        """Make every rank hold the same parameters now (local steps: complete the exchange in
        flight and run one more; otherwise nothing to do). Collective."""
        self._outer.sync_clusters()

    def consensus_parameters(self):
        """{name: tensor}: the parameters the clusters last agreed on (the same on every rank),
        for evaluating one model without an exchange: local steps' anchor, else the parameters."""
        if self._outer.kind == "local":
            return self._outer.consensus_parameters()
        return {self._names[p]: p.detach().clone() for p in self._params}

    # ---------------- the CPU engine's own calls

    def _engine(self, what):
        if self._route.kind != "cpu":
            raise AttributeError("%s is the CPU engine's (engine=hvd.CpuEngine(...)); this optimizer's route is %s"
                                 % (what, self._route.kind))
        return self._route

    def attach(self, model):
        """CPU engine: apply updates in forward pre-hooks of ``model``'s modules."""
        return self._engine("attach()").attach(model)

    def drain(self):
        """CPU engine: wait for every update and put the master weights into the model (collective
        with stale prediction)."""
        return self._engine("drain()").drain()

    def wait_updates(self):
        """CPU engine: wait for every launched update and put it in the parameters. Call it before
        reading the parameters outside a forward (an EMA, ``model.state_dict()``, tied weights)."""
        return self._engine("wait_updates()").wait_updates()

    def engine_times(self):
        return self._engine("engine_times()").engine_times()

    # ---------------- Horovod's optimizer API

    def synchronize(self):
        """Finish the reduction of every gradient (launching any bucket whose hooks did not fire).

        This closes the step for local steps' period count, whether or not ``step()`` follows (a
        GradScaler that found an Inf skips it); a second call before ``step()`` closes nothing."""
        outer, again = self._outer, self._synchronized
        if not again:
            outer.before_synchronize()
        try:
            self._route.synchronize()
        except NonFiniteGradientError:   # STELLA_NONFINITE=raise: the step is refused, and still counted
            if not again:
                self._close_step(outer, skipped=True)
            raise
        self._synchronized = True
        if not again:
            self._close_step(outer, skipped=self._route.skip)

    def _close_step(self, outer, skipped):
        """The step counted in the local steps' period. Where it ran the period's exchange (a
        skipped last step), the tuner's decisions after an exchange (each rank a replica) are
        taken now: the ranks that step take them after their update, and a rank whose step()
        never comes (a GradScaler that found an Inf) would take them a step later. (A last step
        the route did not refuse but whose step() never came, under STELLA_NONFINITE=off, runs
        its exchange at the next synchronize(), and those decisions still come a step later
        there: too late to change the route of that step's reductions, already launched. With
        each cluster a replica its ranks skip alike, so they move together.)"""
        if outer.step_closed(skipped) and self._tuner is not None:
            self._tuner.after_step(None)

    def skip_synchronize(self):
        """Inside this block ``step()`` does not synchronize (call ``synchronize()`` yourself).
        Refused at once where the route cannot honour it (the CPU engine, Adasum)."""
        refusal = getattr(self._route, "skip_synchronize_refusal", None)
        if refusal is not None:
            raise refusal()
        return self._skipping_synchronize()

    @contextmanager
    def _skipping_synchronize(self):
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        route, outer = self._route, self._outer
        outer.before_step()
        if getattr(route, "needs_synchronize", True) and self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                              "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in "
                              "your code.")
            self.synchronize()
        self._synchronized = False
        loss = route.update(closure)
        measured = outer.after_step()
        if self._tuner is not None:
            self._tuner.after_step(measured)
        return loss

    def zero_grad(self, set_to_none=True):
        if any(getattr(b, "handle", None) is not None for b in self._buckets):
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(). This is prohibited as it can cause "
                                 "a race condition.")
        return super().zero_grad(set_to_none)

    def set_backward_passes_per_step(self, passes):
        self.backward_passes_per_step = passes
        for p in self._params:
            self._passes[p] = passes

    # ---------------- checkpoints

    def state_dict(self):
        """The user's optimizer's state, plus stella's own beside it: momentum correction's
        velocities, local steps' anchor and outer optimizer, the mode. The CPU engine's is all its
        own (collective: call it on every rank)."""
        if self._stella_sharded_state:
            return self._route.state_dict()
        out = super().state_dict()
        if self._mc is not None:
            out["stella_momentum_correction"] = self._mc.state_dict()
        if self._tuner is not None:
            self._tuner.save(out)
        elif self._outer.kind == "local":
            out["stella_local_steps"] = self._outer.state_dict()
        return out

    def load_state_dict(self, state_dict):
        """Load a checkpoint (of this release's layout or the one before). Everything stella
        holds is checked first, naming what does not fit, so a refused checkpoint leaves this
        optimizer as it was; the error-feedback residuals start over (they were left by steps
        after the checkpoint)."""
        if self._stella_sharded_state:
            self._route.load_state_dict(state_dict)   # (its velocities are per bucket: its own)
            return
        state_dict = dict(state_dict)
        mc = state_dict.pop("stella_momentum_correction", None)
        if mc is not None and self._mc is not None:
            self._mc.check(mc, {self._names[p]: p for p in self._params})
        restore = self._tuner.restore(state_dict) if self._tuner is not None else \
            self._restore_local_steps(state_dict)
        self._route.reset()
        self._memory.reset()
        self._synchronized = False
        super().load_state_dict(state_dict)
        self._start_step()
        restore()
        if mc is not None and self._mc is not None:
            self._mc.load_state_dict(mc)

    def _restore_local_steps(self, state_dict):
        """Check the checkpoint's local-steps state now; returns what loads it afterwards."""
        saved = state_dict.pop("stella_local_steps", None)
        outer = self._outer
        if outer.kind != "local":
            return lambda: None
        if saved is not None:
            outer.check(saved)

        def restore():
            outer.drop_in_flight()   # its period's progress goes into the next exchange
            if saved is not None:
                outer.load_state_dict(saved, keep_every=outer.rule is None)
            else:   # a checkpoint without local steps: a new period starts from the loaded parameters
                outer.restart(outer.settings.every)
                outer.anchor = {}
                outer.in_sync = False
        return restore

    def _stella_sync_state(self, root_rank):
        """broadcast_optimizer_state: ``root_rank``'s stella state on every rank (the local-steps
        counters decide when the clusters meet, and the mode which route runs, so they must
        agree; the CPU engine's whole state)."""
        if self._stella_sharded_state:
            self._route.sync_state(root_rank)
            return
        if self._tuner is not None:
            self._tuner.sync_state(root_rank)
        elif self._outer.kind == "local":
            outer = self._outer
            outer.drop_in_flight()
            mine = outer.state_dict_on_host() if rank() == root_rank else None
            outer.load_state_dict(broadcast_object(mine, root_rank, name="local_steps.state"),
                                  keep_every=outer.rule is None)

