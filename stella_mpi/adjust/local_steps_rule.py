"""How the adjuster chooses the local steps H of ``hvd.LocalSteps`` (pure: the same inputs give
the same H on every rank).

Measured at each exchange by every rank and gathered (one small all-gather; the optimizer):

    compute_s   seconds per local step between two exchanges (forward, backward, the reduction
                inside the cluster, the update, and whatever the training loop does): the
                slowest rank's, the critical path
    exchange_s  seconds of the exchange across clusters (the pseudo-gradient's all-reduce and
                the outer update, plus the last decision's own gather): the fastest rank's,
                the one that arrived last and so waited for the wire, not for a slower cluster

The rule takes the medians of the last ``Adjuster.window`` exchanges (one noisy period, a pause
of the training loop, does not move H alone). With ``LocalSteps(overlap=True)`` the exchange runs
during the next period's H steps and only what is left of it blocks: its wire time ``wire_s``
(launch to arrival, the arrival polled once per local step; the last shard's of a cluster, the
earliest cluster's: :func:`period_times`) counts as
``max(0, wire_s - H * compute_s)``, and ``exchange_s`` is then what the boundary costs besides
(the update, the gather inside the cluster, the launch).

The step-time objective, as for densities: the exchange amortized over H steps may add at most
``(target - 1)`` times compute to a step, and the smallest H that fits is chosen (the clusters
meet as often as the budget allows: with every=1 and no compression local steps are synchronous
training)::

    ratio(H) = (exchange_s / H) / ((target - 1) * compute_s)        fits when <= 1
    (overlap: exchange_s + max(0, wire_s - H * compute_s) in place of exchange_s)

Hysteresis (``Adjuster.hysteresis`` h): stay while the current H fits within ``1 + h``; move to a
smaller H only to one that fits within ``1 - h`` in two decisions running; when the current H no
longer fits, move at once to the smallest H that fits (when none does: the largest on the ladder,
or the current H if it is larger still).
The ladder is ``Adjuster.local_steps``. A smaller H costs more exchanges; a larger one lets the
clusters drift apart for longer, which this rule does not measure: the loss is not seen, so
the time-to-loss objective is refused with local steps alone.

With ``Adjuster(modes=("sync", "local"))`` (and on the automatic route) H is chosen by the
time-to-loss objective instead (``LocalStepsRule.score``, the mode rule's score of the rung in
force: :mod:`.mode_rule`): the ladder's least score, the exchange amortized over H against the
drift and what the outer step makes of a period of H. On the byte LM the step-time budget
chose H = 2 to 16 at 1 Gbit/s, where DiLoCo's outer Nesterov needs 1.3 to 9 times the steps it
needs at H = 32 (optim/tuning.py's ``OUTER_MOMENTUM_PERIOD``).
"""
from dataclasses import dataclass, field
from typing import Callable, Optional

from .controller import _median, budget_move


def period_times(rows):
    """(compute_s, exchange_s, wire_s) of one period from every rank's gathered row (seconds:
    compute per local step, exchange, wire; then the rank's cluster):

    compute   the slowest rank's (the critical path);
    exchange  the fastest rank's: the others' also holds their wait for a slower cluster, or
              (with overlap) for a shard of their own cluster that arrived later;
    wire      a cluster's exchange has arrived when its last shard has (the largest over its
              ranks; a rank that sends no shard, off the leader in uneven clusters, measures next
              to nothing), and the cluster that launched last waited least for the others (the
              smallest over clusters)."""
    by_cluster = {}
    for r in rows:
        by_cluster[int(r[3])] = max(by_cluster.get(int(r[3]), 0.0), float(r[2]))
    return max(float(r[0]) for r in rows), min(float(r[1]) for r in rows), min(by_cluster.values())


def exchange_ratio(target, compute_s, exchange_s, every, wire_s=None):
    """The step-time objective's ratio at H = ``every`` (<= 1: fits): the exchange, plus with
    overlap what is left of the wire after the H steps it runs beside, amortized over H steps,
    over the ``(target - 1) * compute_s`` a step may add."""
    allowed = max((target - 1.0) * compute_s, 1e-9)
    return blocked_time(compute_s, exchange_s, every, wire_s) / every / allowed


def blocked_time(compute_s, exchange_s, every, wire_s=None):
    """Seconds a period of H = ``every`` steps blocks on its exchange: ``exchange_s``, plus with
    overlap what of the wire the H steps do not hide."""
    return exchange_s + (max(0.0, wire_s - every * compute_s) if wire_s is not None else 0.0)


