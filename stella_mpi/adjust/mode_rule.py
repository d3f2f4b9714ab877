"""How the adjuster moves between the synchronous route and local steps
(``hvd.Adjuster(modes=("sync", "local"))``; pure: the same inputs give the same mode on every
rank).

Both modes are scored in the time-to-loss objective's unit (:mod:`.controller`): predicted
seconds per step, weighted by the gradient mass the mode holds back::

    sync     score = the controller's score of its current rung:
                     step(d) * (1 + backlog_cost * kappa * sqrt((1 - d) / d))
    local H  score = (step_local + exchange / H) * (1 + backlog_cost * (kappa * local_shape(H) + pseudo))
                     * period(H)

    local_shape(H) = (1 - 1/C) * sqrt((H - 1) / 2)

``period(H)`` is the rung's outer step's own cost of a period of H (:class:`PseudoRung`): the inner
steps it needs to reach a loss at H over those at its best H. For an outer step with momentum
(the automatic route's DiLoCo Nesterov on THC) it is measured (optim/tuning.py's
``outer_period_cost``: least at H = 32, 1.33 at 16, 1.62 at 8, 9.3 at 2 on the byte LM): a short
period is worse per step, not better, and the drift alone (the shape) would send every rung to
the ladder's longest H. For averaging under an Adam-family inner optimizer (the automatic
route's THC outer step there) it is measured too and milder (``average_period_cost``: level up to
H = 16, 1.16 at 32, 1.19 at 64). Otherwise it is 1.

The sparse route holds an entry back for about 1/d steps and keeps it in the error-feedback
residual, whose norm over the gradient's grows like sqrt((1 - d) / d) (kappa is that ratio's
measured scale). Local steps hold back every entry of the other C - 1 clusters' progress, for
(H - 1) / 2 steps on average, and apply the cluster's own at once: the same shape with 1/d - 1
replaced by (H - 1) / 2 and scaled by the share held back, with the same kappa and
``backlog_cost``, so one calibration serves both. (The drift of a period is not measured: at
equal steps on the byte-level LM, local 8 and local 16 with THC 4-bit pseudo-gradients ended
0.2-0.3 % below dense on average over four seeds, where the sparse route at 1 % ended above it,
top-k with momentum correction +0.6 %, cache-aware blocks +4.8 %: bench/bench_parity.py. The
shape charges local steps less than sparse rungs of the same wait, as those numbers say.)
``pseudo`` is what the pseudo-gradient's own compression holds back, as the controller counts
it for the synchronous rung of that compression: THC bits' shape; a sparse density's shape on
a scale of its own, times ``sparse_pseudo_factor(H)``, least at H = 8 (optim/tuning.py:
calibrated on the byte LM; none and fp16: 0). Entering local steps from the synchronous route,
a rung with an ``entry_period`` (the automatic route's sparse rungs under SGD: their steps from
the start of training over THC's at H = 32, 1.31-1.65, optim/tuning.py's ``SPARSE_SUM_PERIOD``)
is charged that in place of ``pseudo`` and ``period(H)``; in local mode, one with a
``later_period`` (the same rungs' steps from step 320 of THC: 1.01-1.24 at 3 %, 1.24-1.75 at 1 %,
``SPARSE_SUM_LATER``) is charged that.

What each side is predicted from:

* In sync mode, every adjuster decision (:class:`.controller.Estimate`). A local step costs what
  a synchronous step costs besides the WAN exchange and the sparse route's own CPU work
  (:func:`local_step_time`: ``compute_s + fixed_s - cpu_s``, the reduction inside the cluster
  and the optimizer). The pseudo-gradient's exchange (its payload: the shard's entries,
  ``Estimate.elements``, times its compression's bytes per entry):

  - with the link measured before the first step (``link_bps``, adjust/link_probe.py, payloads
    of a megabyte or more: the automatic route), that payload at the link's rate, plus the
    messages' latency and ``cpu_s`` (encoding the pseudo-gradient's shard costs about what
    selecting from the gradient's does);
  - otherwise, the current rung's whole predicted wire time, latency included, scaled by the
    payloads' ratio, plus the latency. The controller's own bandwidth, fitted from payloads of
    some KB, can be off by orders of magnitude for one of some MB (measured on the byte LM at
    20 Mbit/s: 12 to 128000 Mbit/s between windows), so it is not used alone. Where latency
    makes most of the rung's wire time, this overstates the exchange and hardly follows the
    link: on the byte LM it predicted 255-260 ms at 20 Mbit/s, 100 Mbit/s and 1 Gbit/s alike,
    so local steps were entered at H=32-64 (at 1 Gbit/s the local-steps rule, measuring, went
    to H=8 three periods later).

  With ``overlap`` the whole exchange is counted, though part of it would hide: on the side of
  staying synchronous. H is the ladder's least score (the local-steps rule's choice without
  hysteresis).
* In local mode, every exchange: the measured compute per local step and exchange time (with
  overlap, also the wire time beyond the H steps it runs beside). The bandwidth is the
  pseudo-gradient's payload over the exchange's time (with overlap, its wire time); an
  exchange also holds the outer update, so the link is measured a little slow and sync
  predicted a little dear. It is put into the last synchronous estimate, whose rung the
  controller scores.

The pseudo-gradient's rung (``Adjuster(pseudo_rungs=...)``; on the automatic route THC 4 bits
and SparseLoCo's 2-bit chunked top-k at 1 % and 3 %): each rung is scored as local steps at the
H the local-steps rule would choose for its exchange, with its own backlog (``pseudo``; entering
from the synchronous route, its ``entry_period`` in place of that where it has one; in local
mode its ``later_period`` where it has one), and the
best one is the local side of the comparison. So the adjuster chooses the bits and the density
of the outer sync by the time-to-loss objective, each at its least-scored H (the local-steps
rule, fed the score of the rung in force, chooses H inside local steps the same way: without the
``period`` cost every rung went to H=64 on the byte LM and lost, docs/guides/local-steps.md): a
smaller payload lets H fall (the clusters meet more often) but holds more back. Entering local steps, the best rung is taken; in local
mode, each exchange also scores the other rungs, their exchange predicted from the measured one
(its transfer scaled by the payloads' ratio, the latency and ``cpu_s`` kept), and a rung that
wins by the dead band twice running is taken at its H. The rungs share the exchange's
collectives, so the error-feedback residual (in the entries' domain for THC and SparseLoCo)
carries over: what one rung did not send, the next sends.

The schedule of local steps (``schedules``: where every cluster has one rank, optim/tuning.py;
``Adjuster(fragments=..., max_delay=...)``): in local mode each rung is also scored under
Streaming DiLoCo's schedules, the model in F fragments exchanged in turn, each in flight for a
delay of inner steps::

    blocked(H, F, 0) = cpu + wire + (F - 1) * latency
    blocked(H, F, delay) = sum over fragments f of max(0, x_f - delay * step)
    x_f = share_f * (cpu + wire - latency) + latency
    local_shape(H, delay) = (1 - 1/C) * sqrt((H - 1) / 2 + delay)

(a delayed exchange's encoding and decoding run on the collective thread beside the steps, so
its delay hides them as it hides the wire; what they slow the steps by is measured and charged
as the schedule's overhead, below), ``share_f`` fragment f's fraction of the entries under the
balanced cut (``ModeRule.shares``: whole parameters, so uneven where a few matrices hold most of
the model), with the delay the fewest steps that hide the largest fragment's
whole exchange (:func:`delay_for`), below H/F,
and H per F the ladder's least score (a multiple of F with room for the delay). Local steps start with the
schedule the prediction scores best (on the byte LM, at 1 Gbit/s, a blocking exchange of THC
every 32 steps was predicted at 21 ms and measured at 200-300 ms of encoding, decoding and outer
step on 2 cores: from a measured blocking phase, the delayed schedule won by less than the dead
band, and the run stayed blocking); in local mode a schedule is taken from the measured phase, as
a rung is (its kind, F and whether it is delayed, is what the votes count). Under a schedule the options are
scored at the step the blocking schedule last measured (and the link read from its exchange; with
none measured since local steps were entered or taken, from the delayed wire's time, which bounds
the link's rate from below only, so no slower than the link probe's), and what the schedule cost beyond the
model (blocked time, and steps slower than that) is remembered per kind (``overheads``) and
charged to it from then on, so a schedule that does not pay is left, and tried again only
where it would win even at that cost.

An exchange in flight slows the steps beside it by its own work (encoding, decoding, the wire's
handling on the collective thread), once per period, so by less the longer H: once delayed
schedules of the rung have been measured at two H or more, every delayed option at H is scored
at ``base + per_exchange / H`` fitted to them (:func:`inflight_fit`), not at the step the current
one measured (on the byte LM with Adam, 2 clusters of 2 ranks on 2 cores, at 1 Gbit/s: 107-157 ms
a step at H=2 and 82-91 ms at H=16; scored at H=4's measured step, every H looked as slow, and
a run stayed at H=4 for 176 steps).

Hysteresis, as the controller's: the other mode (or rung, or schedule) is taken when its score is
below ``1 - h/2`` times the current one's, in two decisions running for the same side (sync, or
local steps other than the ones in force: then the second decision's best), and not before
``Adjuster.window`` decisions have been taken in the current mode and rung (the estimates then
hold their measurements).

Calibration: the schedule local steps enter with is a prediction, and on 2 cores the exchange
costs several times what it predicts (at 100 Mbit/s: 2 fragments with delay 1 predicted to hide
the exchange, measured blocking 120-290 ms a period). In the first ``CALIBRATION`` local
decisions after entering, another schedule of the same rung is taken when it scores 3 %
(``CALIBRATION_BAND``) below the one in force in two decisions running, without the dead band or
the window, whichever kind of schedule wins in each (4 fragments, and one fragment with a longer
delay, alternated there within 1 %, so votes by kind never met). Then the dead band again: the
change itself costs an exchange of every fragment (the outer momentum is kept).
"""
import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

