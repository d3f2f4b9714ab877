"""The outer synchronization: what the clusters exchange besides the gradient route.

:class:`NoOuterSync` (every synchronous route): nothing. :class:`LocalStepsSync`
(``hvd.LocalSteps``): gradients are averaged inside each cluster at every step (the optimizer's
gradient route is then the cluster's), and the clusters meet only every ``every`` steps, as in
post-local SGD and Cloudless-Training (model averaging) or DiLoCo (an outer Nesterov optimizer).

Every H-th step, after the user's update::

    delta = anchor - params                    the pseudo-gradient (identical inside a cluster)
    avg   = allreduce(delta, Average, compression)  over all ranks (the mean over clusters,
                                                    weighted by cluster size)
    params = anchor;  params.grad = avg;  outer.step()     the outer optimizer, a torch optimizer
    anchor = params

The outer optimizer is a real ``torch.optim.Optimizer`` over the model's parameters (as in
torchft's DiLoCo), with its own ``state_dict`` and learning-rate schedulers
(``opt.outer_optimizer``). ``LocalSteps(outer=...)`` names a preset or gives one:

* ``"average"``: ``SGD(lr=1)``: ``params = anchor - avg``, model averaging;
* ``"nesterov"``: ``SGD(lr=outer_lr, momentum=outer_momentum, nesterov=True)``, DiLoCo's
  (m = mu m + avg; params = anchor - lr (avg + mu m));
* a callable ``params -> torch.optim.Optimizer``, or an optimizer already built over the
  model's parameters (every trainable one).

``anchor`` is taken at the first ``step()`` (after the user's ``broadcast_parameters``), so every
rank starts from the same parameters and, after each outer step, holds the same parameters
again (the all-reduce's result is the same everywhere). With ``every=1``, ``outer="average"`` and
no compression this is synchronous dense training for any optimizer whose update is linear in
the gradient and its own state (SGD with momentum and weight decay): the mean over clusters of
the clusters' velocities follows the same recursion as the velocity of the mean gradient.
Optimizers with a non-linear update (Adam) keep a per-cluster state and are not equivalent, as in
DiLoCo (there, the inner optimizer is AdamW by design).

``overlap=True`` hides the exchange behind the next period's local steps and applies it one
period late. At the end of period k each rank launches the exchange of its pseudo-gradient
``delta_k = anchor - params`` and trains on; at the end of period k+1 it waits for the mean
``avg_k``, and then, the same on every rank::

    anchor' = outer(anchor, avg_k)                (the outer step above)
    params  = anchor' + (params - (anchor - delta_k))   its cluster's progress since the launch kept
    anchor  = anchor'

and launches ``delta_{k+1} = anchor - params`` (that progress). Every rank computes the same
anchor; a rank's parameters are the anchor plus its own cluster's last period, so the clusters
never hold quite the same parameters: ``opt.sync_clusters()`` completes the exchange in flight
and runs one more, blocking, after which every rank holds the anchor (call it before evaluating
or saving a model that must be the same everywhere). A checkpoint leaves the exchange in flight
out: a rank that restores its own checkpoint puts that period's progress into the next exchange,
so nothing is lost; restoring rank 0's checkpoint everywhere (Horovod's pattern) replaces the
other clusters' last one to two periods by cluster 0's: call ``sync_clusters()`` before such a
checkpoint. The exchange runs on its own communicator (:class:`OuterChannel`, a duplicate of
the shard or leader communicator) with MPI's non-blocking allreduce, outside the collective
thread, so the next period's intra-cluster reductions do not queue behind it: each cluster's
ranks send one shard each (the pseudo-gradient is the same inside a cluster), weighted by
cluster size, and all-gather the mean inside the cluster. It takes compression none.

Streaming DiLoCo's fragments (``fragments=F``, ``delay=tau``, ``mix=a``; torchft's
StreamingDiLoCo with ``fragment_sync_delay`` and ``fragment_update_alpha``): the trainable
parameters are cut into F fragments (optim/fragments.py: contiguous runs in the optimizer's
order balanced by element count, or the user's ``fragment_groups``), each with its own anchor
and its own outer torch optimizer, and fragment f is exchanged every H steps at offset f*H/F:
its pseudo-gradient ``delta_f = anchor_f - params_f`` is launched at the end of local step t
where ``(t - f*H/F) % H == 0`` (t counted from the phase's start, skipped steps included, as
above; fragment 0 comes last in each cycle of H steps). It is in flight for tau more inner
steps and applied after the tau-th (with tau = 0, at once), the same on every rank::

    global_f = outer_f(anchor_f, avg_f)               the outer step above, over fragment f only
    params_f = a * params_f + (1 - a) * global_f       a = 0: the clusters' result
    anchor_f = global_f

so the WAN carries one fragment, 1/F of the model, at a time. tau < H/F: a fragment lands
before the next one is launched (one exchange in flight, its order the same everywhere). The
launch submits the same collectives as the blocking exchange, named ``<name>.f<index>`` (each
fragment's error-feedback residuals are its own), on the collective thread: the inner steps'
forward and backward run meanwhile, their reductions inside the cluster beside it (on the
cluster's channel, optim/cluster_channel.py; reductions that take the negotiated path, CUDA
tensors for one, queue behind it). A
refused fragment (a non-finite value on some rank) goes back to its own anchor on every rank;
the others train on. ``opt.sync_clusters()`` applies the exchange in flight and then exchanges
every fragment, blocking, taken whole (no mix): every rank holds the anchor; the schedule goes
on. A checkpoint holds every fragment's outer state (``outer`` is then a list) and leaves the
exchange in flight out: its fragment's progress goes into that fragment's next exchange; a
checkpoint of another F, or of other fragment groups, is refused. One fragment without a delay
runs the code of the whole-model exchange above, bit for bit.

``inner="rank"``: no gradient is reduced at an inner step (optim/routes/sync.py's RankRoute);
each rank trains a replica of its own, so ``delta`` differs between the ranks of a cluster,
and the exchange averages every rank's (its collectives reduce inside each cluster first, as
they do a synchronous step's gradients). The rest is as above: the same anchor everywhere
after each exchange, the fragments' schedule, checkpoints (a rank's own holds its own
progress) and ``sync_clusters()``.

With an adjuster H is chosen at each exchange from the period's compute and exchange times
(with ``overlap``, also the exchange's wire time, its arrival polled once per local step)
gathered from all ranks (adjust/local_steps_rule.py) and applies from the next period, on every
rank alike. With fragments or a delay it is not: H stays ``every`` (its offsets are fixed), and
``hvd.Adjuster(modes=...)`` is refused with them (it starts each phase at an H it predicts).
Under ``modes`` the adjuster chooses the schedule itself (adjust/mode_rule.py): the mode switch
calls ``restart(every, (F, delay))`` between phases (:meth:`LocalStepsSync.replan`), and each
cycle of H steps is then measured for it (:meth:`LocalStepsSync._measure_cycle`).

The strategy itself talks to no other rank: the blocking exchange and the gather of the
period's times are functions given to it (:func:`pseudo_gradient_exchange` and an all-gather
in production), so it is tested in one process against a two-cluster simulation
(tests/unit/test_outer_sync.py).
"""
import dataclasses
import logging
import statistics
import time
from dataclasses import dataclass