def best_scored(ladder, score):
    """The H on ``ladder`` whose ``score(H)`` (time to the loss: lower is better) is least, the
    smaller H on a tie (the clusters meet more often)."""
    return min(sorted(ladder), key=lambda h: (score(h), h))


@dataclass
class LocalStepsRule:
    """The H decisions of one optimizer (one instance per rank, fed the same averages).

    ``score``: None, the step-time budget above; or ``score(compute_s, blocked_s, every)``, the
    time-to-loss objective's score of a period of H = ``every`` (the mode rule's, for the rung in
    force: :meth:`.mode_rule.ModeRule.period_score`), and H is the ladder's least score: the
    exchange amortized over H against what the outer step makes of a period of H (with an outer
    Nesterov, a short period is worse per step, not better: optim/tuning.py's
    ``OUTER_MOMENTUM_PERIOD``). Hysteresis as the mode rule's: another H is taken when its score is
    below ``1 - h/2`` times the current one's in two decisions running."""
    settings: object          # AdjusterSettings: target, hysteresis, window, local_steps (the ladder)
    every: int                # the current H
    score: Optional[Callable] = None
    _smaller: list = field(default_factory=list)   # the smaller H that fitted (scored: the H that won) lately
    _recent: list = field(default_factory=list)    # (compute_s, exchange_s, wire_s) of the last exchanges

    def restart(self, every):
        """Start over from H = ``every``, the past exchanges forgotten (a new phase of local
        steps: adjust/mode_rule.py)."""
        self.every, self._recent, self._smaller = every, [], []

    def ratio(self, compute_s, exchange_s, every, wire_s=None):
        return exchange_ratio(self.settings.target, compute_s, exchange_s, every, wire_s)

    def observe(self, compute_s, exchange_s, wire_s=None):
        """One exchange's measurements (``wire_s``: with overlap only); returns (H for the next
        period, reason)."""
        self._recent = (self._recent + [(compute_s, exchange_s, wire_s)])[-int(self.settings.window):]
        compute_s = _median([c for c, _, _ in self._recent])
        exchange_s = _median([x for _, x, _ in self._recent])
        wire_s = None if wire_s is None else _median([w for _, _, w in self._recent if w is not None])
        cur = self.every
        if self.score is not None:
            return self._scored(compute_s, exchange_s, wire_s)
        # the ladder from the most conservative (the longest period) to the most faithful, the
        # current H in it even when it is off the ladder (kept while it fits)
        order = sorted(set(self.settings.local_steps + (cur,)), reverse=True)
        fits = {H: self.ratio(compute_s, exchange_s, H, wire_s) for H in order}
        i, moved = budget_move([fits[H] for H in order], order.index(cur), self._smaller,
                               self.settings.hysteresis)
        new = order[i]
        reason = {"up": "the link allows more frequent exchanges", "steady": "steady",
                  "down": "the exchange exceeds the budget",
                  "none fits": "even the longest period on the ladder cannot hide the exchange"}[moved]
        self.every = new
        return new, "%s: compute %.1f ms per step, exchange %.1f ms%s, H=%d: step %.2fx compute (target %.2fx)" % (
            reason, 1e3 * compute_s, 1e3 * exchange_s, "" if wire_s is None else " (wire %.1f ms, overlapped)" %
            (1e3 * wire_s), new, 1.0 + (self.settings.target - 1.0) * fits.get(new, self.ratio(
                compute_s, exchange_s, new, wire_s)), self.settings.target)

    def _scored(self, compute_s, exchange_s, wire_s):
        """The time-to-loss choice of H (``score`` set), from the window's medians."""
        cur = self.every
        scores = {h: self.score(compute_s, blocked_time(compute_s, exchange_s, h, wire_s), h)
                  for h in set(self.settings.local_steps + (cur,))}
        best = best_scored(scores, scores.get)
        if best != cur and scores[best] < (1.0 - self.settings.hysteresis / 2) * scores[cur]:
            self._smaller = (self._smaller + [best])[-2:]
        else:
            self._smaller = []
        moved = len(self._smaller) == 2 and self._smaller[0] == self._smaller[1]
        if moved:
            self.every, self._smaller = best, []
        return self.every, "%s: compute %.1f ms per step, exchange %.1f ms%s; H=%d scores %.4f%s" % (
            "H=%d reaches the loss sooner" % best if moved else "steady", 1e3 * compute_s, 1e3 * exchange_s,
            "" if wire_s is None else " (wire %.1f ms, overlapped)" % (1e3 * wire_s), self.every, scores[self.every],
            "".join(", H=%d %.4f" % (h, scores[h]) for h in sorted(scores) if h != self.every))