from .controller import Controller, Estimate
from .local_steps_rule import best_scored, blocked_time


def local_step_time(est):
    """A local step's predicted time: what a synchronous step costs besides the WAN exchange
    and the sparse route's own CPU work (selection, encoding, decoding, merge), which local
    steps do not do: compute, the reduction inside the cluster, the optimizer."""
    return est.compute_s + max(est.fixed_s - est.cpu_s, 0.0)


def local_backlog_shape(every, nclusters, delay=0):
    """The share of progress local steps hold back, in the sparse backlog's unit: the other
    clusters' share ``1 - 1/C``, for ``(H - 1) / 2`` steps on average, and ``delay`` steps more
    when an exchange lands that many steps after its launch."""
    return (1.0 - 1.0 / nclusters) * math.sqrt(max(every - 1, 0) / 2.0 + delay)


@dataclass(frozen=True)
class Schedule:
    """How a phase of local steps exchanges: the model in ``fragments`` parts exchanged in turn
    (Streaming DiLoCo), each in flight for ``delay`` inner steps (0: blocking). (1, 0) is the
    whole-model blocking exchange."""
    fragments: int = 1
    delay: int = 0

    @property
    def kind(self):
        """What a vote counts and a cost is remembered by: F, and whether it is delayed (the delay
        itself follows the measured times and may move by a step between decisions)."""
        return self.fragments, self.delay > 0

    def describe(self):
        if self.delay == 0 and self.fragments == 1:
            return ""
        return ", %s%s" % ("%d fragments, " % self.fragments if self.fragments > 1 else "",
                           "delay %d" % self.delay)


