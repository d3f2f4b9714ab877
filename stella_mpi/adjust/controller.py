"""The bandwidth-driven adjuster's cost model and decisions (pure: no MPI, no torch).

Every ``interval`` steps each rank contributes one telemetry row (:data:`ROW_FIELDS`, per-step
means over the window); the rows of all ranks are gathered over MPI by the session
(:mod:`.session`) and every rank feeds the same rows to its own :class:`Controller`.
The controller is deterministic given the rows, so all ranks take the same decision and apply
it at the same step, with no server.

Cost model (per optimizer step, P = backward passes per step, d = density)::

    wire(d)  = messages * latency + bytes_per_density * d / bandwidth
    sync     : step(d, P) = P * compute + fixed + wire(d)          (exchange after backward)
    overlap  : step(d, P) = max(P * compute, fixed + wire(d))       (CPU engine, staleness 1)

``fixed`` is what the step costs beyond compute and the wire (selection, merge, intra-cluster
reduction, optimizer); the constants are re-fitted from each window. ``latency`` is at least
the measured latency of a tiny message, and more when the exchange time has a part that does
not grow with the payload (fitted through windows of different payloads, see fit_overhead). The bandwidth of a
shard channel (the ranks owning the same shard in every cluster) is bytes over the *shortest*
exchange time among its members: the member that arrived last did not wait for a late peer,
so its time is the transfer itself. The bottleneck channel decides. Each estimate is the
median of the last ``window`` samples: one outlier is ignored, a step change is followed
after ``window // 2 + 1`` samples (one more to go up).

Two objectives (``Adjuster.objective``):

* ``"time_to_loss"`` (the default) picks the rung with the least predicted time per sample
  *weighted by the error-feedback backlog* it leaves: a sparse step carries less of the
  gradient than a dense one, and what it holds back waits in the residual. The measured
  residual-to-gradient norm ratio rho (per window, over all ranks) is that backlog. For a
  residual fed by gradients that are mostly noise, rho grows like sqrt((1 - d) / d) (each
  entry waits about 1/d steps), so rho(d) = kappa * sqrt((1 - d) / d), kappa fitted as the
  median over the recent windows (the last one measured is kept; 1 before any), and 0 for dense. The score of a rung::

      score(P, d) = step(d, P) / P * (1 + backlog_cost * rho(d))

  ``backlog_cost`` is the fraction of a step that one unit of rho costs in training progress,
  calibrated on the byte-level LM (bench/bench_time_to_loss.py: 0.02; with 0.03 it settled at 2-3x
  the best fixed density at 100 Mbit/s and 1 Gbit/s). Where compute dominates, the
  wire adds little and the highest density the link allows wins, up to dense; where the link is
  slow, the lower step time of a sparse rung outweighs its backlog. (On the 2-core test machine
  a dense step of the bench LM takes 2.8x a 1 % step even at 1 Gbit/s, so there it stays sparse.) Hysteresis: move only to a rung whose score is lower by ``hysteresis / 2`` or more
  (up only when two windows in a row agree, and by half a decade of density at most: the
  bandwidth measured with tiny payloads says little about a payload 1000x larger, so the link is
  measured again on the way up).
* ``"step_time"`` keeps the step within ``target`` times compute: a rung fits when the time its
  WAN payload adds to the step, ``step(d, P) - step(0, P)``, is at most ``(target - 1) * P *
  compute``: the density-independent part of the step (selection, merge, optimizer, message
  latency) is left out, since no density removes it. Hysteresis as below.

At density 1 the exchange is dense (no indices: :func:`..comm.sparse_exchange.dense_rung`); its
payload is predicted as ``bytes_per_density`` measured at the sparse rungs (for top-k's 6-byte
entries that overstates dense's 4 bytes, so the dense rung is chosen a little late, never early).

Decisions move along one ladder of rungs, from the most conservative to the most aggressive::

    (P=max_passes, min_density) ... (P=2, min_density) (P=1, min_density) ... (P=1, max_density)

(the accumulation rungs only with ``allow_accumulation``). With ``Adjuster(thc_bits=(2, 4, 8))``
THC rungs sit between the last density below 1 and dense: ``... (1, 10 %) (1, thc 2) (1, thc 4)
(1, thc 8) (1, dense)``. A THC rung sends every entry: its payload is the entries exchanged per
step on the bottleneck channel (counted) times its wire cost per entry (the lane width for the
number of clusters and the allreduce's volume, given by the session), its fixed cost is the one
measured on THC rungs (before any: the sparse route's, so the rung is tried and measured; a
measurement is forgotten after ``THC_RETRY_WINDOWS`` windows off THC rungs, doubling each time,
so one slow window on a noisy machine does not shut THC out for good), and
its backlog is ``kappa_thc / L`` (``thc_backlog_shape``), kappa_thc measured on THC rungs (1
before any). The sparse payload per unit density is taken from sparse rungs below density 1
only (a dense or THC step sends no indices). Under ``"step_time"``: the payload's share of the step over what the
target allows only grows along the ladder, so the rungs that fit the budget form a prefix and the highest
fitting rung is well defined; a lower bandwidth can only lower it (monotone). Hysteresis (on that
excess ratio): stay while the current rung fits within ``1 + hysteresis``; move up only to a
rung that fits within ``1 - hysteresis`` in two windows running; when the current rung no longer fits, drop at once to the highest
rung that fits.
"""
import math
from dataclasses import dataclass, field
from typing import Optional, Tuple