import torch

from ..adjust.local_steps_rule import period_times
from ..base import timeline
from ..base.errors import NonFiniteGradientError
from ..core import state
from .fragments import Fragment, InFlight, as_exchange, plan_fragments

log = logging.getLogger("stella_mpi")
OUTER_PRESETS = ("average", "nesterov", "sum")
PACES = ("steps", "time")
INNERS = ("cluster", "rank")

__all__ = ["LocalSteps", "NoOuterSync", "LocalStepsSync", "OUTER_PRESETS"]


@dataclass(frozen=True)
class LocalSteps:
    """What the user asks for (public name ``hvd.LocalSteps``), passed as
    ``DistributedOptimizer(..., local_steps=hvd.LocalSteps(every=H))``.

    every: local steps between two cross-cluster exchanges (H >= 1).
    outer: the outer optimizer: "average" (model averaging), "nesterov" (DiLoCo: Nesterov SGD
        with ``outer_lr`` and ``outer_momentum``), "sum" (SGD at lr C, the number of clusters: the
        clusters' pseudo-gradients summed, for equal clusters; SparseLoCo's sparse pseudo-gradients,
        where an entry one cluster sent is otherwise halved: bench/bench_parity.py), a callable
        ``params -> torch.optim.Optimizer``, or a ``torch.optim.Optimizer`` built over the model's
        parameters.
    outer_lr, outer_momentum: the "nesterov" preset's (DiLoCo uses 0.7 and 0.9).
    overlap: hide each exchange behind the next period's local steps and apply it one period
        late (see the module's documentation; compression none only).
    compression: the pseudo-gradient's (an ``hvd.Compression``); None: the optimizer's
        ``compression``. Set it when the adjuster switches modes (``hvd.Adjuster(modes=("sync",
        "local"))``): the optimizer's compression is then the synchronous route's.
    fragments: F >= 1, Streaming DiLoCo's fragments: the trainable parameters cut into F
        (contiguous runs in the optimizer's order, balanced by element count), fragment f
        exchanged every ``every`` steps at offset f*every/F, with an anchor and an outer
        optimizer of its own (``opt.outer_optimizers``); ``every`` a multiple of F.
    delay: inner steps a fragment's exchange is in flight before it is applied, in
        [0, every/fragments): it lands before the next fragment is launched, so one exchange
        is in flight at a time, the WAN carries one fragment at a time, and the order in which
        the outer steps apply is the launch order on every rank. 0: applied at once (blocking).
    mix: in [0, 1]: when an exchange lands, ``params = mix * params + (1 - mix) * global`` over
        its fragment (0: the clusters' result, the ``delay`` steps since the launch dropped);
        or "progress": ``params = global + (params - params at the launch)``, the cluster's own
        progress of the ``delay`` steps kept on top of the clusters' result (as ``overlap``
        does; the adjuster's delays use it). With no delay both forms take the result.
    fragment_groups: instead of the balanced cut, F lists of parameter names (as the optimizer
        knows them: ``named_parameters``) that cover every trainable parameter exactly once.
    pace: "steps" (every cluster takes ``every`` steps per period) or "time": clusters of
        unequal speed; after the first period (``every`` steps everywhere) a period lasts as
        long as the fastest cluster takes for ``every`` steps, each cluster takes as many steps
        as fit in it, and the outer mean is weighted by the samples each rank trained on (its
        steps), so a slow cluster never idles a fast one. Not with fragments, a delay or overlap.
    inner: "cluster" (gradients averaged inside each cluster at every inner step: each cluster
        is one replica) or "rank": nothing is reduced at an inner step; each rank is a replica of
        its own, and the exchange averages every rank's pseudo-gradient (dense inside each
        cluster, then through the compression across clusters, as a synchronous step's
        gradients). Where a cluster's ranks share a machine's cores (CPU ranks), its reduction
        at every step costs as much as a fifth of the step (docs/guides/local-steps.md); with
        "rank" it is gone, at the price of replicas that each see a rank's batch, not a
        cluster's. Not with overlap (its exchange sends one shard per rank of a cluster's
        common pseudo-gradient) or pace "time" (its periods end where a cluster agrees), and
        not under ``Adjuster(modes=...)``: there the automatic route (no ``local_steps``) makes
        each rank a replica itself where the cluster's reductions cost (optim/tuning.py).

    With fragments or a delay the adjuster does not choose H (it stays ``every``), an outer
    optimizer instance is refused for F > 1 (a callable is called once per fragment), and
    ``overlap`` is refused (use ``delay``). See the module's documentation.
    """
    every: int
    outer: object = "average"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    overlap: bool = False
    compression: object = None
    fragments: int = 1
    delay: int = 0
    mix: float = 0.0
    fragment_groups: object = None
    pace: str = "steps"
    inner: str = "cluster"

    def __post_init__(self):
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError("LocalSteps: every must be an int >= 1 (local steps per exchange), got %r"
                             % (self.every,))
        if not (self.outer in OUTER_PRESETS if isinstance(self.outer, str) else
                isinstance(self.outer, torch.optim.Optimizer) or callable(self.outer)):
            raise ValueError("LocalSteps: outer must be one of %s, a callable params -> torch.optim.Optimizer, or a "
                             "torch.optim.Optimizer over the model's parameters; got %r"
                             % (", ".join(OUTER_PRESETS), self.outer))
        if not (isinstance(self.outer_lr, (int, float)) and self.outer_lr > 0):
            raise ValueError("LocalSteps: outer_lr must be > 0, got %r" % (self.outer_lr,))
        if not (isinstance(self.outer_momentum, (int, float)) and 0 <= self.outer_momentum < 1):
            raise ValueError("LocalSteps: outer_momentum must be in [0, 1), got %r" % (self.outer_momentum,))
        if not isinstance(self.overlap, bool):
            raise ValueError("LocalSteps: overlap must be True or False, got %r" % (self.overlap,))
        if self.compression is not None and not callable(getattr(self.compression, "compress", None)):
            raise ValueError("LocalSteps: compression must be an hvd.Compression, got %r" % (self.compression,))
        self._check_fragments()
        if self.pace not in PACES:
            raise ValueError("LocalSteps: pace must be one of %s (a period of 'every' steps on every cluster, or of "
                             "the time the fastest cluster takes for them), got %r" % (", ".join(PACES), self.pace))
        if self.pace == "time" and (self.fragments > 1 or self.delay or self.overlap):
            raise ValueError("LocalSteps(pace='time', fragments=%d, delay=%d, overlap=%s): a period of the fastest "
                             "cluster's time needs every exchange taken at once and whole; pass fragments=1, delay=0, "
                             "overlap=False, or pace='steps'" % (self.fragments, self.delay, self.overlap))
        if self.inner not in INNERS:
            raise ValueError("LocalSteps: inner must be one of %s (the inner step's gradients averaged inside each "
                             "cluster, or each rank's own), got %r" % (", ".join(INNERS), self.inner))
        if self.inner == "rank" and (self.overlap or self.pace == "time"):
            raise ValueError("LocalSteps(inner='rank', overlap=%s, pace=%r): %s; pass inner='cluster', or %s"
                             % (self.overlap, self.pace,
                                "overlap's exchange sends one shard per rank of the pseudo-gradient its cluster shares"
                                if self.overlap else "pace 'time' ends a period where a cluster's ranks agree",
                                "delay=... with overlap=False" if self.overlap else "pace='steps'"))

    def _check_fragments(self):
        """fragments, delay, mix and fragment_groups, alone and with the other settings."""
        f, every = self.fragments, self.every
        if isinstance(f, bool) or not isinstance(f, int) or f < 1:
            raise ValueError("LocalSteps: fragments must be an int >= 1 (the parts of the model exchanged in turn), "
                             "got %r" % (f,))
        if every % f:
            raise ValueError("LocalSteps(every=%d, fragments=%d): the offset schedule f*H/F does not fit H: fragment f "
                             "is exchanged at steps f*every/fragments + k*every; pass every as a multiple of fragments "
                             "(every=%d)" % (every, f, every + f - every % f))
        slot = every // f
        if isinstance(self.delay, bool) or not isinstance(self.delay, int) or not 0 <= self.delay < slot:
            raise ValueError("LocalSteps(every=%d, fragments=%d, delay=%r): delay must be an int in [0, every/fragments) "
                             "= [0, %d): a fragment's exchange must land before the next fragment's launch, %d steps "
                             "later; lower delay, or raise every" % (every, f, self.delay, slot, slot))
        if self.mix != "progress" and (isinstance(self.mix, bool) or not isinstance(self.mix, (int, float))
                                       or not 0 <= self.mix <= 1):
            raise ValueError("LocalSteps: mix must be a number in [0, 1] (the share of the local parameters kept when "
                             "an exchange lands; 0 takes the clusters' result) or \"progress\" (the cluster's progress "
                             "since the launch kept on top of it), got %r" % (self.mix,))
        if self.overlap and (f > 1 or self.delay > 0):
            raise ValueError("LocalSteps(overlap=True, fragments=%d, delay=%d): overlap hides a whole-model exchange "
                             "behind the next period; fragments hide theirs behind inner steps: use delay=... with "
                             "overlap=False" % (f, self.delay))
        if self.overlap and self.mix not in (0, "progress"):
            raise ValueError("LocalSteps(overlap=True, mix=%r): overlap keeps the cluster's progress since the launch by "
                             "itself; mix weighs it when a delayed exchange lands: use delay=... with overlap=False, or "
                             "mix=0.0" % (self.mix,))
        if f > 1 and isinstance(self.outer, torch.optim.Optimizer):
            raise ValueError("LocalSteps(fragments=%d, outer=%s(...)): each fragment has an outer optimizer of its own, "
                             "over its parameters, and this one holds them all; pass a callable params -> "
                             "torch.optim.Optimizer (called once per fragment) or a preset (%s)"
                             % (f, type(self.outer).__name__, ", ".join(OUTER_PRESETS)))
        if self.fragment_groups is not None:
            object.__setattr__(self, "fragment_groups", _checked_groups(self.fragment_groups, f))

    def preset_hyperparameters(self, clusters=1):
        """The SGD hyperparameters of the ``outer`` preset between ``clusters`` clusters (None
        for a user's optimizer)."""
        if self.outer == "average":
            return {"lr": 1.0, "momentum": 0.0, "nesterov": False}
        if self.outer == "sum":
            return {"lr": float(clusters), "momentum": 0.0, "nesterov": False}
        if self.outer == "nesterov":
            return {"lr": self.outer_lr, "momentum": self.outer_momentum, "nesterov": True}
        return None

    def outer_optimizer(self, named, clusters=1):
        """The outer torch optimizer over the parameters ``named`` [(name, parameter)] (the
        model's trainable ones, or one fragment's), between ``clusters`` clusters."""
        params = [p for _, p in named]
        preset = self.preset_hyperparameters(clusters)
        if preset is not None:
            return torch.optim.SGD(params, **preset)
        if isinstance(self.outer, torch.optim.Optimizer):
            outer = self.outer
        else:
            outer = self.outer(params)
            if not isinstance(outer, torch.optim.Optimizer):
                raise ValueError("LocalSteps(outer=%r): the callable must return a torch.optim.Optimizer over the "
                                 "parameters it is given, got %r" % (self.outer, type(outer).__name__))
        theirs = {id(p) for g in outer.param_groups for p in g["params"]}
        ours = {id(p): n for n, p in named}
        missing = [n for i, n in ours.items() if i not in theirs]
        if missing or set(theirs) - set(ours):
            raise ValueError("LocalSteps(outer=...): the outer optimizer must hold exactly the parameters it is given "
                             "(the model's trainable ones, or one fragment's); %s"
                             % ("it lacks %s" % ", ".join(sorted(missing)) if missing else
                                "it holds parameters it was not given"))
        return outer


