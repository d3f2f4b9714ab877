"""How the adjuster moves between the synchronous route and local steps
(``hvd.Adjuster(modes=("sync", "local"))``; pure: the same inputs give the same mode on every
rank).

Both modes are scored in the time-to-loss objective's unit (:mod:`.controller`): predicted
seconds per step, weighted by the gradient mass the mode holds back::

    sync     score = the controller's score of its current rung:
                     step(d) * (1 + backlog_cost * kappa * sqrt((1 - d) / d))
    local H  score = (step_local + exchange / H) * (1 + backlog_cost * (kappa * local_shape(H) + pseudo))

    local_shape(H) = (1 - 1/C) * sqrt((H - 1) / 2)

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
it for the synchronous rung of that compression (a sparse density, THC bits; none and fp16: 0).

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
  staying synchronous. H is the one the local-steps rule would choose without hysteresis
  (:func:`.local_steps_rule.smallest_fitting`).
* In local mode, every exchange: the measured compute per local step and exchange time (with
  overlap, also the wire time beyond the H steps it runs beside). The bandwidth is the
  pseudo-gradient's payload over the exchange's time (with overlap, its wire time); an
  exchange also holds the outer update, so the link is measured a little slow and sync
  predicted a little dear. It is put into the last synchronous estimate, whose rung the
  controller scores.

Hysteresis, as the controller's: the other mode is taken when its score is below ``1 - h/2``
times the current mode's, in two decisions running, and not before ``Adjuster.window`` decisions
have been taken in the current mode (the estimates then hold the current mode's measurements).
"""
import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Optional

from .controller import Controller, Estimate
from .local_steps_rule import smallest_fitting
from .settings import MODES


def local_step_time(est):
    """A local step's predicted time: what a synchronous step costs besides the WAN exchange
    and the sparse route's own CPU work (selection, encoding, decoding, merge), which local
    steps do not do: compute, the reduction inside the cluster, the optimizer."""
    return est.compute_s + max(est.fixed_s - est.cpu_s, 0.0)


def local_backlog_shape(every, nclusters):
    """The share of progress local steps hold back, in the sparse backlog's unit: the other
    clusters' share ``1 - 1/C``, for ``(H - 1) / 2`` steps on average."""
    return (1.0 - 1.0 / nclusters) * math.sqrt(max(every - 1, 0) / 2.0)