BLOCKING = Schedule()


def fragment_exchanges(cpu_s, wire_s, latency_s, fragments, shares=None):
    """Seconds each of ``fragments`` fragments' exchanges takes: its share of the encoding and
    decoding (``cpu_s``) and of the wire beyond the latency (``wire_s`` is the whole model's,
    latency included), plus the latency. ``shares``: each fragment's fraction of the model's
    entries (the balanced cut holds whole parameters, so a model of a few large matrices is cut
    unevenly: the byte LM's 4 fragments hold 45 %, 0 %, 44 % and 11 %); None: 1/F each."""
    shares = shares or (1.0 / fragments,) * fragments
    moved = max(cpu_s + wire_s - latency_s, 0.0)
    return [share * moved + latency_s for share in shares]


def scheduled_exchange(cpu_s, wire_s, latency_s, step_s, schedule, shares=None):
    """Seconds a period of H steps blocks on its exchanges under ``schedule``: without
    a delay, the encoding and decoding (``cpu_s``, the whole model's, whichever the cut) and the
    wire (``wire_s``, the whole model's, plus ``latency_s`` for each further fragment); with one,
    what of each fragment's exchange (:func:`fragment_exchanges`, by its ``shares``) the
    ``delay`` inner steps it runs beside do not hide (they run on the collective thread: on an
    H200 a delay covering both left 0.7-1.2 ms of wait per landing, docs/guides/local-steps.md)."""
    if schedule.delay == 0:
        return cpu_s + wire_s + (schedule.fragments - 1) * latency_s
    return sum(max(0.0, x - schedule.delay * step_s)
               for x in fragment_exchanges(cpu_s, wire_s, latency_s, schedule.fragments, shares))