def _checked_groups(groups, fragments):
    """``fragment_groups`` as a tuple of tuples of names, checked without the model: ``fragments``
    non-empty lists of names, each name once (the model's names are checked when it is known,
    optim/fragments.py)."""
    what = "LocalSteps(fragment_groups=...)"
    if isinstance(groups, (str, bytes)) or not isinstance(groups, (list, tuple)) or not all(
            isinstance(g, (list, tuple)) and all(isinstance(n, str) for n in g) for g in groups):
        raise ValueError("%s must be a list of lists of parameter names (one list per fragment), got %r"
                         % (what, groups))
    if len(groups) != fragments:
        raise ValueError("%s has %d groups and fragments=%d: pass fragments=%d (one group per fragment)"
                         % (what, len(groups), fragments, len(groups)))
    empty = [i for i, g in enumerate(groups) if not g]
    if empty:
        raise ValueError("%s: group %d is empty; every fragment holds at least one parameter" % (what, empty[0]))
    seen, repeated = set(), []
    for n in (n for g in groups for n in g):
        if n in seen and n not in repeated:
            repeated.append(n)
        seen.add(n)
    if repeated:
        raise ValueError("%s names %s more than once; every parameter goes in exactly one fragment"
                         % (what, ", ".join(repeated)))
    return tuple(tuple(g) for g in groups)


class NoOuterSync:
    """The synchronous routes': nothing crosses besides the gradients."""
    kind = "none"
    overlap = False

    def before_synchronize(self):
        pass

    def step_closed(self, skipped):
        """Returns whether a period's exchange ran in it (a skipped last step's): never here."""
        return False

    def before_step(self):
        pass

    def after_step(self):
        return None

    def sync_clusters(self):
        pass

    def state_dict(self):
        return None