from .settings import AdjusterSettings

# One row per rank and window; the plumbing fills it in this order (one source of truth).
ROW_FIELDS = ("steps", "step_s", "compute_s", "idle_s", "optimizer_s", "cpu_s", "exchange_s", "engine_s",
              "wan_bytes", "wan_messages", "latency_s", "batch", "density", "passes", "cluster", "group",
              "residual_sq", "grad_sq", "bits", "elements", "intra_s")
F = {name: i for i, name in enumerate(ROW_FIELDS)}
HISTORY = 12   # windows kept to fit the payload-independent overhead of an exchange
THC_RETRY_WINDOWS = 60   # windows off THC rungs after which their measured fixed cost is forgotten (then 2x, 4x, ...)


def _get(row, name, default=0.0):
    """A field of a row; ``default`` for rows recorded before the field existed (shorter)."""
    i = F[name]
    return row[i] if i < len(row) else default


@dataclass(frozen=True)
class Estimate:
    """What one decision is based on (medians over the window)."""
    # (fields in the order the cost model uses them; ``backlog_kappa`` last: it has a default)
    compute_s: float            # forward + backward of one pass, slowest rank
    fixed_s: float              # step cost beyond compute and wire
    latency_s: float            # per message, payload-independent overhead included
    messages: float             # per step
    bytes_per_density: float    # wire bytes per step and unit density, bottleneck channel
    bandwidth_bps: float        # bottleneck shard channel, bits/s
    wan_bandwidth_bps: float    # all shard channels together, bits/s
    step_s: float               # measured step time
    backlog_kappa: float = 1.0  # residual-to-gradient norm ratio over sqrt((1 - d) / d)
    elements: float = 0.0       # entries exchanged per step on the bottleneck channel (THC rungs' payload)
    fixed_thc_s: Optional[float] = None   # fixed_s measured on THC rungs (None: not yet; fixed_s is used)
    backlog_kappa_thc: float = 1.0        # THC's residual-to-gradient norm ratio over 1 / L
    cpu_s: float = 0.0          # of fixed_s: selection, encoding, decoding, merge per step, slowest rank
    intra_s: float = 0.0        # the reductions inside the cluster per step (the hierarchy's stages), slowest rank


@dataclass(frozen=True)
class Decision:
    density: float
    passes: int
    batch: Optional[Tuple[int, ...]]   # samples per pass of each rank (batch_split), else None
    reason: str
    changed: bool
    estimate: Optional[Estimate] = None
    predicted_step_s: Optional[float] = None
    bits: int = 0                      # a THC rung: every entry at this many bits (density is then 1)


def _median(xs):
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def budget_move(fits, cur, pending, hysteresis):
    """The step-time objective's move along a ladder ordered from the most conservative setting
    to the most faithful (highest density; shortest period), with hysteresis h: stay while the
    current position fits within ``1 + h``; go up only to the highest position that fits within
    ``1 - h``, when two decisions running allow it (to the lower of the two); when the current
    position no longer fits, drop at once to the highest that fits (position 0 when none does).

    ``fits``: each position's ratio (<= 1: within the budget); ``pending``: the caller's list of
    up-candidates, updated in place. Returns (new position, what happened: "up", "steady",
    "down" or "none fits")."""
    h = hysteresis
    if fits[cur] <= 1.0 + h:
        up = max([i for i in range(cur + 1, len(fits)) if fits[i] <= 1.0 - h], default=cur)
        pending[:] = (pending + [up])[-2:] if up > cur else []
        new = min(pending) if len(pending) == 2 else cur
        if new > cur:
            pending[:] = []
        return new, "up" if new > cur else "steady"
    pending[:] = []
    fitting = [i for i in range(len(fits)) if fits[i] <= 1.0]
    return (max(fitting), "down") if fitting else (0, "none fits")


