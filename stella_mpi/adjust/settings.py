"""The adjuster's settings: what the user asks of it (``hvd.Adjuster``)."""
import math
from dataclasses import dataclass
from typing import Optional, Tuple


MODES = ("sync", "local")   # the routes Adjuster(modes=...) moves between (adjust/mode_rule.py)


def _ladder(values, lo, hi, empty_ok, what):
    """``values`` sorted into a tuple: distinct ints (not bools) in [lo, hi] (hi None: no bound),
    at least one unless ``empty_ok``; else ValueError "Adjuster: <what>, got <values>"."""
    if not isinstance(values, (tuple, list)) or (not values and not empty_ok) or len(set(values)) != len(values) or \
            any(isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi) for v in values):
        raise ValueError("Adjuster: %s, got %r" % (what, values))
    return tuple(sorted(values))


@dataclass(frozen=True)
class AdjusterSettings:
    """What the user asks of the adjuster, passed to DistributedOptimizer (public name
    ``hvd.Adjuster``: the settings; :class:`.controller.Controller` takes the decisions).

    min_density, max_density: bounds of the density of the cross-cluster exchange (1: dense,
        sent without indices).
    objective: "time_to_loss" (default: the least time per sample weighted by the
        error-feedback backlog, see :mod:`.controller`) or "step_time" (keep the step within
        ``target`` times compute).
    target: "step_time", and the choice of local steps' H without ``modes``: allowed step time as
        a multiple of compute time (forward + backward), > 1. (Under ``modes``, and on the
        automatic route, H is chosen by the time-to-loss objective: :mod:`.local_steps_rule`.)
    backlog_cost: "time_to_loss" only: the share of a step's progress one unit of the
        residual-to-gradient norm ratio costs (calibrated on the byte-level LM).
    allow_accumulation: when even ``min_density`` cannot be hidden, raise
        backward_passes_per_step up to ``max_backward_passes`` (changes the effective batch:
        see DistributedOptimizer's docstring for the learning-rate rule).
    batch_split: split ``global_batch`` samples per pass over the ranks in proportion to their
        measured throughput (``opt.local_batch_size()``), for clusters of unequal speed.
    interval: steps per telemetry window (one small MPI all-gather per window).
    window: windows whose median makes an estimate.
    hysteresis: half-width of the dead band around the budget (a fraction).
    levels_per_decade: density levels between min and max (geometric).
    thc_bits: THC rungs offered besides the densities, e.g. (2, 4, 8): the exchange then sends
        every entry at that many bits, summed on the wire (``hvd.Compression.thc``; its
        defaults otherwise). They sit on the ladder after the sparse densities below 1 and
        before dense. Empty (the default): densities only. Time-to-loss objective only.
    local_steps: the ladder of local steps H the adjuster chooses from for an optimizer with
        ``local_steps=hvd.LocalSteps(...)`` (by ``target`` with the step-time objective, by time
        to loss under ``modes``: see :mod:`.local_steps_rule`); unused otherwise.
    modes: ("sync", "local") lets the adjuster move between the synchronous route (its
        densities and THC rungs) and local steps (its H ladder), on every rank at the same step
        (:mod:`.mode_rule`), by the time-to-loss objective. The automatic route (a job across
        clusters that names no stella compressor: optim/tuning.py) always does. Otherwise pass a
        sparse ``compression`` (the synchronous route's) and optionally
        ``local_steps=hvd.LocalSteps(...)`` (default: 4-bit THC pseudo-gradients). Empty (the
        default): the optimizer's one mode.
    pseudo_rungs: with ``modes`` (or on the automatic route), the compressions the adjuster
        chooses between for the pseudo-gradient of local steps, with H, by the time-to-loss
        objective (:mod:`.mode_rule`): THC (``hvd.Compression.thc(bits=...)``) or sparse ones
        (``hvd.Compression.sparseloco(density, bits=...)``, ``topk``, ...) whose residual lives in
        the entries' domain (not ``dct``). Empty (the default): the automatic route's
        (``optim/tuning.py``: THC 4 bits, SparseLoCo 1 % and 3 % at 2 bits), otherwise
        ``LocalSteps(compression=...)`` alone.
    fragments, max_delay: with ``modes`` (or on the automatic route), the schedules the adjuster
        chooses between for each phase of local steps, with H and the rung, by the time-to-loss
        objective (:mod:`.mode_rule`): the model in F fragments (F from ``fragments``) exchanged in
        turn, each in flight for the fewest inner steps that hide its exchange (at most
        ``max_delay``), its landing keeping the cluster's progress meanwhile (``LocalSteps(mix=
        "progress")``); or the whole model exchanged blocking. ``max_delay=0``: blocking only.
        Not with ``LocalSteps(overlap=True)`` or ``pace="time"`` (they are schedules of their own).
    """
    min_density: float = 1e-3
    max_density: float = 1.0
    objective: str = "time_to_loss"
    target: float = 1.2
    backlog_cost: float = 0.02
    allow_accumulation: bool = False
    max_backward_passes: int = 8
    batch_split: bool = False
    global_batch: Optional[int] = None
    interval: int = 2
    window: int = 3
    hysteresis: float = 0.25
    levels_per_decade: int = 6
    thc_bits: Tuple[int, ...] = ()
    local_steps: Tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    modes: Tuple[str, ...] = ()
    pseudo_rungs: Tuple[object, ...] = ()
    fragments: Tuple[int, ...] = (1, 2, 4)
    max_delay: int = 4

    def __post_init__(self):
        for name in ("min_density", "max_density"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not (0.0 < v <= 1.0):
                raise ValueError("Adjuster: %s must be in (0, 1], got %r" % (name, v))
        if self.min_density > self.max_density:
            raise ValueError("Adjuster: min_density (%g) is larger than max_density (%g)"
                             % (self.min_density, self.max_density))
        if self.objective not in ("time_to_loss", "step_time"):
            raise ValueError("Adjuster: objective must be 'time_to_loss' or 'step_time', got %r" % (self.objective,))
        if not (isinstance(self.backlog_cost, (int, float)) and self.backlog_cost >= 0):
            raise ValueError("Adjuster: backlog_cost must be a number >= 0, got %r" % (self.backlog_cost,))
        if not self.target > 1.0:
            raise ValueError("Adjuster: target is a multiple of compute time and must be > 1, got %r" % self.target)
        if int(self.max_backward_passes) < 1:
            raise ValueError("Adjuster: max_backward_passes must be >= 1")
        if int(self.interval) < 1 or int(self.window) < 1:
            raise ValueError("Adjuster: interval and window must be >= 1")
        if not (0.0 <= self.hysteresis < 0.5):
            raise ValueError("Adjuster: hysteresis must be in [0, 0.5), got %r" % self.hysteresis)
        if int(self.levels_per_decade) < 1:
            raise ValueError("Adjuster: levels_per_decade must be >= 1")
        object.__setattr__(self, "thc_bits", _ladder(self.thc_bits, 2, 8, True, "thc_bits must be distinct integers "
                                                                              "in [2, 8] (THC rungs)"))
        if self.thc_bits and self.objective != "time_to_loss":
            raise ValueError("Adjuster: thc_bits needs objective='time_to_loss': the step-time objective relies on "
                             "payloads growing along the ladder, and a THC rung sends fewer bytes than the densest "
                             "sparse rungs below it")
        object.__setattr__(self, "local_steps", _ladder(self.local_steps, 1, None, False, "local_steps must be distinct "
                                                                                          "integers >= 1 (the ladder of H)"))
        if not isinstance(self.modes, (tuple, list)) or tuple(sorted(self.modes)) not in ((), tuple(sorted(MODES))):
            raise ValueError("Adjuster: modes must be () or %r, got %r" % (MODES, self.modes))
        object.__setattr__(self, "modes", MODES if self.modes else ())
        if self.modes and self.objective != "time_to_loss":
            raise ValueError("Adjuster: modes=%r compares the modes by the time-to-loss objective; "
                             "pass objective='time_to_loss'" % (MODES,))
        object.__setattr__(self, "pseudo_rungs", _checked_pseudo_rungs(self.pseudo_rungs))
        object.__setattr__(self, "fragments", _ladder(self.fragments, 1, None, False, "fragments must be distinct "
                                                      "integers >= 1 (the ladder of F, the parts of the model exchanged "
                                                      "in turn)"))
        if isinstance(self.max_delay, bool) or not isinstance(self.max_delay, int) or self.max_delay < 0:
            raise ValueError("Adjuster: max_delay must be an int >= 0 (inner steps an exchange may stay in flight; 0: "
                             "blocking exchanges only), got %r" % (self.max_delay,))
        if self.batch_split and (not isinstance(self.global_batch, int) or self.global_batch < 1):
            raise ValueError("Adjuster: batch_split needs global_batch, the samples per pass over all ranks")

    def densities(self):
        """The density ladder: geometric from min_density to max_density (both included)."""
        lo, hi = self.min_density, self.max_density
        if hi / lo < 1.0 + 1e-9:
            return (lo,)
        n = max(1, int(math.ceil(math.log10(hi / lo) * self.levels_per_decade - 1e-9)))
        return tuple(lo * (hi / lo) ** (i / n) for i in range(n)) + (hi,)


def _checked_pseudo_rungs(rungs):
    """``pseudo_rungs`` as a tuple: distinct THC or sparse compressors whose residual is kept in
    the entries' domain (the rungs share one exchange's residuals)."""
    if not isinstance(rungs, (tuple, list)):
        raise ValueError("Adjuster: pseudo_rungs must be a tuple of hvd.Compression (THC or sparse), got %r" % (rungs,))
    for c in rungs:
        if not callable(getattr(c, "compress", None)) or not (getattr(c, "homomorphic", False)
                                                              or getattr(c, "sparse", False)):
            raise ValueError("Adjuster: pseudo_rungs must be THC or sparse compressors (hvd.Compression.thc(...), "
                             "hvd.Compression.sparseloco(...), ...), got %r" % (c,))
        if hasattr(c, "from_coefficients"):
            raise ValueError("Adjuster: pseudo_rungs cannot hold %r: its residual lives in the DCT's coefficients, "
                             "so it cannot carry over to another rung; pass it as LocalSteps(compression=...) alone"
                             % (c,))
    names = [repr(c.settings() if callable(getattr(c, "settings", None)) else c) for c in rungs]
    if len(set(names)) != len(names):
        raise ValueError("Adjuster: pseudo_rungs has the same compression twice: %s" % ", ".join(names))
    return tuple(rungs)


Adjuster = AdjusterSettings   # the public name (hvd.Adjuster)