@dataclass
class _Cycle:
    """What the current cycle of H steps spent (fragments; the adjuster's schedules measure it):
    seconds its launches and landings blocked, the wire seconds of the exchanges that landed in
    it, and how many landed."""
    blocked: float = 0.0
    wire: float = 0.0
    landed: int = 0


class LocalStepsState:
    """Where local steps stand: H now, steps since the last exchange (with fragments or a
    delay: the step within the schedule's cycle of H steps, 0 at its start), exchanges done (of
    every fragment)."""

    def __init__(self, every):
        self.every = every
        self.local_steps = 0
        self.exchanges = 0


class LocalStepsSync:
    """The outer synchronization of local steps (the module's documentation).

    ``named``: [(name, parameter)] of the trainable parameters; ``exchange(deltas)``: the mean
    over all ranks of each rank's pseudo-gradients (blocking, collective), with ``launch`` and
    ``wait`` for a delay and ``fragment(i)`` for fragments of their own collective names
    (:class:`..tuning.PseudoGradientExchange`; a plain function serves every fragment, exchanged
    when applied); ``channel``: an :class:`OuterChannel` for ``overlap``; ``rule``: a
    :class:`LocalStepsRule` choosing H, with ``gather(row)`` all-gathering each rank's period
    times (int64 rows), unused with fragments or a delay (H stays ``every``)."""
    kind = "local"

    def __init__(self, settings, named, exchange, channel=None, rule=None, gather=None, cluster_id=0,
                 drop_nonfinite_state=None, cluster_any=None, clock=time.perf_counter, clusters=1):
        self.settings = settings
        self.clock = clock           # seconds (tests give each simulated cluster its own)
        # pace "time": the common period in seconds (None: the first, ``every`` steps everywhere), and
        # cluster_any(flag): whether any rank of this cluster says the period is over (collective inside it)
        self.paced = settings.pace == "time"
        self.period_s = None
        self.cluster_any = cluster_any or (lambda flag: flag)
        self.drop_nonfinite_state = drop_nonfinite_state   # () -> names whose inner state was dropped
        self.named = list(named)
        self.clusters = clusters
        self.exchange = exchange
        self._plan(settings)
        self.progress = LocalStepsState(settings.every)
        self.anchor = {}
        self.channel = channel
        self.overlap = channel is not None
        if rule is not None and self.streaming:
            log.info("stella_mpi: LocalSteps(fragments=%d, delay=%d): H stays %d (the adjuster chooses H for one "
                     "fragment without a delay only)", settings.fragments, settings.delay, settings.every)
            rule = None
        self.rule = rule
        self.gather = gather
        self.cluster_id = cluster_id
        self.reason = None           # the last H decision's
        self.measured = None         # (compute_s, exchange_s, wire_s) the last H decision was taken from
        # the automatic route's choice of replicas (ModeSwitch): a function giving the share of its
        # time this rank spent reducing inside its cluster since its last call, gathered with the
        # period's times; the largest over ranks of a gather not yet read (None: none since)
        self.inner_busy = None
        self.inner_busy_share = None
        self.in_sync = False         # overlap: every rank holds the anchor and nothing was trained since
        self._period_start = None    # perf_counter at the current period's start
        self._timed = False          # the current period was timed from its start (not the first one)
        self._gather_s = 0.0         # the last decision's gather: part of the next exchange's cost
        self.due = False             # the period's last step was counted; its exchange has not run yet
        self.refusals = []           # [(exchange number, message)]: exchanges refused for a non-finite value
        self.pending = None          # fragments: the exchange in flight (an InFlight), or None
        self._launch_due = None      # fragments: the fragment whose launch the step just counted owes
        # the adjuster's schedules (ModeSwitch): replan() may change F and the delay from a phase to
        # the next, and each cycle of H steps is measured for the mode rule (_measure_cycle)
        self.schedules_chosen = False
        self._cycle = _Cycle()
        # the steady step: the median of the cycle's steps (start of one synchronize to the next),
        # most of which no landing blocks; the largest over ranks of the last timed gather (None:
        # none), from which the mode rule predicts another rung's steps (ModeRule.after_local).
        # The steps are dropped wherever the period starts over untimed (before_step)
        self.steady_s = None
        self._step_at = None
        self._steps = []

    def _plan(self, settings, qualified=False):
        """The fragments of ``settings`` (each with a fresh outer optimizer) and whether their
        schedule runs (``qualified``: the collectives' names hold F, :func:`.fragments.as_exchange`).
        Nothing changes when the cut or an outer optimizer is refused (ValueError)."""
        parts = plan_fragments(self.named, settings.fragments, settings.fragment_groups)
        fragments = [Fragment(i, len(parts), part, settings.outer_optimizer(part, self.clusters),
                              as_exchange(self.exchange, i, len(parts), qualified)) for i, part in enumerate(parts)]
        self.settings, self.fragments = settings, fragments
        self.streaming = settings.fragments > 1 or settings.delay > 0   # the fragments' schedule runs

    def planned(self, every, fragments, delay):
        """The LocalSteps of the schedule (H, F, delay) and its fragments' parameter names, checked
        (ValueError naming what does not fit) and taken nowhere."""
        settings = dataclasses.replace(self.settings, every=every, fragments=fragments, delay=delay,
                                       fragment_groups=None)
        return settings, [[n for n, _ in part] for part in plan_fragments(self.named, fragments)]

    @property
    def schedule(self):
        """(F, delay) now."""
        return len(self.fragments), self.settings.delay

    def replan(self, every, fragments, delay):
        """The adjuster's schedule for the next phase: H = ``every``, F = ``fragments`` (the
        balanced cut), ``delay``; the exchange in flight completed and forgotten. Where F or the
        delay changes the model is cut anew and each fragment's outer optimizer is new (``opt.outer_optimizers``
        then names other objects: a learning-rate scheduler built over the old ones no longer
        steers them); otherwise the outer optimizers are kept. A fragment's collectives are
        named ``<name>.f<index>of<F>``, so what a schedule's residuals did not send waits for the
        next phase of the same F. ValueError as LocalSteps raises it for a schedule that does
        not fit H or the model (nothing changed then)."""
        settings, _ = self.planned(every, fragments, delay)
        self.drop_in_flight()
        if (fragments, delay) != (len(self.fragments), self.settings.delay):
            self._plan(settings, qualified=True)
        else:
            self.settings = settings
        self.progress.every = every
        self._cycle = _Cycle()

    @property
    def every(self):
        return self.progress.every

    @property
    def outers(self):
        """The outer torch optimizers, one per fragment."""
        return [f.outer for f in self.fragments]

    @property
    def outer(self):
        """The outer torch optimizer (one fragment)."""
        if len(self.fragments) > 1:
            raise ValueError("LocalSteps(fragments=%d) has one outer optimizer per fragment: use outers "
                             "(opt.outer_optimizers)" % len(self.fragments))
        return self.fragments[0].outer

    # ---------------- the step

    def before_synchronize(self):
        """At the start of each step's synchronize (every rank calls it once per step, whether
        or not it then calls ``step()``): the anchor is taken before the first update, and an
        exchange still owed by a period whose last step never reached ``step()`` runs now."""
        self.before_step()
        if self.schedules_chosen and self.streaming:   # (emptied by each cycle's measure)
            now = self.clock()
            if self._step_at is not None:
                self._steps.append(now - self._step_at)
            self._step_at = now
        if self.due:
            self._boundary(skipped=True)

    def step_closed(self, skipped):
        """The step's gradients were reduced inside the cluster (or refused). The period is
        counted here, not in ``step()``: a rank whose step is skipped (a non-finite gradient, a
        GradScaler that found one and never calls ``step()``, ``STELLA_NONFINITE=raise``) counts it
        all the same, so every cluster meets at the same step. A skipped last step changes no
        parameter, so its exchange runs now; otherwise it runs after the user's update. Returns
        whether it ran now (the caller then takes the decisions that follow an exchange: the
        ranks that step take them after their update, at the same step)."""
        if self.streaming:
            return self._count_streaming(skipped)
        p = self.progress
        p.local_steps += 1
        if self.channel is not None:    # (also drives MPI's progress on the exchange in flight)
            self.channel.poll()
        if self._period_over():
            self.due = True
            if skipped:
                self._boundary(skipped=True)
                return True
        return False

    def _period_over(self):
        """``every`` steps; with pace "time" and a period measured, the step that ends nearest the
        period's end (its cluster's ranks agree: any of them)."""
        p = self.progress
        if not self.paced or self.period_s is None or self._period_start is None:
            return p.local_steps >= p.every
        elapsed = self.clock() - self._period_start
        return self.cluster_any(elapsed + 0.5 * elapsed / p.local_steps >= self.period_s)

    def before_step(self):
        if not self.anchor:
            self.capture()                  # the broadcast parameters, before the first update
        if self._period_start is None:      # the first period (after a load): timed from here, not whole
            self._period_start, self._timed = self.clock(), False
            self._step_at, self._steps = None, []   # (nor are its steps: the cycle's median starts here too)

    def after_step(self):
        """After the user's update: the exchange, when this step ended a period. Returns the
        measured times of a decision on H when one was taken (else None)."""
        self.in_sync = False
        if not self.due:
            return None
        return self._boundary(skipped=False)

    def _boundary(self, skipped):
        """The exchange that ends a period, and the decision on H. ``skipped``: this rank's last
        step made no update (its times decide nothing: no rank takes a decision from them)."""
        self.due = False
        if self.streaming:
            return self._streaming_boundary(skipped)
        p = self.progress
        started = self.clock()
        compute_s = (started - self._period_start) / max(1, p.local_steps)
        if self.channel is not None:
            self.channel.last = None
            self._overlapped_outer_step()
            if self.rule is None:
                return None
            last = self.channel.last   # None at the first boundary: nothing was in flight
            exposed = max(0.0, last[1] - started) if last else 0.0   # the wait for the wire
            return self._choose_every(compute_s, self.clock() - started - exposed,
                                      last[1] - last[0] if last else None, skipped)
        self.outer_step()
        if self.rule is None:
            return None
        return self._choose_every(compute_s, self.clock() - started, skipped=skipped)

    def capture(self):
        self.anchor = {n: p.detach().clone() for n, p in self.named}

    def restart(self, every, schedule=None, keep_outer_state=False):
        """A new phase of local steps from the parameters as they are (the same on every rank):
        H = ``every``, the rule's history and the outer optimizers' state cleared (they belong to
        a past phase), an exchange in flight forgotten; ``schedule``: the adjuster's (F, delay)
        for it (:meth:`replan`), None: as it is. ``keep_outer_state``: the same phase goes on
        under another schedule (the adjuster's change of F or delay inside local steps): each
        parameter's outer state (the outer momentum) is kept, in whichever fragment it now is."""
        self.drop_in_flight()
        kept = self._outer_state() if keep_outer_state else {}
        if schedule is not None:
            self.replan(every, *schedule)
        self.capture()
        self.progress.every, self.progress.local_steps = every, 0
        self.due, self._launch_due = False, None
        if self.rule is not None:
            self.rule.restart(every)
        self.period_s = None   # (pace "time": the next period is measured again)
        for outer in self.outers:
            outer.state.clear()
            for group in outer.param_groups:
                for p in group["params"]:
                    if p in kept:
                        outer.state[p] = kept[p]
        self._period_start = None
        self.in_sync = True

    def _outer_state(self):
        """{parameter: its outer optimizer's state} over every fragment (the outer optimizers are
        torch optimizers whose state is per parameter, and a fragment holds whole parameters)."""
        return {p: state for outer in self.outers for p, state in outer.state.items() if state}

    def exclude_time(self, seconds):
        if self._period_start is not None:
            self._period_start += seconds

    # ---------------- the outer step

    def _outer_apply(self, avgs, progress=None, fragment=None, mix=0.0):
        """Fragment ``fragment``'s (None: the only one) outer optimizer's step from the anchor
        with the mean pseudo-gradients ``avgs`` (one per parameter, in the fragment's order):
        the result is the new anchor, and each parameter becomes it, plus ``progress`` (one
        tensor per parameter, or None), or ``mix * (the parameter now) + (1 - mix) * it``."""
        fragment = fragment or self.fragments[0]
        named = fragment.named
        with torch.no_grad():
            saved = [p.grad for _, p in named]
            local = [p.detach().clone() for _, p in named] if mix else None
            for (name, p), avg in zip(named, avgs):
                p.copy_(self.anchor[name])
                p.grad = avg.to(p.device, p.dtype).view_as(p)
            fragment.outer.step()
            for i, ((name, p), grad) in enumerate(zip(named, saved)):
                self.anchor[name].copy_(p)
                p.grad = grad
                if progress is not None:
                    p.add_(progress[i])
                if local is not None:
                    p.mul_(1.0 - mix).add_(local[i], alpha=mix)
        fragment.exchanges += 1
        self.progress.exchanges += 1

    def deltas(self):
        return [(self.anchor[name] - p.detach()).contiguous() for name, p in self.named]

    def outer_step(self, mix=None):
        """The blocking exchange of the steps since the last one, and the outer step (its
        result weighed with the parameters by ``mix``, by default the settings'). A
        pseudo-gradient that is not finite on some rank is refused on every rank
        (:meth:`_refused`)."""
        steps, self.progress.local_steps = self.progress.local_steps, 0
        mix = self.settings.mix if mix is None else mix
        mix = 0.0 if mix == "progress" else mix   # (nothing was trained since the launch)
        deltas = self.deltas()
        if self.paced:
            deltas = self._weighted(deltas, steps)
        try:
            avgs = self.exchange(deltas)
        except NonFiniteGradientError as e:
            self._refused(str(e))
        else:
            self._outer_apply(avgs, mix=mix)
            self._period_start = self.clock()

    def _weighted(self, deltas, steps):
        """Pace "time": each rank's pseudo-gradient weighted by the samples it trained on (its
        steps), so that the exchange's mean over ranks is the sample-weighted mean; and the next
        period: ``every`` steps of the fastest cluster. One all-gather of every rank's (steps,
        microseconds of its period); every rank decides from the same rows."""
        elapsed = self.clock() - self._period_start if self._period_start is not None else 0.0
        rows = self.gather(torch.tensor([[steps, round(1e6 * elapsed)]], dtype=torch.int64)).tolist()
        total = sum(r[0] for r in rows)
        paces = [1e-6 * r[1] / r[0] for r in rows if r[0] > 0 and r[1] > 0]
        if paces:
            self.period_s = self.progress.every * min(paces)
        weight = steps * len(rows) / total if total else 1.0
        return deltas if weight == 1.0 else [d * weight for d in deltas]

    def _refused(self, why, fragment=None):
        """An exchange that some rank's non-finite pseudo-gradient refused, decided alike on every
        rank (the exchange's own agreement): no value of it reaches a parameter. Every rank goes
        back to the anchor, the parameters the clusters last agreed on (with fragments: the
        refused fragment's only; the others train on), and drops what of its inner optimizer's
        state is not finite; the outer optimizer's state is kept. Then ``STELLA_NONFINITE=raise``
        raises NonFiniteGradientError on every rank, ``skip`` warns and training goes on."""
        fragment = fragment or self.fragments[0]
        n = self.progress.exchanges
        which = " of %s" % fragment.describe() if fragment.count > 1 else ""
        self.refusals.append((n, fragment.describe() + ": " + why if which else why))
        self._period_start = None   # the next period is timed from its start: it decides nothing
        with torch.no_grad():
            for name, p in fragment.named:
                p.copy_(self.anchor[name])
        dropped = self.drop_nonfinite_state() if self.drop_nonfinite_state is not None else []
        message = ("local steps: exchange %d%s across clusters refused on every rank: %s; every rank is back at the "
                   "parameters the clusters last agreed on%s%s"
                   % (n, which, why.split(": ", 1)[-1] if why.startswith("rank ") else why,
                      " for this fragment (the others train on)" if which else "",
                      "; this rank dropped the non-finite inner optimizer state of %s" % ", ".join(dropped)
                      if dropped else ""))
        if _policy() == "raise":
            raise NonFiniteGradientError(message)
        _count_skip()
        log.warning("stella_mpi: %s", message)

    def _flat_delta(self):
        wide = any(p.dtype == torch.float64 for _, p in self.named)
        dtype = torch.float64 if wide else torch.float32
        return torch.cat([(self.anchor[n] - p.detach()).reshape(-1).to("cpu", dtype) for n, p in self.named])

    def _apply_pending(self, no_progress=False):
        """Wait for the exchange in flight and apply it one period late. ``no_progress``:
        nothing was trained since the launch, so the parameters become the new anchor exactly
        (the same bits on every rank). An exchange some rank flagged as not finite is refused on
        every rank (:meth:`_refused`); returns False then."""
        avg, sent, refused = self.channel.wait()
        if refused:
            self._refused(refused)
            return False
        avgs, progress, offset = [], [], 0
        with torch.no_grad():
            for name, p in self.named:
                n = p.numel()
                anchor = self.anchor[name]
                avgs.append(avg[offset:offset + n].view_as(p))
                if not no_progress:   # p - (anchor - delta): this cluster's progress since the launch
                    d = sent[offset:offset + n].view_as(p).to(p.device, anchor.dtype)
                    progress.append(p.detach() - (anchor - d))
                offset += n
        self._outer_apply(avgs, None if no_progress else progress)
        return True

    def _overlapped_outer_step(self):
        self.progress.local_steps = 0
        if self.channel.pending is not None:
            self._apply_pending()
        self.channel.launch(self._flat_delta())

    # ---------------- fragments (Streaming DiLoCo)

    def _count_streaming(self, skipped):
        """Count the step in the cycle of H steps: fragment f is launched at the step whose
        count in the cycle is f*H/F (fragment 0 at H, counted as 0), and the exchange in flight
        is applied ``delay`` steps after its launch."""
        p = self.progress
        p.local_steps = (p.local_steps + 1) % p.every
        self.in_sync = False
        if self.pending is not None:
            self.pending.left -= 1
            if self.schedules_chosen and self.pending.arrived is None:   # (the cycle's wire: _measure_cycle)
                self.pending.arrived = self._arrived(self.pending)
        slot = p.every // len(self.fragments)
        if p.local_steps % slot == 0:
            self._launch_due = p.local_steps // slot
        if self._launch_due is not None or (self.pending is not None and self.pending.left <= 0):
            self.due = True
            if skipped:
                self._boundary(skipped=True)
                return True
        return False

    def _streaming_boundary(self, skipped=False):
        """After the step's update: apply the exchange whose delay ran out, then launch the
        fragment due (with no delay, wait for it and apply it at once). Fragment 0's launch ends
        a cycle of H steps: with the adjuster's schedules it is measured (:meth:`_measure_cycle`,
        returned; else None)."""
        started = self.clock()
        if self.pending is not None and self.pending.left <= 0:
            flight, self.pending = self.pending, None
            self._land(flight)
        index, self._launch_due = self._launch_due, None
        if index is not None:
            flight = self._launch(self.fragments[index])
            if flight.left == 0:
                self._land(flight)
            else:
                self.pending = flight
        self._cycle.blocked += self.clock() - started
        if index == 0 and self.schedules_chosen and self.gather is not None:
            return self._measure_cycle(skipped)
        return None

    def _launch(self, fragment, delay=None):
        delay = self.settings.delay if delay is None else delay
        with timeline.op_scope(_op_name(fragment)), timeline.span("OUTER_LAUNCH", delay=delay):
            deltas = [(self.anchor[name] - p.detach()).contiguous() for name, p in fragment.named]
            # mix "progress": the parameters at the launch, to take the progress since from them
            kept = [p.detach().clone() for _, p in fragment.named] if self.settings.mix == "progress" and delay else None
            handle = fragment.exchange.launch(deltas)
        return InFlight(fragment, handle, delay, kept=kept, launched=self.clock())

    def _arrived(self, flight):
        """When ``flight``'s collectives completed: the exchange's own time where it tells
        (``arrived``: the collective thread's clock, the production one), else this step's
        ``clock()``; None while they run (an exchange that cannot tell: at its landing)."""
        arrived = getattr(flight.fragment.exchange, "arrived", None)
        if arrived is None:
            return None
        at = arrived(flight.handle)
        if at is None:
            return None
        # (the exchange's time is time.perf_counter's: another clock, a test's, reads its own)
        return at if isinstance(at, float) and self.clock is time.perf_counter else self.clock()

    def _land(self, flight, mix=None):
        """Wait for ``flight`` and apply it: ``global = outer(anchor, mean)``, ``params = mix *
        params + (1 - mix) * global`` (mix "progress": ``global + params - params at the
        launch``), ``anchor = global``, for its fragment only. A refused one sends that fragment
        back to its anchor on every rank (:meth:`_refused`); returns False then. Another failure
        of its collectives propagates (their names end in ``.f<index>``)."""
        fragment = flight.fragment
        if flight.arrived is None:
            flight.arrived = self._arrived(flight)
        with timeline.op_scope(_op_name(fragment)):
            try:
                with timeline.span("OUTER_WAIT", arrived=flight.arrived is not None):
                    avgs = fragment.exchange.wait(flight.handle)
            except NonFiniteGradientError as e:
                self._refused(str(e), fragment)
                return False
            finally:
                self._cycle.landed += 1
                self._cycle.wire += (flight.arrived or self.clock()) - flight.launched
            mix = self.settings.mix if mix is None else mix
            progress = None
            if mix == "progress":
                mix = 0.0
                if flight.kept is not None:
                    progress = [p.detach() - k for (_, p), k in zip(fragment.named, flight.kept)]
            with timeline.span("OUTER_STEP"):
                self._outer_apply(avgs, progress, fragment=fragment, mix=mix)
        return True

    def _measure_cycle(self, skipped):
        """The cycle of H steps that fragment 0's launch just ended, for the mode rule (the
        adjuster's schedules only): the seconds per step (the cycle's, less what its launches
        and landings blocked, over H), the seconds they blocked (with the last gather's), and
        the wire time of the exchanges that landed in it (launch to arrival, the arrival polled
        once per step), gathered from every rank (:meth:`_gathered`).
        A cycle not timed from its start on some rank (the first of a phase, or after a load),
        whose last step some rank skipped, or in which nothing landed decides nothing. Returns
        (compute_s, exchange_s, wire_s), or None."""
        cycle, self._cycle = self._cycle, _Cycle()
        now = self.clock()
        start = self._period_start if self._period_start is not None else now
        compute_s = max(0.0, now - start - cycle.blocked) / max(1, self.progress.every)
        timed = self._timed and not skipped and cycle.landed > 0
        # (the period started over untimed since, by a refusal or a sync: its steps are not this cycle's)
        steps, self._steps = self._steps if self._period_start is not None else [], []
        self.measured = self._gathered(compute_s, cycle.blocked, cycle.wire, timed,
                                       statistics.median(steps) if steps else compute_s)
        self._period_start, self._timed = self.clock(), True
        return self.measured

    def _sync_streaming(self):
        """sync_clusters with fragments: the exchange in flight applied, then every fragment
        exchanged (launched together, applied in order) and taken whole (no mix), so every rank
        holds the anchor. The schedule goes on from where it is."""
        self._launch_due = None
        self._cycle, self._period_start = _Cycle(), None   # (the cycle is not measured: a sync is no schedule)
        if not self.anchor or self.in_sync:
            return
        error = None
        if self.pending is not None:
            flight, self.pending = self.pending, None
            error = self._land_all([flight], mix=None)
        later = self._land_all([self._launch(f, delay=0) for f in self.fragments], mix=0.0)
        error = error or later
        self.in_sync = True
        if error is not None:
            raise error

    def _land_all(self, flights, mix):
        """Land every exchange of ``flights`` in order; the first NonFiniteGradientError raised
        by a refusal (STELLA_NONFINITE=raise), after all of them landed or were refused."""
        error = None
        for flight in flights:
            try:
                self._land(flight, mix=mix)
            except NonFiniteGradientError as e:
                error = error or e
        return error

    def drop_in_flight(self):
        """Complete the exchange in flight (overlap's or a fragment's) and forget it: a checkpoint
        being loaded replaces what it would apply, and its progress goes into the next exchange.
        Touches no other rank: every rank launched it."""
        if self.channel is not None:
            self.channel.drop()
        if self.pending is not None:
            flight, self.pending = self.pending, None
            flight.fragment.exchange.drop(flight.handle)

    def sync_clusters(self):
        """Make every rank hold the same parameters now: with ``overlap``, complete the exchange
        in flight and run one more, blocking; without, run the exchange of the steps since the
        last one (if any); with fragments or a delay, complete the exchange in flight and run one
        more of every fragment, blocking. Collective: every rank calls it at the same step."""
        self.due = False
        if self.streaming:
            self._sync_streaming()
            return
        if self.channel is None:
            if self.progress.local_steps:
                self.outer_step(mix=0.0)   # taken whole: the same parameters everywhere
            return
        if not self.anchor or self.in_sync:
            return
        if self.channel.pending is not None:
            if self.progress.local_steps == 0:   # launched at this very step: nothing trained since
                self._apply_pending(no_progress=True)
                self.in_sync = True
                return
            if not self._apply_pending():   # refused: every rank holds the anchor again
                self.progress.local_steps = 0
                self.in_sync = True
                return
        self.channel.launch(self._flat_delta())
        self._apply_pending(no_progress=True)
        self.progress.local_steps = 0
        self.in_sync = True
        self._period_start = None   # the next period starts at the next step (its first untimed)

    def consensus_parameters(self):
        """{name: tensor}: the anchor, the parameters the clusters last agreed on."""
        return {n: t.clone() for n, t in self.anchor.items()}

    # ---------------- choosing H

    def _choose_every(self, compute_s, exchange_s, wire_s=None, skipped=False):
        """The adjuster's H for the next period, from this period's times (seconds per local
        step; seconds the exchange blocked the step; with overlap, the seconds from the launch
        of the exchange just applied to its arrival), gathered from every rank (:meth:`_gathered`).
        A period not timed from its start on some rank (the first one, or after a
        load), whose last step some rank skipped, or with nothing in flight, decides nothing.
        Returns the times decided from, or None."""
        timed = self._timed and not skipped and (wire_s is not None or self.channel is None)
        gathered = self._gathered(compute_s, exchange_s, wire_s or 0.0, timed)
        self.measured = None
        if gathered is not None:
            p = self.progress
            self.rule.every = p.every   # (a loaded checkpoint may have set it)
            compute, exchange, wire = gathered
            wire = wire if self.channel is not None else None
            every, reason = self.rule.observe(compute, exchange, wire)
            self.measured = (compute, exchange, wire)
            if every != p.every:
                log.info("stella_mpi: local steps H %d -> %d (%s)", p.every, every, reason)
            p.every, self.reason = every, reason
        self._period_start, self._timed = self.clock(), True
        return self.measured

    def _gathered(self, compute_s, exchange_s, wire_s, timed, steady_s=0.0):
        """This rank's period times (the exchange with the last gather's time), gathered from
        every rank as integer microseconds with its cluster (one all-gather: every rank decides
        from the same values) and combined by :func:`..adjust.local_steps_rule.period_times`;
        None unless every rank's period was ``timed``. The share of time in the cluster's
        reductions (``inner_busy``, in millionths) rides along in every gather, timed or not: it
        is measured over its own interval, so the first period of a phase tells it too. So does
        the steady step (``steady_s``, a cycle's median; the largest over ranks: ``steady_s``)."""
        t0 = self.clock()
        share = self.inner_busy() if self.inner_busy is not None else 0.0
        mine = torch.tensor([[round(1e6 * compute_s), round(1e6 * (exchange_s + self._gather_s)),
                              round(1e6 * wire_s), self.cluster_id, int(timed), round(1e6 * share),
                              round(1e6 * steady_s)]], dtype=torch.int64)
        rows = self.gather(mine)
        self._gather_s = self.clock() - t0
        if self.inner_busy is not None:
            self.inner_busy_share = 1e-6 * int(rows[:, 5].max())
        if not bool((rows[:, 4] == 1).all()):
            return None
        self.steady_s = 1e-6 * int(rows[:, 6].max()) or None
        return period_times([[1e-6 * int(r[0]), 1e-6 * int(r[1]), 1e-6 * int(r[2]), int(r[3])] for r in rows.tolist()])

    # ---------------- checkpoints

    def state_dict(self):
        """The counters, the anchor and the outer optimizer's state; with fragments, ``outer`` is
        the list of every fragment's, beside ``fragments``, each fragment's parameter names and
        exchanges. An exchange in flight is left out (its progress goes into the next one)."""
        p = self.progress
        sd = {"every": p.every, "local_steps": p.local_steps, "exchanges": p.exchanges,
              "anchor": {n: t.clone() for n, t in self.anchor.items()}}
        if self.paced:
            sd["period_s"] = self.period_s
        if self.settings.delay:
            sd["delay"] = self.settings.delay
        if len(self.fragments) == 1:   # (the layout of the release before fragments)
            sd["outer"] = self.fragments[0].outer.state_dict()
            return sd
        sd.update(outer=[f.outer.state_dict() for f in self.fragments], fragments=len(self.fragments),
                  fragment_names=[f.names for f in self.fragments],
                  fragment_exchanges=[f.exchanges for f in self.fragments])
        return sd

    def check(self, sd, cut=None):
        """Raise ValueError, naming what is wrong, unless ``sd`` fits these parameters (a
        checkpoint of this layout, or of the one before the outer optimizer: ``momentum`` by
        parameter name) and these fragments (``cut``: the parameter names of each fragment of
        the schedule it will be loaded under, :meth:`planned`; default: the current one's)."""
        names = [n for n, _ in self.named]
        for key in ("local_steps", "exchanges", "anchor"):
            if key not in sd:
                raise ValueError("LocalSteps state: the checkpoint has no %r (keys %s)" % (key, sorted(sd)))
        self._check_fragments(sd, cut if cut is not None else [f.names for f in self.fragments])
        by_name = dict(self.named)
        for what in ("anchor", "momentum"):
            held = sd.get(what) or {}
            unknown = sorted(set(held) - set(names))
            if unknown or (what == "anchor" and held and set(held) != set(names)):
                raise ValueError("LocalSteps state: %s names %s, the optimizer's parameters are %s"
                                 % (what, unknown or sorted(held), sorted(names)))
            for n, t in held.items():
                if not torch.is_tensor(t) or t.shape != by_name[n].shape:
                    raise ValueError("LocalSteps state: %s of parameter %r has shape %s, the parameter %s"
                                     % (what, n, list(getattr(t, "shape", [])), list(by_name[n].shape)))

    def _check_fragments(self, sd, cut):
        outer = sd.get("outer")
        saved = saved_fragments(sd)
        count = len(cut)
        if saved != count:
            raise ValueError("LocalSteps state: the checkpoint was saved with fragments=%r, this optimizer has "
                             "fragments=%d: each fragment's outer optimizer state belongs to its cut; load it with "
                             "LocalSteps(fragments=%r) (and the same fragment_groups)" % (saved, count, saved))
        if count == 1:
            return
        if not isinstance(outer, list) or len(outer) != count:
            raise ValueError("LocalSteps state: outer must be a list of %d outer optimizer states (one per fragment), "
                             "got %s" % (count, type(outer).__name__ if not isinstance(outer, list) else
                                         "%d" % len(outer)))
        for index, (names, held) in enumerate(zip(cut, sd.get("fragment_names") or [None] * count)):
            if held is not None and list(held) != list(names):
                raise ValueError("LocalSteps state: fragment %d of the checkpoint holds %s, this optimizer's holds %s: "
                                 "pass the fragment_groups the checkpoint was saved with"
                                 % (index, ", ".join(held), ", ".join(names)))

    def state_dict_on_host(self):
        """The state with its tensors on the CPU (to send to ranks whose devices differ)."""
        sd = self.state_dict()
        sd["anchor"] = {n: t.cpu() for n, t in sd["anchor"].items()}
        sd["outer"] = _to_cpu(sd["outer"])
        return sd

    def load_state_dict(self, sd, keep_every=False):
        """Load ``sd`` (checked first): tensors moved to each parameter's device and dtype.
        ``keep_every``: H stays this optimizer's own (no adjuster: the user's ``every`` holds)."""
        self.check(sd)
        self.drop_in_flight()
        params = dict(self.named)
        p = self.progress
        own = keep_every or (self.streaming and not self.schedules_chosen)
        p.every = p.every if own else int(sd.get("every", self.settings.every))
        p.local_steps, p.exchanges = int(sd["local_steps"]), int(sd["exchanges"])
        if self.streaming:   # (the user's H: a step of a cycle of another H falls into this one)
            p.local_steps %= p.every
        self.anchor = {n: t.detach().to(params[n].device, params[n].dtype).clone() for n, t in sd["anchor"].items()}
        self._load_outer(sd, params)
        if self.paced:
            self.period_s = sd.get("period_s")
        self._period_start = None
        self.in_sync = False
        self.due, self._launch_due = False, None

    def _load_outer(self, sd, params):
        outer = sd.get("outer")
        if isinstance(outer, list):
            for f, state_dict, n in zip(self.fragments, outer, sd.get("fragment_exchanges") or [0] * len(outer)):
                f.outer.load_state_dict(state_dict)
                f.exchanges = int(n)
            return
        first = self.fragments[0]
        first.exchanges = int(sd["exchanges"])
        if outer is not None:
            first.outer.load_state_dict(outer)
            return
        # the layout before the outer optimizer: the Nesterov preset's momentum by name
        first.outer.state.clear()
        for n, t in (sd.get("momentum") or {}).items():
            first.outer.state[params[n]]["momentum_buffer"] = t.detach().to(params[n].device, params[n].dtype).clone()


def saved_fragments(sd):
    """F of a local-steps state ``sd``: its ``fragments``, else its list of outer states' length
    (the layout before fragments were saved), else 1."""
    outer = sd.get("outer")
    return sd.get("fragments", len(outer) if isinstance(outer, list) else 1)


def _op_name(fragment):
    """The timeline's row for a fragment's launch and landing on the training thread: its
    exchange's collective name and ``.outer`` (the collectives' own phases have the name's row,
    and spans of two threads on one row would overlap without nesting)."""
    return "%s.outer" % (getattr(fragment.exchange, "name", None) or "local_steps.f%d" % fragment.index)


def _to_cpu(obj):
    if torch.is_tensor(obj):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj


def _policy():
    """STELLA_NONFINITE now (a test may change the runtime's config between steps)."""
    return state.current().config.nonfinite


def _count_skip():
    state.current().wan_stats.add(skipped_nonfinite=1)