def delay_for(every, fragments, max_delay, wire_s, latency_s, step_s, cpu_s=0.0, shares=None):
    """The delay the adjuster gives F = ``fragments`` at H = ``every``: the fewest inner steps
    that hide the largest fragment's exchange (at least 1), at most ``max_delay`` and below H/F
    (a fragment lands before the next one is launched). The exchange is the fragment's share
    (``shares``, :func:`fragment_exchanges`) of the wire and of ``cpu_s``, the encoding and
    decoding, which run on the collective thread beside the steps too: on an H200 a fragment
    given steps for its wire alone still blocked 9 ms of its 20 at each landing
    (docs/guides/local-steps.md)."""
    per_fragment = max(fragment_exchanges(cpu_s, wire_s, latency_s, fragments, shares))
    need = max(1, int(math.ceil(per_fragment / max(step_s, 1e-9) - 1e-9)))
    return min(need, int(max_delay), every // fragments - 1)


def inflight_fit(paced):
    """``(base_s, per_exchange_s)``: the seconds per step with no exchange in flight, and what
    each period's exchange adds to the steps beside it, fitted as ``step = base + per_exchange /
    H`` by least squares to ``paced`` (H -> seconds per step measured under a delayed schedule);
    None with fewer than two H, or where the steps were not slower at the shorter H (nothing
    to fit: the options keep the measured step)."""
    if len(paced) < 2:
        return None
    xs = [1.0 / h for h in paced]
    ys = list(paced.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    per_exchange = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    base = my - per_exchange * mx
    if per_exchange <= 0.0 or base <= 0.0:
        return None
    return base, per_exchange


def in_flight_scaled(step_s, steady_s, overhead, fit, ratio):
    """``(step_s, overhead, fit)`` for another rung, from those measured under a schedule of
    this one (:meth:`ModeRule.after_local`): what this rung's exchange in flight added to the
    steps beside it (the cores, the collective thread and the link's forwarder it shares with
    them) scaled by ``ratio``, the other's payload over this one's, at most 1. Added: the step
    above ``steady_s`` (the cycle's median step, the largest over ranks; most steps of a cycle
    see no landing; None: not measured, nothing scaled), the overhead's slowdown of each step,
    and the fit's per-exchange term. On 2 cores at 20 Mbit/s THC's delayed fragments measured
    94 ms per step against a median of 61, where SparseLoCo's stepped at 55-69 ms."""
    ratio = min(max(ratio, 0.0), 1.0)
    if steady_s is not None and 0.0 < steady_s < step_s:
        step_s = steady_s + (step_s - steady_s) * ratio
    if overhead is not None:
        overhead = (overhead[0], overhead[1] * ratio)
    if fit is not None:
        fit = (fit[0], fit[1] * ratio)
    return step_s, overhead, fit


@dataclass(frozen=True)
class PseudoRung:
    """One compression the pseudo-gradient may cross the WAN with (``Adjuster(pseudo_rungs=...)``).

    ``name``: as the logs write it; ``payload_per_entry``: wire bytes one rank sends per shard
    entry; ``backlog(est, every)``: what it holds back at H = ``every``, in the controller's unit (the backlog the
    synchronous rung of that compression leaves: a sparse density's, THC bits'); ``period(every)``:
    the inner steps the rung's outer step needs at H = ``every`` to reach a loss, over what it
    needs at its best H (1 there; None: 1 at every H; optim/tuning.py's ``outer_period_cost`` for
    an outer step with momentum), a factor of the score. ``entry_period(every)``: where set, what
    the rung costs as local steps are entered from the synchronous route, in place of its backlog
    and period: the steps it needs at H = ``every`` from the start of training over those of the
    route's THC rung at H = 32 (optim/tuning.py's ``sparse_period_cost``: measured from scratch,
    it over-charges a sparse rung later in training). ``later_period(every)``: where set, the
    same in local mode, as measured later in training (optim/tuning.py's ``SPARSE_SUM_LATER``)."""
    name: str
    payload_per_entry: float
    backlog: Callable
    period: Callable = None   # every -> the steps the outer step needs at that H, over its best H's (None: 1)
    entry_period: Callable = None   # every -> as entered from the synchronous route (None: backlog and period)
    later_period: Callable = None   # every -> in local mode (None: backlog and period)


@dataclass(frozen=True)
class LocalOption:
    """Local steps with pseudo rung ``rung`` at H = ``every`` under ``schedule``: the predicted
    seconds the exchange blocks per period, and the score."""
    rung: int
    every: int
    exchange_s: float
    score: float
    schedule: Schedule = BLOCKING


@dataclass
class ModeRule:
    """The mode decisions of one optimizer (one instance per rank, fed the same values), and in
    local mode the pseudo-gradient's rung.

    ``controller``: the synchronous route's (its current rung is scored);
    ``nclusters``: C; ``pseudo``: the pseudo-gradient's rungs (:class:`PseudoRung`; one when it
    is not chosen), ``pseudo_index`` the current one; ``link_bps``: the bandwidth of one pair of
    shard owners measured with payloads of a megabyte or more before the first step
    (adjust/link_probe.py), or None."""
    settings: object
    controller: Controller
    nclusters: int
    pseudo: Tuple[PseudoRung, ...]
    mode: str = "sync"
    sync_estimate: Optional[Estimate] = None   # the last synchronous one (kept through local mode)
    predicted_every: Optional[int] = None      # the H local steps would start from (after_sync, a rung change)
    pseudo_index: int = 0
    link_bps: Optional[float] = None
    schedules: bool = False                    # whether F and the delay are chosen (optim/tuning.py)
    predicted_schedule: Schedule = BLOCKING    # the one local steps would start with
    # a local step's seconds under that option (after_sync): local_step_time and the seconds its
    # exchange blocks a period, over H
    predicted_step_s: Optional[float] = None
    # per schedule kind (F, delayed), what its last phase cost beyond the model's prediction
    # (after_local): (seconds blocked per landing, seconds per step slower than the blocking
    # schedule's), charged to that kind's predictions from then on
    overheads: dict = dataclasses.field(default_factory=dict)
    # per F, each fragment's fraction of the model's entries under the adjuster's cut (missing:
    # 1/F each): the delay must hide the largest fragment's exchange
    shares: dict = dataclasses.field(default_factory=dict)
    # (seconds per local step, transfer seconds, payload per entry) last measured under the
    # blocking schedule: under another schedule every option is predicted from them (its exchange
    # in flight may slow the steps beside it and its own wire: that is its overhead)
    base: Optional[tuple] = None
    # per H, the seconds per step last measured under a delayed schedule of the current rung (the
    # exchange in flight beside the steps): what :func:`inflight_fit` scores delayed options by
    paced: dict = dataclasses.field(default_factory=dict)
    _votes: int = 0       # decisions running that favoured the same side (_vote)
    _held: int = 0        # decisions taken in the current mode (and rung)
    _candidate: object = None   # that side: "sync", or "local" (another rung or schedule)
    # local decisions left in which the schedule entered from a prediction may be corrected from
    # the measured one without the dead band (after_local: CALIBRATION)
    _calibrating: int = 0
    # whether a local phase was measured since the rule started or took a mode (after_local):
    # until then local steps are entered without the dead band (after_sync)
    _measured_local: bool = False

    def __post_init__(self):
        self.pseudo = tuple(self.pseudo)
        if not self.pseudo:
            raise ValueError("ModeRule: at least one pseudo-gradient rung")

    @property
    def rung(self):
        return self.pseudo[self.pseudo_index]

    def local_score(self, est, step_s, exchange_s, every, rung=None, delay=0, entering=False):
        """The score of local steps through ``rung`` (default: the current one) at H = ``every``;
        ``entering``: as entered from the synchronous route, a rung's ``entry_period`` in place of
        its backlog and period cost where it has one; otherwise its ``later_period`` where it has
        one."""
        r = self.rung if rung is None else self.pseudo[rung]
        held = est.backlog_kappa * local_backlog_shape(every, self.nclusters, delay)
        measured = r.entry_period if entering else r.later_period
        if measured is not None:
            period = measured(every)
        else:
            held += r.backlog(est, every)
            period = r.period(every) if r.period is not None else 1.0
        return (step_s + exchange_s / every) * (1.0 + self.settings.backlog_cost * held) * period

    def sync_score(self, est):
        """The controller's score of its current rung under ``est``."""
        return self.controller.score(est, self.controller._rung())

    def _predicted_exchange(self, est, rung=None):
        """The pseudo-gradient's exchange through rung ``rung`` (default: the current one). With
        the measured link: its payload at the link's bandwidth, the messages' latency, and the
        sparse route's selection, encoding, decoding and merge per step (``cpu_s``: the
        pseudo-gradient's encoding of the same shard costs about as much). Without:
        the current rung's predicted wire time, latency included, scaled by the payloads'
        ratio, plus the latency (the controller's bandwidth, fitted from payloads of some KB, is
        not used alone)."""
        per_entry = (self.rung if rung is None else self.pseudo[rung]).payload_per_entry
        if self.link_bps:
            return (est.messages * est.latency_s + 8.0 * est.elements * per_entry / self.link_bps
                    + est.cpu_s)
        c = self.controller
        now = c.payload(est, c.density, c.bits)
        latency = est.messages * est.latency_s
        wire = latency + 8.0 * now / max(est.bandwidth_bps, 1.0)
        return latency + est.elements * per_entry / max(now, 1.0) * wire

    def period_score(self):
        """The score of a period of the current rung, ``(compute_s, blocked_s, every) -> score``
        (the local-steps rule's H by time to loss: :class:`.local_steps_rule.LocalStepsRule`), or
        None without a synchronous estimate (a checkpoint without one: H by the step-time budget
        until there is one)."""
        est = self.sync_estimate
        if est is None:
            return None
        return lambda compute_s, blocked_s, every: self.local_score(est, compute_s, blocked_s, every)

    def _option(self, est, rung, step_s, exchange_s, wire_s=None, every=None, entering=False):
        """Local steps through ``rung``: at H = ``every``, or the H the local-steps rule would
        choose without hysteresis (the ladder's least score; ``entering``: of the score as entered
        from the synchronous route, :meth:`local_score`)."""
        if every is None:
            every = best_scored(self.settings.local_steps, lambda h: self.local_score(
                est, step_s, blocked_time(step_s, exchange_s, h, wire_s), h, rung, entering=entering))
        blocked = blocked_time(step_s, exchange_s, every, wire_s)
        return LocalOption(rung, every, blocked, self.local_score(est, step_s, blocked, every, rung, entering=entering))

    def _schedules(self, est, rung, step_s, cpu_s, wire_s, blocking, overhead=None, fit=None, entering=False):
        """The options of rung ``rung`` under each schedule: ``blocking`` (the whole-model
        blocking one's), then per F on ``Adjuster.fragments`` (with ``schedules`` and a
        ``max_delay``) the smallest H on the ladder, a multiple of F with room for a delay, whose
        blocked time fits the budget (the largest such H when none does), at the delay that
        hides one fragment's exchange (:func:`delay_for`). What that kind of schedule cost beyond
        the model when it last ran (``overheads``; else ``overhead``, the current schedule's, in
        local steps; else nothing) is charged: the blocked seconds of each of its F landings,
        and the slowdown of each step; with ``fit`` (:func:`inflight_fit`), each step at H is
        ``base + per_exchange / H`` instead."""
        s = self.settings
        options = [blocking]
        if not self.schedules or int(s.max_delay) < 1:
            return options
        latency = est.messages * est.latency_s
        for f in s.fragments:
            per_landing, slower = self.overheads.get((f, True), overhead or (0.0, 0.0))
            scored = []
            for h in [h for h in s.local_steps if h % f == 0 and h // f >= 2]:
                step = fit[0] + fit[1] / h if fit is not None else step_s + slower
                shares = self.shares.get(f)
                sched = Schedule(f, delay_for(h, f, s.max_delay, wire_s, latency, step, cpu_s, shares))
                blocked = scheduled_exchange(cpu_s, wire_s, latency, step, sched, shares) + f * per_landing
                scored.append(LocalOption(rung, h, blocked, self.local_score(est, step, blocked, h, rung, sched.delay,
                                                                             entering=entering),
                                          sched))
            if scored:
                options.append(min(scored, key=lambda o: (o.score, o.every)))
        return options

    def _best(self, options):
        """The best option, the current rung's on a tie (then the smaller payload)."""
        return min(options, key=lambda o: (o.score, o.rung != self.pseudo_index,
                                           self.pseudo[o.rung].payload_per_entry))

    def after_sync(self, est):
        """A synchronous decision's estimate; returns (mode, reason): "local" to switch (at
        ``predicted_every`` through rung ``pseudo_index``)."""
        self.sync_estimate = est
        step_local = local_step_time(est)
        # each rung at its best schedule as predicted (with ``schedules``: fragments in flight beside
        # the steps; what a schedule costs beyond the model is measured in the local phase, and
        # after_local goes back to the blocking exchange if it does not pay)
        options = []
        for i in range(len(self.pseudo)):
            x = self._predicted_exchange(est, i)
            options.append(self._best(self._schedules(est, i, step_local, est.cpu_s, max(x - est.cpu_s, 0.0),
                                                      self._option(est, i, step_local, x, entering=True),
                                                      entering=True)))
        best = self._best(options)
        here = self.sync_score(est)
        link = self.link_bps or est.bandwidth_bps
        why = "local steps H=%d%s, pseudo-gradient %s: predicted %.1f ms per step, exchange %.1f ms (%.0f entries " \
              "at %.0f Mbit/s); sync %.3f, local %.3f%s" % (
                  best.every, best.schedule.describe(), self.pseudo[best.rung].name, 1e3 * step_local,
                  1e3 * best.exchange_s, est.elements, link / 1e6, here, best.score,
                  "".join(", %s H=%d%s %.3f" % (self.pseudo[o.rung].name, o.every, o.schedule.describe(), o.score)
                          for o in options if o is not best))
        # the first entry waives the dead band (two votes running are still needed): a local step
        # is predicted with every wait of the synchronous step but its wire and its CPU work, an
        # upper bound (on the byte LM, 2 clusters of 2 ranks: 87 ms predicted, 61 ms measured
        # with SGD inside; 153 against 85 with Adam, whose step of 45-70 ms on both sides kept
        # local steps inside the band for 130 steps), and the first periods measure it: after_local
        # goes back past the band when sync is cheaper
        mode, reason, taken = self._vote(here, best.score, _key(best), why,
                                         band=None if self._measured_local else 0.0, wait=True)
        if taken:
            self.pseudo_index = best.rung
            self._calibrating = CALIBRATION if self.schedules else 0
        self.predicted_every, self.predicted_schedule = best.every, best.schedule
        self.predicted_step_s = step_local + best.exchange_s / best.every
        return mode, reason

    def after_local(self, step_s, exchange_s, every, wire_s=None, schedule=BLOCKING, steady_s=None):
        """A local-steps decision's measured times (seconds per local step, seconds the exchange
        blocked; with overlap, its wire time from launch to arrival; under a schedule of
        fragments or a delay, the seconds its launches and landings blocked per period and the
        wire time of its exchanges, summed) at H = ``every`` through the current rung; returns
        (mode, reason): "sync" to switch. When another pseudo rung, or with ``schedules``
        another schedule, is predicted to reach the loss sooner (twice running, past the dead
        band; in the first ``CALIBRATION`` decisions after entering, another schedule of this
        rung past ``CALIBRATION_BAND``), the rule takes it: ``pseudo_index``, ``predicted_every``
        and ``predicted_schedule`` change, the mode stays "local".

        The other rungs' exchange is this one's with the transfer scaled by their payloads' ratio:
        ``latency + cpu + transfer * payload_j / payload_now``, where the transfer is what the
        measured exchange (with overlap or a schedule, the wire) spent beyond the latency (one
        per fragment) and ``cpu_s``. Under a schedule the link and the options are predicted from
        the step and transfer last measured under the blocking one (``base``; with none, from
        the wire, read no slower than the link probe's ``link_bps``), and what the
        schedule cost beyond the model, in blocked time and in steps slower than that (its
        exchange in flight shares the collective thread and the cores with the steps beside
        it), is its kind's overhead. Another rung's steps under a schedule are this one's with
        what its exchange in flight added scaled by the payloads' ratio (:func:`in_flight_scaled`,
        from ``steady_s``, the cycle's median step; a smaller payload adds less, a larger one is
        charged no more than this one's)."""
        est = self.sync_estimate
        self._measured_local = True
        if est is None:   # a checkpoint without one: go back to measure the synchronous route
            return self._vote(1.0, 0.0, "sync", "no estimate of the synchronous route (a checkpoint without one): it "
                                                "is measured again")[:2]
        streaming = schedule != BLOCKING
        latency = est.messages * est.latency_s
        measured = wire_s if wire_s is not None else exchange_s
        transfer = max(measured - schedule.fragments * latency, 1e-6)
        if not streaming and wire_s is None:   # the blocking schedule: the baseline of the others
            self.base = (step_s, transfer, self.rung.payload_per_entry)
        base, source = step_s, "measured by the exchange of local steps"
        if streaming and self.base is not None:
            # a schedule's wire holds its wait on the collective thread and the cores it shares with
            # the steps beside it: the link and every option are predicted from the blocking
            # schedule's last measured exchange (scaled to this rung's payload) and step
            base, transfer_then, payload_then = self.base
            transfer = transfer_then * self.rung.payload_per_entry / max(payload_then, 1e-12)
            source = "measured by the blocking exchange of local steps"
        elif streaming and self.link_bps:
            # no blocking exchange measured since local steps were entered (under a delayed schedule):
            # the wire's time bounds the link's rate from below only (on the byte LM on 2 cores, with
            # Adam, a 1 Gbit/s link read 13-43 Mbit/s so), and the link probe's rate, where higher,
            # is taken (a link slower than the probe's shows in the blocked time measured)
            probed = self._predicted_exchange(est) - latency   # (what after_sync predicted, less the latency)
            if probed < transfer:
                transfer, source = probed, "as probed before the first step (a delayed exchange's wire read %.0f " \
                                           "Mbit/s)" % (
                    8e-6 * est.elements * self.rung.payload_per_entry / max(transfer - est.cpu_s, 1e-6))
        moved = max(transfer - est.cpu_s, 1e-6)   # the part that grows with the payload
        # the wire's rate: the sync route's prediction counts cpu_s in its fixed cost already
        # (with it here, a 1 Gbit/s link on a GPU read as 99 Mbit/s and sync's wire was overcounted)
        bandwidth = 8.0 * est.elements * self.rung.payload_per_entry / moved
        predicted = dataclasses.replace(est, bandwidth_bps=bandwidth)
        if streaming:   # what the schedule blocked, as measured
            now = LocalOption(self.pseudo_index, every, exchange_s,
                              self.local_score(est, step_s, exchange_s, every, None, schedule.delay), schedule)
        else:
            now = self._option(est, self.pseudo_index, step_s, exchange_s, wire_s, every)
        overlap = wire_s is not None and not streaming
        overhead = None   # (seconds blocked per landing, seconds per step)
        if streaming:   # beyond the model: blocked longer, and the steps slower than the blocking schedule's
            modelled = scheduled_exchange(est.cpu_s, latency + moved, latency, base, schedule,
                                          self.shares.get(schedule.fragments))
            overhead = (max(0.0, exchange_s - modelled) / schedule.fragments,
                        max(0.0, step_s - base))
            self.overheads[schedule.kind] = overhead
        # the options' step: a delayed one's fitted over the H measured (when there are two), the
        # blocking one's as measured, else the fit's step with nothing in flight
        fit, scored = None, base
        if streaming:
            self.paced[every] = step_s
            fit = inflight_fit(self.paced)
            if fit is not None and self.base is None:
                scored = fit[0]
        others = []
        for j, r in enumerate(self.pseudo):
            ratio = r.payload_per_entry / max(self.rung.payload_per_entry, 1e-12)
            wire_j = latency + moved * ratio
            if overlap:
                if j != self.pseudo_index:
                    others.append(self._option(est, j, step_s, exchange_s, wire_j + est.cpu_s))
                continue
            step_j, overhead_j, fit_j = scored, overhead, fit
            if streaming and j != self.pseudo_index:
                # (the median stands for the step only where the step scored is this schedule's own:
                # a blocking exchange's step, or the fit's, had nothing in flight to scale)
                own = self.base is None and fit is None
                step_j, overhead_j, fit_j = in_flight_scaled(scored, steady_s if own else None, overhead, fit, ratio)
            options = self._schedules(est, j, step_j, est.cpu_s, wire_j,
                                      self._option(est, j, step_j, wire_j + est.cpu_s), overhead_j, fit_j)
            if j == self.pseudo_index:   # this rung under another kind of schedule
                options = [o for o in options if o.schedule.kind != schedule.kind]
            if options:
                others.append(self._best(options))
        sync = self.sync_score(predicted)
        there, target, best = sync, "sync", None
        if others:
            best = self._best(others)
            if best.score < sync:
                there, target = best.score, _key(best)
        band = None
        if self._calibrating:
            self._calibrating -= 1
            if best is not None and target != "sync" and best.rung == self.pseudo_index:
                # the schedule in force was entered from a prediction (after_sync's, which misses
                # what the exchange costs on these cores: docs/guides/local-steps.md): the first
                # measured periods correct it with a narrow band, whichever kind wins each time
                target, band = ("local", self.pseudo_index, "schedule"), CALIBRATION_BAND
        why = "link %.0f Mbit/s %s beyond its %.1f ms of encoding (H=%d%s, " \
              "%s, %.1f ms per step%s, exchange %.1f ms); local %.3f, sync %.3f%s" % (
                  bandwidth / 1e6, source, 1e3 * est.cpu_s, every, schedule.describe(), self.rung.name, 1e3 * step_s,
                  " (median %.1f)" % (1e3 * steady_s) if streaming and steady_s else "", 1e3 * now.exchange_s,
                  now.score, sync, "".join(", %s H=%d%s %.3f" % (self.pseudo[o.rung].name, o.every,
                                                                  o.schedule.describe(), o.score) for o in others))
        mode, reason, taken = self._vote(now.score, there, target, why, band)
        if taken and target != "sync":
            if best.rung != self.pseudo_index:   # another rung's exchange costs the steps its own
                self.paced = {}
            self.pseudo_index, self.predicted_every, self.predicted_schedule = best.rung, best.every, best.schedule
        if taken:
            self._calibrating = 0
        return mode, reason

    def take(self, mode, estimate=None, pseudo_index=None, schedule=None, recalibrate=False):
        """Take ``mode`` as it is (a checkpoint's, the root's), with the synchronous estimate
        saved with it (an Estimate, or None), the pseudo rung and the schedule; the dead band
        starts over. ``recalibrate``: local steps go on where the steps' cost changed (each rank
        made a replica): with ``schedules``, the first ``CALIBRATION`` measured decisions may
        correct the schedule in force as after entering."""
        self.mode, self._votes, self._held, self._candidate = mode, 0, 0, None
        self._calibrating = CALIBRATION if recalibrate and mode == "local" and self.schedules else 0
        self._measured_local = False
        # what schedules cost is measured again (a rank that joins, elastic, starts without it)
        self.overheads, self.base, self.paced = {}, None, {}
        if schedule is not None:
            self.predicted_schedule = schedule
        if estimate is not None:
            self.sync_estimate = estimate
        if pseudo_index is not None:
            self.pseudo_index = int(pseudo_index)

    def saved_estimate(self):
        """The synchronous estimate as a dict (for a checkpoint), or None."""
        return dataclasses.asdict(self.sync_estimate) if self.sync_estimate is not None else None

    def _vote(self, here, there, target, why, band=None, wait=None):
        """One decision: ``target`` ("sync", or ("local", rung, ...)) is taken when its score is
        below ``1 - h/2`` times the current choice's in two decisions running for the same side
        (sync, or local steps under another rung or schedule: the second decision's best is
        taken), and not before ``Adjuster.window`` decisions in the current mode and rung.
        ``band``: a dead band of its own (the calibration's, the first entry's), and, unless
        ``wait``, no wait for the window. Returns (mode, reason, whether the target was taken).

        (Votes counted per rung and schedule never met where two options scored within a few %
        of each other, each best in turn: on the byte LM at 20 Mbit/s, SparseLoCo 1 % at H=16
        and 3 % at H=32-64 alternated 13-25 % below THC's delayed fragments in force, whose
        landings blocked 460-510 ms a period, and the route stayed there from step 48 to the
        end of the run, step 433.)"""
        self._held += 1
        wait = band is None if wait is None else wait
        ready = self._held > int(self.settings.window) or not wait
        band = self.settings.hysteresis / 2 if band is None else band
        side = "sync" if target == "sync" else "local"
        if there < (1.0 - band) * here and ready:
            self._votes = self._votes + 1 if side == self._candidate else 1
            self._candidate = side
        else:
            self._votes, self._candidate = 0, None
        if self._votes < 2:
            return self.mode, "steady: %s" % why, False
        self._votes, self._held, self._candidate = 0, 0, None
        if target == "sync":
            self.mode = "sync"
            return "sync", "sync reaches the loss sooner: %s" % why, True
        if self.mode == "sync":
            self.mode = "local"
            return "local", "local reaches the loss sooner: %s" % why, True
        if target[2:] == ("schedule",):
            return "local", "the measured exchange calls for another schedule: %s" % why, True
        return "local", "local steps through %s%s reach the loss sooner: %s" % (
            self.pseudo[target[1]].name, "" if target[2:] == (1, False) else " (%d fragments%s)" % (
                target[2], ", delayed" if target[3] else ""), why), True


# the local decisions after entering local steps with a schedule in which a better-scored
# schedule of the same rung is taken with a narrow band of its own instead of the dead band (two
# decisions running, whichever kind wins in each); then the dead band again
CALIBRATION = 4
CALIBRATION_BAND = 0.03   # (a gain below it does not pay for the change's exchange of every fragment)


def _key(option):
    """What a vote for ``option`` is for: its rung and its schedule's kind."""
    return ("local", option.rung) + option.schedule.kind