@dataclass
class ModeRule:
    """The mode decisions of one optimizer (one instance per rank, fed the same values).

    ``controller``: the synchronous route's (its current rung is scored);
    ``pseudo_backlog(est)``: the backlog the pseudo-gradient's compression leaves;
    ``payload_per_entry``: the pseudo-gradient's wire bytes per shard entry (its compression);
    ``nclusters``: C; ``link_bps``: the bandwidth of one pair of shard owners measured with
    payloads of a megabyte or more before the first step (adjust/link_probe.py), or None."""
    settings: object
    controller: Controller
    nclusters: int
    payload_per_entry: float
    pseudo_backlog: Callable
    mode: str = "sync"
    sync_estimate: Optional[Estimate] = None   # the last synchronous one (kept through local mode)
    predicted_every: Optional[int] = None      # the H local steps would start from (after_sync)
    link_bps: Optional[float] = None
    _votes: int = 0       # decisions running that favoured the other mode
    _held: int = 0        # decisions taken in the current mode

    def local_score(self, est, step_s, exchange_s, every):
        held = est.backlog_kappa * local_backlog_shape(every, self.nclusters) + self.pseudo_backlog(est)
        return (step_s + exchange_s / every) * (1.0 + self.settings.backlog_cost * held)

    def sync_score(self, est):
        """The controller's score of its current rung under ``est``."""
        return self.controller.score(est, self.controller._rung())

    def _predicted_exchange(self, est):
        """The pseudo-gradient's exchange. With the measured link: its payload at the link's
        bandwidth, the messages' latency, and the sparse route's selection, encoding, decoding
        and merge per step (``cpu_s``: the pseudo-gradient's encoding of the same shard costs
        about as much). Without:
        the current rung's predicted wire time, latency included, scaled by the payloads'
        ratio, plus the latency (the controller's bandwidth, fitted from payloads of some KB, is
        not used alone)."""
        if self.link_bps:
            return (est.messages * est.latency_s + 8.0 * est.elements * self.payload_per_entry / self.link_bps
                    + est.cpu_s)
        c = self.controller
        now = c.payload(est, c.density, c.bits)
        latency = est.messages * est.latency_s
        wire = latency + 8.0 * now / max(est.bandwidth_bps, 1.0)
        return latency + est.elements * self.payload_per_entry / max(now, 1.0) * wire

    def after_sync(self, est):
        """A synchronous decision's estimate; returns (mode, reason): "local" to switch."""
        self.sync_estimate = est
        s = self.settings
        step_local = local_step_time(est)
        exchange = self._predicted_exchange(est)
        every = self.predicted_every = smallest_fitting(s.local_steps, s.target, step_local, exchange)
        here = self.sync_score(est)
        there = self.local_score(est, step_local, exchange, every)
        link = self.link_bps or est.bandwidth_bps
        return self._vote(here, there, "local steps H=%d: predicted %.1f ms per step, exchange %.1f ms (%.0f entries "
                          "at %.0f Mbit/s); sync %.3f, local %.3f" % (every, 1e3 * step_local, 1e3 * exchange,
                                                                      est.elements, link / 1e6, here, there))

    def after_local(self, step_s, exchange_s, every, wire_s=None):
        """A local-steps decision's measured times (seconds per local step, seconds the exchange
        blocked; with overlap, its wire time from launch to arrival) at H = ``every``; returns
        (mode, reason): "sync" to switch."""
        est = self.sync_estimate
        if est is None:   # a checkpoint without one: go back to measure the synchronous route
            return self._vote(1.0, 0.0, "no estimate of the synchronous route (a checkpoint without one): it is "
                                        "measured again")
        transfer = max((wire_s if wire_s is not None else exchange_s) - est.messages * est.latency_s, 1e-6)
        if wire_s is not None:   # what is left of the wire after the H steps it overlaps
            exchange_s += max(0.0, wire_s - every * step_s)
        bandwidth = 8.0 * est.elements * self.payload_per_entry / transfer
        predicted = dataclasses.replace(est, bandwidth_bps=bandwidth)
        here = self.local_score(est, step_s, exchange_s, every)
        there = self.sync_score(predicted)
        return self._vote(here, there, "link %.0f Mbit/s measured by the exchange of local steps (H=%d, %.1f ms per "
                          "step, exchange %.1f ms); local %.3f, sync %.3f" % (bandwidth / 1e6, every, 1e3 * step_s,
                                                                            1e3 * exchange_s, here, there))

    def take(self, mode, estimate=None):
        """Take ``mode`` as it is (a checkpoint's, the root's), with the synchronous estimate
        saved with it (an Estimate, or None); the dead band starts over."""
        self.mode, self._votes, self._held = mode, 0, 0
        if estimate is not None:
            self.sync_estimate = estimate

    def saved_estimate(self):
        """The synchronous estimate as a dict (for a checkpoint), or None."""
        return dataclasses.asdict(self.sync_estimate) if self.sync_estimate is not None else None

    def _vote(self, here, there, why):
        other = MODES[1 - MODES.index(self.mode)]
        self._held += 1
        if there < (1.0 - self.settings.hysteresis / 2) * here and self._held > int(self.settings.window):
            self._votes += 1
        else:
            self._votes = 0
        if self._votes >= 2:
            self.mode, self._votes, self._held = other, 0, 0
            return other, "%s reaches the loss sooner: %s" % (other, why)
        return self.mode, "steady: %s" % why