def sample_from_rows(rows, overlap):
    """One window's telemetry of all ranks (rows of ROW_FIELDS) -> a dict of aggregates, or
    None when there was no cross-cluster traffic to learn from."""
    compute = max(r[F["compute_s"]] / r[F["passes"]] for r in rows)   # per backward pass
    step = max(r[F["step_s"]] for r in rows)
    latency = min(r[F["latency_s"]] for r in rows)
    groups = {}
    for r in rows:
        if r[F["wan_bytes"]] > 0:
            groups.setdefault(int(r[F["group"]]), []).append(r)
    if not groups or compute <= 0:
        return None
    density = rows[0][F["density"]]
    bits = int(_get(rows[0], "bits"))
    channels = []
    for g, members in sorted(groups.items()):
        nbytes = max(m[F["wan_bytes"]] for m in members)
        msgs = max(m[F["wan_messages"]] for m in members)
        secs = min(m[F["exchange_s"]] for m in members)
        transfer = max(secs - msgs * latency, 1e-6)
        channels.append((nbytes, msgs, secs, 8.0 * nbytes / transfer, max(_get(m, "elements") for m in members)))
    nbytes, msgs, secs, bw, elements = min(channels, key=lambda c: c[3])
    if overlap:
        rest = max(r[F["engine_s"]] for r in rows) - secs
    else:
        rest = step - compute * rows[0][F["passes"]] - secs   # selection, merge, optimizer, waits
    backlog = None   # rows recorded before the norms were gathered are shorter
    if len(rows[0]) > F["grad_sq"] and (density < 1.0 or bits):
        grad = sum(r[F["grad_sq"]] for r in rows)
        res = sum(r[F["residual_sq"]] for r in rows)
        if grad > 0 and res > 0:   # no residual below density 1: no error feedback, nothing measured
            backlog = math.sqrt(res / grad)
    return {"compute_s": compute, "rest_s": max(rest, 0.0), "latency_s": latency, "messages": msgs,
            "cpu_s": max(r[F["cpu_s"]] for r in rows),
            "bytes": nbytes, "exchange_s": secs, "bytes_per_density": None if bits else nbytes / density,
            "share": bw / sum(c[3] for c in channels), "step_s": step, "density": density, "backlog": backlog,
            "bits": bits, "elements": elements, "intra_s": max(_get(r, "intra_s") for r in rows)}


def backlog_shape(density):
    """How the residual-to-gradient norm ratio grows as the density falls: sqrt((1 - d) / d)."""
    return math.sqrt(max(1.0 - density, 0.0) / density)


def thc_backlog_shape(bits):
    """THC's residual-to-gradient norm ratio, up to a factor: 1 / L, L = 2**(bits-1) - 1. With
    nearest rounding and error feedback the residual stays within half a step, scale / (2 L),
    per rotated entry; the scale is a block's largest entry, a few times the gradient's rms."""
    return 1.0 / ((1 << (int(bits) - 1)) - 1)


def fit_overhead(history, floor):
    """Per-step cost of the exchange that does not grow with the payload (message latency,
    waking up, polling): the median intercept of the lines through pairs of samples whose
    payloads differ by 1.5x or more, kept between ``floor`` (the measured latency) and 80 %
    of the fastest exchange. Without such pairs: ``floor``."""
    cuts = []
    for i, a in enumerate(history):
        for b in history[i + 1:]:
            lo, hi = (a, b) if a["bytes"] < b["bytes"] else (b, a)
            if hi["bytes"] >= 1.5 * lo["bytes"] > 0:
                slope = (hi["exchange_s"] - lo["exchange_s"]) / (hi["bytes"] - lo["bytes"])
                if slope > 0:
                    cuts.append(lo["exchange_s"] - slope * lo["bytes"])
    if not cuts:
        return floor
    return min(max(_median(cuts), floor), 0.8 * min(h["exchange_s"] for h in history))


def split_batch(global_batch, throughput, current, tolerance=0.1):
    """Samples per pass for each rank in proportion to ``throughput`` (samples/s), summing to
    ``global_batch``, at least 1 each (largest remainder). Returns ``current`` unless the new
    split shortens the slowest rank's pass by more than ``tolerance``."""
    n = len(throughput)
    if global_batch < n:
        raise ValueError("global_batch %d is smaller than the number of ranks %d" % (global_batch, n))
    tp = [max(float(t), 1e-12) for t in throughput]
    total = sum(tp)
    spare = global_batch - n
    ideal = [spare * t / total for t in tp]
    base = [int(math.floor(x)) for x in ideal]
    order = sorted(range(n), key=lambda i: (-(ideal[i] - base[i]), i))
    for i in order[:spare - sum(base)]:
        base[i] += 1
    new = tuple(b + 1 for b in base)
    if current is None:
        return new

    def slowest(split):
        return max(b / t for b, t in zip(split, tp))
    return new if slowest(new) < (1.0 - tolerance) * slowest(current) else tuple(current)


@dataclass
class Controller:
    """Deterministic decisions from gathered telemetry rows (one instance per rank).

    ``overlap``: the CPU engine with staleness 1 (communication runs beside compute).
    ``thc_bytes``: {bits: wire bytes per exchanged entry} of the THC rungs (``thc_bits``), from
    the session (lane widths and the allreduce's volume are the kernels' and the route's)."""
    settings: AdjusterSettings
    overlap: bool = False
    density: float = None
    passes: int = 1
    batch: Optional[Tuple[int, ...]] = None
    thc_bytes: dict = field(default_factory=dict)
    bits: int = 0        # 0: the sparse route at ``density``; else the THC rung of that many bits
    history: list = field(default_factory=list)
    kappa: float = 1.0   # the backlog's scale: the last one measured (1 before any)
    kappa_thc: float = 1.0   # THC's backlog over thc_backlog_shape: the last one measured (1 before any)
    _known: dict = field(default_factory=dict)   # last estimates of what only some rungs measure
    _up_candidates: list = field(default_factory=list)
    _thc_age: int = 0        # windows since a THC rung last measured its fixed cost
    _thc_retries: int = 0    # times that measurement was forgotten (the next wait doubles)
    _thc_held: int = 0       # windows in a row that measured a THC rung

    def __post_init__(self):
        s = self.settings
        self.levels = s.densities()
        if self.density is None:
            self.density = s.max_density
        self.density = min(max(self.density, s.min_density), s.max_density)
        self.passes = max(1, int(self.passes))
        missing = [b for b in s.thc_bits if b not in self.thc_bytes]
        if missing:
            raise ValueError("Controller: no wire cost for the THC rungs of %s bits" % missing)
        passes = list(range(int(s.max_backward_passes), 1, -1)) if s.allow_accumulation else []
        # rungs (passes, density, bits) from the most conservative to the most aggressive: the
        # THC rungs after the sparse densities below 1, before dense
        p1 = self.passes if self.passes > 1 and not s.allow_accumulation else 1   # the user's fixed accumulation
        sparse = [(p1, d, 0) for d in self.levels if d < 1.0]
        dense = [(p1, d, 0) for d in self.levels if d >= 1.0]
        self.rungs = [(p, self.levels[0], 0) for p in passes if p1 == 1] + sparse + \
            [(p1, 1.0, b) for b in s.thc_bits] + dense

    def _rung(self):
        """Index of the rung nearest to the current setting."""
        return min(range(len(self.rungs)), key=lambda i: (self.rungs[i][2] != self.bits,
                                                          abs(self.rungs[i][0] - self.passes),
                                                          abs(math.log(self.rungs[i][1] / self.density))))

    def estimate(self):
        """Medians over the recent windows; the payload-independent overhead is fitted over a
        longer history (it is the machine's, not the link's, so it survives a rate change)."""
        recent = self.history[-int(self.settings.window):]
        lat = _median([h["latency_s"] for h in recent])
        msgs = _median([h["messages"] for h in recent])
        overhead = fit_overhead(self.history, msgs * lat)
        bws = [8.0 * h["bytes"] / max(h["exchange_s"] - overhead, 1e-6) for h in recent]
        bw = _median(bws)
        wire_now = [overhead + 8.0 * h["bytes"] / bw for h in recent]
        fixed = [max(h["rest_s"] + h["exchange_s"] - w, 0.0) for h, w in zip(recent, wire_now)]
        kappas = [h["backlog"] / backlog_shape(h["density"]) for h in recent
                  if h.get("backlog") is not None and not h.get("bits")]
        if kappas:   # kept: at the dense rung nothing is measured, and forgetting it would oscillate
            self.kappa = _median(kappas)
        kappas = [h["backlog"] / thc_backlog_shape(h["bits"]) for h in recent
                  if h.get("backlog") is not None and h.get("bits")]
        if kappas:
            self.kappa_thc = _median(kappas)
        # what only some rungs measure is kept from the last windows that did: the sparse
        # payload per unit density (sparse rungs below 1: a dense rung sends no indices), and
        # the fixed cost of each route
        kinds = {"bytes_per_density": [h["bytes_per_density"] for h in recent
                                       if not h.get("bits") and h["density"] < 1.0],
                 "fixed_sparse": [f for h, f in zip(recent, fixed) if not h.get("bits")],
                 "fixed_thc": [f for h, f in zip(recent, fixed) if h.get("bits")]}
        for key, xs in kinds.items():
            if xs:
                self._known[key] = _median(xs)
        self._thc_age = 0 if kinds["fixed_thc"] else self._thc_age + 1
        self._thc_held = self._thc_held + 1 if kinds["fixed_thc"] else 0
        if self._thc_held >= THC_RETRY_WINDOWS:
            self._thc_retries = 0   # THC held as long as a first wait: a later slow window starts the back-off over
        if "fixed_thc" in self._known and self._thc_age >= THC_RETRY_WINDOWS << self._thc_retries:
            del self._known["fixed_thc"]   # try THC again with the sparse route's cost: it may have been noise
            self._thc_retries += 1
        bpd = self._known.get("bytes_per_density")
        if bpd is None:   # only dense samples so far
            bpd = _median([h["bytes_per_density"] for h in recent if h["bytes_per_density"] is not None] or [0.0])
        return Estimate(compute_s=_median([h["compute_s"] for h in recent]),
                        fixed_s=self._known.get("fixed_sparse", self._known.get("fixed_thc", 0.0)),
                        backlog_kappa=self.kappa,
                        latency_s=overhead / msgs if msgs else lat, messages=msgs,
                        bytes_per_density=bpd, bandwidth_bps=bw,
                        wan_bandwidth_bps=bw / _median([h["share"] for h in recent]),
                        step_s=_median([h["step_s"] for h in recent]),
                        elements=_median([h.get("elements", 0.0) for h in recent]),
                        fixed_thc_s=self._known.get("fixed_thc"), backlog_kappa_thc=self.kappa_thc,
                        cpu_s=_median([h.get("cpu_s", 0.0) for h in recent]),
                        intra_s=_median([h.get("intra_s", 0.0) for h in recent]))

    def predict(self, est, passes, density, bits=0):
        """Predicted step time of a rung: a sparse one (bits 0) by its payload per unit density,
        a THC one by its entries times their wire cost, with its own fixed cost once measured
        (before: the sparse route's, and the rung is tried to measure it)."""
        payload = self.payload(est, density, bits)
        fixed = est.fixed_thc_s if bits and est.fixed_thc_s is not None else est.fixed_s
        wire = est.messages * est.latency_s + 8.0 * payload / est.bandwidth_bps
        if self.overlap:
            return max(passes * est.compute_s, fixed + wire)
        return passes * est.compute_s + fixed + wire

    def payload(self, est, density, bits=0):
        """Wire bytes per step of a rung on the bottleneck channel: a sparse one's payload per
        unit density times its density, a THC one's entries times their wire cost."""
        return est.elements * self.thc_bytes[bits] if bits else est.bytes_per_density * density

    def backlog(self, est, density, bits=0):
        """The error-feedback backlog a rung leaves (residual-to-gradient norm ratio)."""
        if bits:
            return est.backlog_kappa_thc * thc_backlog_shape(bits)
        return est.backlog_kappa * backlog_shape(density)

    def _ratio(self, est, i):
        """Step time the rung's WAN payload adds, over what the target allows (<= 1: fits).
        What no density changes (selection, merge, optimizer, message latency) is not counted:
        when it alone breaks the target, a lower density would cost accuracy and save nothing."""
        p, d, b = self.rungs[i]
        allowed = max((self.settings.target - 1.0) * p * est.compute_s, 1e-9)
        return max(self.predict(est, p, d, b) - self.predict(est, p, 0.0), 0.0) / allowed

    def budget_density(self, est):
        """The highest sparse density whose payload fits the step-time budget (``target``) under
        ``est``, and never below the current one: how far the density warm-up may raise the
        density above the adjuster's choice."""
        fitting = [d for p, d, b in (self.rungs[i] for i in range(len(self.rungs)) if self._ratio(est, i) <= 1.0)
                   if not b and p == self.passes]
        return max(fitting + [self.density])

    def score(self, est, i):
        """The time-to-loss objective of rung ``i``: predicted seconds per sample, weighted by the
        error-feedback backlog the rung's density leaves (lower is better)."""
        p, d, b = self.rungs[i]
        return self.predict(est, p, d, b) / p * (1.0 + self.settings.backlog_cost * self.backlog(est, d, b))

    def _choose_by_score(self, est, cur):
        """The best rung overall, if it beats the current one by the dead band; up by half a
        decade at most per decision (a payload far above the measured ones is an
        extrapolation: tiny payloads say little about the bandwidth, so the link is measured on
        the way up), and only when two windows in a row agree."""
        h = self.settings.hysteresis
        scores = [self.score(est, i) for i in range(len(self.rungs))]
        best = min(range(len(self.rungs)), key=lambda i: (scores[i], -i))
        if scores[best] >= (1.0 - h / 2) * scores[cur]:
            self._up_candidates = []
            return cur, "steady"
        if best < cur:
            self._up_candidates = []
            return best, "a lower density reaches the loss sooner"
        step = max(1, int(self.settings.levels_per_decade) // 2)
        self._up_candidates = (self._up_candidates + [min(best, cur + step)])[-2:]
        if len(self._up_candidates) < 2:
            return cur, "steady"
        new = min(self._up_candidates)
        self._up_candidates = []
        return new, "a higher density reaches the loss sooner"

    def observe(self, rows):
        """Feed one window's rows (every rank's, in rank order); returns the Decision."""
        s = self.settings
        sample = sample_from_rows(rows, self.overlap)
        batch, batch_reason = self._split(rows)
        if sample is None:
            return self._decide(self.density, self.passes, batch, batch_reason or "no cross-cluster traffic yet",
                                None, None, self.bits)
        self.history = (self.history + [sample])[-max(int(s.window), HISTORY):]
        est = self.estimate()
        cur = self._rung()
        if s.objective == "step_time":
            # up only when two windows in a row allow it (a stall costs more than a lower density)
            new, moved = budget_move([self._ratio(est, i) for i in range(len(self.rungs))], cur,
                                     self._up_candidates, s.hysteresis)
            reason = {"up": "bandwidth allows more", "steady": "steady", "down": "communication exceeds the budget",
                      "none fits": "even the most conservative setting cannot hide communication"}[moved]
        else:
            new, reason = self._choose_by_score(est, cur)
        p, d, b = self.rungs[new]
        predicted = self.predict(est, p, d, b)
        why = "%s: link %.0f Mbit/s, compute %.0f ms, predicted step %.0f ms (%.2fx compute, %s)" % (
            reason, est.bandwidth_bps / 1e6, 1000 * est.compute_s, 1000 * predicted, predicted / (p * est.compute_s),
            "target %.2fx" % s.target if s.objective == "step_time" else "backlog %.2f" % self.backlog(est, d, b))
        if batch_reason:
            why += "; " + batch_reason
        return self._decide(d, p, batch, why, est, predicted, b)

    def _split(self, rows):
        s = self.settings
        if not s.batch_split:
            return None, None
        current = tuple(int(r[F["batch"]]) for r in rows)
        tp = [r[F["batch"]] * r[F["passes"]] / r[F["compute_s"]] if r[F["compute_s"]] > 0 else 0.0 for r in rows]
        if min(tp) <= 0:
            return current, None
        new = split_batch(int(s.global_batch), tp, current)
        return new, ("batch split %s by throughput" % list(new) if new != current else None)

    def _decide(self, density, passes, batch, reason, est, predicted, bits):
        changed = (density != self.density or passes != self.passes or bits != self.bits or
                   (batch is not None and batch != self.batch))
        self.density, self.passes, self.bits = density, passes, bits
        if batch is not None:
            self.batch = batch
        return Decision(density, passes, self.batch, reason, changed, est, predicted, bits)
