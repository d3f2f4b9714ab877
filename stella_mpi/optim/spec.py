"""What the user asked ``hvd.DistributedOptimizer`` for: one frozen :class:`Spec`, built once
from the arguments (old keyword arguments mapped to their new place with a
``DeprecationWarning``) and checked against one table of refusals (:data:`REFUSALS`) before any
hook is put on the model.

Each refusal is a plain function of the spec and the user's optimizer that returns the message
(naming the value and the fix) or None. Refusals that need a running step (a sparse gradient
arriving with momentum correction on) stay where the step runs.

The route the spec asks for (:meth:`Spec.route_kind`):

========== ==============================================================================
dense      Horovod's allreduce, ``compression`` none/fp16/bf16, any op (one cluster, or
           ``STELLA_WAN_ROUTE=dense``, or an op the automatic route does not take)
sparse     a sparse compressor with error feedback across clusters (``Compression.topk``,
           ``cacheaware``, ``threshold``, ``randomk``); momentum correction and the density
           warm-up are the compressor's options
thc        ``Compression.thc``: homomorphic quantization across clusters
adasum     ``op=hvd.Adasum``: Horovod's delta optimizer
cpu        ``engine=hvd.CpuEngine(...)``: the C optimizer on a CPU master copy
auto       two or more clusters and no stella compressor: the adjuster chooses the
           cross-cluster step (dense, sparse densities, THC bits, local steps)
========== ==============================================================================

``local_steps=hvd.LocalSteps(...)`` adds the outer synchronization (gradients averaged inside
each cluster, the pseudo-gradient across clusters every H steps); with
``hvd.Adjuster(modes=("sync", "local"))`` or on the automatic route the adjuster moves between
the two.
"""
import warnings
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..adjust.settings import AdjusterSettings
from ..api.reduce_ops import Adasum, Average, Max, Min, Product, Sum
from ..base.config import wan_route_setting
from ..compression import Compression
from ..core.process_sets import ProcessSet, global_process_set
from .outer_sync import LocalSteps

__all__ = ["CpuEngine", "Spec", "REFUSALS", "build_spec", "CPU_ENGINE_OPTIMIZERS"]

CPU_ENGINE_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)   # the C optimizer's rules
DENSE_COMPRESSORS = ("none", "fp16", "bf16")   # Horovod's: no stella compressor was asked for
MC_VALUES = ("auto", True, False)


@dataclass(frozen=True)
class CpuEngine:
    """The CPU engine (public name ``hvd.CpuEngine``), passed as
    ``DistributedOptimizer(..., engine=hvd.CpuEngine(staleness=1, model=model))``.

    SGD, Adam and AdamW run in C on worker threads pinned to their own cores, on a float32 master
    copy of each rank's shard (optim/routes/cpu_engine.py).

    staleness: 0 (``step()`` waits for the update) or 1 (the update of step t runs while step
        t+1 computes).
    semantics: "exact" (equals the dense torch optimizer fed the same sparse gradients) or
        "lazy" (only the coordinates sent change).
    prediction: with staleness 1, the forward gets the master weights one zero-gradient step
        ahead (the known part of the missing update). None: on with exact semantics.
    warmup: the first ``warmup`` steps run synchronously (staleness 0) before staleness 1.
        None: ``DEFAULT_WARMUP`` steps (with momentum correction, measured within 3 % of dense at
        equal steps on the byte-level LM: ``bench/bench_parity.py``). They take the place of the
        compressor's density warm-up, which applies only with ``warmup=0`` or staleness 0.
    model: the model, so that each layer waits only for its own update (forward pre-hooks);
        without it ``step()`` applies every update itself.
    """
    staleness: int = 1
    semantics: str = "exact"
    prediction: Optional[bool] = None
    warmup: Optional[int] = None
    model: Optional[torch.nn.Module] = field(default=None, compare=False)

    DEFAULT_WARMUP = 150

    def __post_init__(self):
        if self.staleness not in (0, 1) or isinstance(self.staleness, bool):
            raise ValueError("CpuEngine: staleness must be 0 or 1, not %r" % (self.staleness,))
        if self.semantics not in ("exact", "lazy"):
            raise ValueError("CpuEngine: semantics must be 'exact' or 'lazy', not %r" % (self.semantics,))
        if self.prediction not in (None, True, False):
            raise ValueError("CpuEngine: prediction must be None, True or False, not %r" % (self.prediction,))
        if self.warmup is not None and (isinstance(self.warmup, bool) or not isinstance(self.warmup, int)
                                        or self.warmup < 0):
            raise ValueError("CpuEngine: warmup must be a number of steps >= 0 (or None: %d), not %r"
                             % (self.DEFAULT_WARMUP, self.warmup))
        if self.model is not None and not isinstance(self.model, torch.nn.Module):
            raise ValueError("CpuEngine: model must be the torch.nn.Module whose parameters the optimizer updates, "
                             "not %r" % type(self.model).__name__)
        if self.prediction and self.semantics != "exact" and self.staleness == 1:
            raise ValueError("CpuEngine: prediction needs semantics='exact' (lazy coordinates do not move without a "
                             "gradient, so there is nothing to predict)")

    @property
    def predicts(self):
        """Whether a one-step-stale forward gets predicted weights."""
        prediction = self.semantics == "exact" if self.prediction is None else self.prediction
        return bool(prediction) and self.staleness == 1

    @property
    def warmup_steps(self):
        return self.DEFAULT_WARMUP if self.warmup is None else self.warmup


@dataclass(frozen=True)
class Spec:
    """What the user asked for, after the deprecated arguments found their place. Frozen: the
    optimizer's strategies read it, none writes it."""
    base: type                          # the user's optimizer class
    compression: object
    passes: int                         # backward_passes_per_step
    op: object
    predivide: float
    groups: object
    sparse_as_dense: bool
    process_set: ProcessSet
    engine: Optional[CpuEngine]
    local_steps: Optional[LocalSteps]
    adjuster: Optional[AdjusterSettings]
    momentum_correction: object         # "auto", True, False, or "masking" (deprecated)
    density_warmup: Optional[int]       # None: the compressor's
    dense_below: int                    # deprecated
    local_clip: Optional[float]         # deprecated
    wan_route: str                      # STELLA_WAN_ROUTE: "auto" or "dense"
    clusters: int                       # clusters of the process set (1 on a rank outside it)

    # ---------------- what the spec means

    @property
    def sparse(self):
        return bool(getattr(self.compression, "sparse", False)) and not self.homomorphic

    @property
    def homomorphic(self):
        return bool(getattr(self.compression, "homomorphic", False))

    @property
    def stella_compression(self):
        """A stella compressor was asked for (sparse or THC): it means exactly what it says."""
        return bool(getattr(self.compression, "sparse", False))

    @property
    def modes(self):
        return bool(self.adjuster is not None and self.adjuster.modes)

    @property
    def automatic(self):
        """The adjuster chooses the cross-cluster route: two or more clusters, no stella
        compressor, no CPU engine, no local steps (unless the adjuster is asked to switch modes),
        Horovod's Average of one pass over the global set, and ``STELLA_WAN_ROUTE=auto``."""
        return (self.clusters >= 2 and not self.stella_compression and self.engine is None
                and (self.local_steps is None or self.modes) and self.op == Average
                and self.process_set is global_process_set and self.wan_route == "auto" and self.predivide == 1.0
                and self.passes == 1)

    def route_kind(self):
        if self.engine is not None:
            return "cpu"
        if self.op == Adasum:
            return "adasum"
        if self.automatic:
            return "auto"
        if self.homomorphic:
            return "thc"
        if self.stella_compression:
            return "sparse"
        return "dense"

    def warmup_steps(self):
        """The sparse route's density warm-up (steps), 0 where none applies."""
        if self.density_warmup is not None:
            return int(self.density_warmup)
        return int(getattr(self.compression, "warmup", 0) or 0) if self.sparse else 0

    def wants_momentum_correction(self, groups):
        """Whether momentum correction runs: on the sparse route (also the automatic route's and
        the CPU engine's), asked for or ``"auto"``: for SGD with momentum in some group, float32
        parameters, op Average or Sum and one pass per step. (Local steps alone have no sparse
        gradient route; explicit requests elsewhere are refused by the table.)"""
        mc = self.momentum_correction
        kind = self.route_kind()
        if mc is False or (self.local_steps is not None and not self.modes):
            return False
        if not (kind == "auto" or (kind in ("sparse", "cpu") and self.sparse)):
            return False
        if mc != "auto":
            return True
        if not issubclass(self.base, torch.optim.SGD) or self.op not in (Average, Sum) or self.passes != 1:
            return False
        moving = [g for g in groups if g.get("momentum", 0.0) > 0 and not g.get("maximize", False)]
        return bool(moving) and all(p.dtype == torch.float32 for g in moving for p in g["params"] if p.requires_grad)


# ---------------------------------------------------------------- building the spec

# old keyword: (where it lives now, the spec field it sets)
DEPRECATED = {
    "staleness": "engine=hvd.CpuEngine(staleness=...)",
    "cpu_semantics": "engine=hvd.CpuEngine(semantics=...)",
    "staleness_warmup": "engine=hvd.CpuEngine(warmup=...)",
    "stale_prediction": "engine=hvd.CpuEngine(prediction=...)",
    "model": "engine=hvd.CpuEngine(model=...)",
    "momentum_correction": "the compressor: Compression.<name>(density=..., momentum_correction=...)",
    "density_warmup": "the compressor: Compression.<name>(density=..., warmup=...)",
    "dense_below": "nowhere: it measured no gain (bench/bench_parity.py); it is removed in the next release",
    "local_clip": "nowhere: it measured no gain (bench/bench_parity.py); it is removed in the next release",
}


def _deprecated(name, value):
    warnings.warn("DistributedOptimizer(%s=%r) is deprecated and will be removed in the next release: it now lives "
                  "in %s" % (name, value, DEPRECATED[name]), DeprecationWarning, stacklevel=4)


def build_spec(optimizer, compression, backward_passes_per_step, op, gradient_predivide_factor, num_groups, groups,
               sparse_as_dense, process_set, engine, local_steps, adjuster, legacy):
    """The Spec of one DistributedOptimizer call. ``legacy``: the deprecated keyword arguments
    the caller passed (each warns, naming its new place)."""
    unknown = sorted(set(legacy) - set(DEPRECATED))
    if unknown:
        raise TypeError("DistributedOptimizer() got an unexpected keyword argument %r" % unknown[0])
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed.", DeprecationWarning,
                      stacklevel=3)
        if groups is None:
            groups = num_groups
    engine_kw = {}
    for old, new in (("staleness", "staleness"), ("cpu_semantics", "semantics"), ("staleness_warmup", "warmup"),
                     ("stale_prediction", "prediction"), ("model", "model")):
        if old in legacy:
            _deprecated(old, legacy[old] if old != "model" else type(legacy[old]).__name__)
            engine_kw[new] = legacy[old]
    if engine == "cpu":
        warnings.warn("DistributedOptimizer(engine='cpu') is deprecated and will be removed in the next release: pass "
                      "engine=hvd.CpuEngine(staleness=..., model=...)", DeprecationWarning, stacklevel=3)
        # the old default was synchronous and without a warm-up
        engine = CpuEngine(**dict({"staleness": 0, "warmup": 0}, **engine_kw))
    elif engine_kw:
        if isinstance(engine, CpuEngine):
            raise ValueError("DistributedOptimizer: %s given both as keyword arguments and in engine=%r; pass them "
                             "to hvd.CpuEngine only" % (sorted(engine_kw), engine))
        raise ValueError("DistributedOptimizer(%s=...) configures the CPU engine: pass engine=hvd.CpuEngine(%s)"
                         % (sorted(engine_kw)[0], ", ".join("%s=..." % k for k in sorted(engine_kw))))
    # the old default was no correction; a compressor's own option is its "auto" unless set
    mc = getattr(compression, "momentum_correction", "auto")
    if "momentum_correction" in legacy:
        _deprecated("momentum_correction", legacy["momentum_correction"])
        mc = legacy["momentum_correction"]
    warmup = None
    if "density_warmup" in legacy:
        _deprecated("density_warmup", legacy["density_warmup"])
        warmup = legacy["density_warmup"]
    dense_below = legacy.get("dense_below", 0)
    if "dense_below" in legacy:
        _deprecated("dense_below", dense_below)
    local_clip = legacy.get("local_clip")
    if "local_clip" in legacy:
        _deprecated("local_clip", local_clip)
    included = isinstance(process_set, ProcessSet) and process_set.topology is not None and process_set.included()
    clusters = process_set.topology.num_clusters if included else 1
    return Spec(base=type(optimizer), compression=compression, passes=backward_passes_per_step, op=op,
                predivide=gradient_predivide_factor, groups=groups, sparse_as_dense=sparse_as_dense,
                process_set=process_set, engine=engine, local_steps=local_steps, adjuster=adjuster,
                momentum_correction=mc, density_warmup=warmup, dense_below=dense_below or 0, local_clip=local_clip,
                wan_route=wan_route_setting(), clusters=clusters)


# ---------------------------------------------------------------- the refusals

REFUSALS = []


def refusal(check):
    """Register ``check(spec, optimizer) -> message or None`` in the table (checked in order)."""
    REFUSALS.append(check)
    return check


def refuse(spec, optimizer):
    """Raise ValueError with the first refusal's message that applies to ``spec``."""
    for check in REFUSALS:
        message = check(spec, optimizer)
        if message:
            raise ValueError(message)


def _trainable(optimizer):
    return [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]


# -- the arguments themselves

@refusal
def _adjuster_type(s, opt):
    if s.adjuster is not None and not isinstance(s.adjuster, AdjusterSettings):
        return "adjuster must be an hvd.Adjuster(...), not %r" % type(s.adjuster).__name__


@refusal
def _engine_type(s, opt):
    if s.engine is not None and not isinstance(s.engine, CpuEngine):
        return "engine must be None or hvd.CpuEngine(...), not %r" % (s.engine,)


@refusal
def _local_steps_type(s, opt):
    if s.local_steps is not None and not isinstance(s.local_steps, LocalSteps):
        return ("DistributedOptimizer(local_steps=...): pass an hvd.LocalSteps(every=...), not %r"
                % type(s.local_steps).__name__)


@refusal
def _momentum_correction_value(s, opt):
    if s.momentum_correction not in MC_VALUES + ("masking",):
        return "momentum_correction must be 'auto', True or False, not %r" % (s.momentum_correction,)


@refusal
def _op_known(s, opt):
    if s.op not in (Average, Sum, Min, Max, Product, Adasum):
        from ..api.reduce_ops import op_name
        op_name(s.op, torch.float32)   # raises the right error
        return "op %r is not one DistributedOptimizer reduces with" % (s.op,)


@refusal
def _predivide_needs_average(s, opt):
    if s.predivide != 1.0 and s.op != Average:
        return "gradient_predivide_factor not supported with op != Average"


# -- what one route cannot carry (before the generic checks: the message names the route)

@refusal
def _homomorphic_options(s, opt):
    if not s.homomorphic:
        return None
    what = "DistributedOptimizer(compression=%r)" % (s.compression,)
    if s.adjuster is not None and s.local_steps is None:
        return ("%s: the adjuster moves along a ladder of sparse densities; to let it choose thc's bits, pass a sparse "
                "compression and hvd.Adjuster(thc_bits=(2, 4, 8))" % what)
    if s.density_warmup or s.dense_below:
        return "%s: density_warmup and dense_below tune a sparse density; thc sends every entry" % what
    if s.momentum_correction in (True, "masking"):
        return ("%s: momentum_correction corrects for entries a sparse selection holds back; thc holds none back (its "
                "rounding error is fed back as it is)" % what)
    if s.engine is not None:
        return ("%s: the CPU engine updates its master shards from the sparse selection; thc's sum is dense, use "
                "engine=None" % what)


@refusal
def _thc_rungs(s, opt):
    if s.adjuster is not None and s.adjuster.thc_bits and s.engine is not None:
        return ("hvd.Adjuster(thc_bits=%r): the CPU engine updates its master shards from the sparse selection; thc's "
                "sum is dense, use engine=None" % (s.adjuster.thc_bits,))


@refusal
def _local_steps_route(s, opt):
    if s.local_steps is None:
        return None
    what = "DistributedOptimizer(local_steps=...)"
    if s.engine is not None:
        return ("%s: the CPU engine keeps its master copy in shards over the ranks of every cluster, which a step "
                "inside one cluster cannot update; use engine=None" % what)
    if s.op != Average:
        return "%s averages pseudo-gradients: op must be hvd.Average" % what
    if s.process_set is not global_process_set:
        return "%s runs over the global process set (its clusters are the local groups)" % what


@refusal
def _adasum_compression(s, opt):
    if s.op == Adasum and s.engine is None and s.stella_compression:
        return ("DistributedOptimizer(op=hvd.Adasum) combines whole deltas; a sparse compressor does not apply (use "
                "Compression.none or fp16)")


@refusal
def _adasum_local_steps(s, opt):
    if s.op == Adasum and (s.local_steps is not None or s.modes):
        return "DistributedOptimizer(local_steps=...) averages pseudo-gradients: op must be hvd.Average"


# -- the sparse route's options

@refusal
def _sparse_sums(s, opt):
    if s.stella_compression and s.op not in (Average, Sum) and s.op != Adasum:
        return "DistributedOptimizer: a sparse compressor sums gradients; op must be Average or Sum"


@refusal
def _warmup_value(s, opt):
    w = s.density_warmup
    if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 0 or (w and not s.sparse)):
        return "density_warmup is a number of steps >= 0 for a sparse compression"


@refusal
def _dense_below_value(s, opt):
    d = s.dense_below
    if d and (isinstance(d, bool) or not isinstance(d, int) or d < 0 or not s.sparse):
        return "dense_below is a number of elements >= 0 for a sparse compression"


@refusal
def _dense_below_with_adjuster(s, opt):
    if s.dense_below and s.adjuster is not None:
        return "dense_below sets the density, as the adjuster does: use one"


@refusal
def _local_clip_value(s, opt):
    c = s.local_clip
    if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float)) or not c > 0):
        return "local_clip is the global max norm (a number > 0), got %r" % (c,)


@refusal
def _local_clip_route(s, opt):
    if s.local_clip is not None and (s.engine is not None or s.op == Adasum or s.local_steps is not None or s.modes):
        return ("local_clip applies to the synchronous optimizer's reduction (engine=None, op Average or Sum, no "
                "local_steps)")


@refusal
def _options_need_a_gradient_route(s, opt):
    if (s.density_warmup or s.dense_below) and (s.engine is not None or s.op == Adasum):
        return ("density_warmup and dense_below apply to the synchronous optimizer's sparse route (engine=None, op "
                "Average or Sum)")


# -- momentum correction

@refusal
def _momentum_correction_route(s, opt):
    if s.momentum_correction in (True, "masking") and s.op == Adasum:
        return "momentum_correction applies to the sparse route (op Average or Sum)"


@refusal
def _momentum_correction_where(s, opt):
    if s.momentum_correction not in (True, "masking") or s.local_steps is not None:
        return None
    what = "DistributedOptimizer(momentum_correction=...)"
    if s.engine is not None:   # (SGD and a sparse compression: the engine's own refusal)
        if any(g.get("momentum", 0.0) > 0 and g.get("maximize", False) for g in opt.param_groups):
            return "engine='cpu' with momentum_correction: SGD with maximize=True is not supported"
        return None
    if not issubclass(s.base, torch.optim.SGD):
        return "%s corrects SGD's momentum; the optimizer is %s" % (what, s.base.__name__)
    if not s.stella_compression and s.route_kind() != "auto":
        return "%s needs a sparse compression (the dense route sends every velocity anyway)" % what
    if s.op not in (Average, Sum) or s.passes != 1:
        return "%s: op must be Average or Sum, with backward_passes_per_step=1" % what
    for group in opt.param_groups:
        if group.get("momentum", 0.0) > 0:
            if group.get("maximize", False):
                return "%s: SGD with maximize=True is not supported" % what
            for p in group["params"]:
                if p.requires_grad and p.dtype != torch.float32:
                    return ("%s: a parameter is %s; the sparse route (and so the correction) takes float32"
                            % (what, p.dtype))


# -- the adjuster

@refusal
def _adjuster_route(s, opt):
    if s.adjuster is None or (s.local_steps is not None and not s.modes) or s.engine is not None:
        return None
    if s.op == Adasum:
        return "op=hvd.Adasum combines whole deltas: it takes no adjuster"
    if s.stella_compression or s.clusters < 2:   # (one cluster: nothing crosses, nothing to adjust)
        return None
    if s.wan_route == "dense":
        return ("DistributedOptimizer(adjuster=...): STELLA_WAN_ROUTE=dense asks for Horovod's dense route, which the "
                "adjuster does not tune; unset STELLA_WAN_ROUTE (or set it to 'auto'), or pass a sparse compression")
    if not s.automatic:
        return ("DistributedOptimizer(adjuster=...) with compression=%r: the adjuster chooses the cross-cluster route "
                "for op=hvd.Average of one backward pass over the global process set; pass a sparse compression "
                "(hvd.Compression.cacheaware(density=...)) to tune its density here" % (s.compression,))


@refusal
def _density_warmup_with_adjuster(s, opt):
    if s.density_warmup and s.adjuster is not None and not s.modes and s.route_kind() != "auto":
        return "density_warmup and dense_below set the density, as the adjuster does: use one"


# -- the CPU engine

@refusal
def _engine_reduction(s, opt):
    if s.engine is None:
        return None
    if s.op != Average or s.passes != 1 or s.predivide != 1.0:
        return ("engine='cpu' averages one backward pass per step: op=Average, backward_passes_per_step=1, "
                "gradient_predivide_factor=1.0")
    if s.adjuster is not None and s.adjuster.allow_accumulation:
        return "engine='cpu' runs one backward pass per step: use an Adjuster with allow_accumulation=False"
    if s.adjuster is not None and s.adjuster.modes:
        return ("hvd.Adjuster(modes=...): the CPU engine keeps its master copy in shards over the ranks of every "
                "cluster, which local steps cannot update; use engine=None")
    if s.base not in CPU_ENGINE_OPTIMIZERS:
        return ("engine='cpu' runs torch.optim.SGD, torch.optim.Adam and torch.optim.AdamW in C; %s is not supported "
                "(use engine=None for any optimizer)" % s.base.__name__)
    if s.momentum_correction == "masking":
        return "engine='cpu': momentum factor masking is not supported (momentum_correction=True)"
    if s.momentum_correction is True and (s.base is not torch.optim.SGD or not s.sparse):
        return "engine='cpu' with momentum_correction needs SGD and a sparse compression"
    topo = s.process_set.topology
    if topo is not None and s.process_set.included() and not topo.uniform_clusters:
        return ("engine='cpu' needs clusters of equal size (shards line up across clusters); these clusters have %s "
                "ranks" % [len(m) for m in topo.cluster_members])


# -- local steps and the modes

@refusal
def _local_steps_options(s, opt):
    if s.local_steps is None or s.modes:
        return None
    what = "DistributedOptimizer(local_steps=...)"
    for name, value in (("momentum_correction", s.momentum_correction in (True, "masking")),
                        ("density_warmup", s.density_warmup), ("dense_below", s.dense_below)):
        if value:
            return "%s: %s applies to the gradient route, not to local steps" % (what, name)
    a = s.adjuster
    if a is not None:
        if a.objective != "step_time":
            return ("%s: the adjuster chooses H with the step-time objective only, pass hvd.Adjuster(objective="
                    "'step_time', target=...): time to loss would need the loss, which local steps do not see" % what)
        if a.allow_accumulation or a.batch_split:
            return ("%s: the adjuster's allow_accumulation and batch_split apply to the gradient route; with local "
                    "steps it chooses H from Adjuster(local_steps=...)" % what)


@refusal
def _fragments_fit_the_model(s, opt):
    ls = s.local_steps
    if ls is None or ls.fragments == 1:
        return None
    count = len(_trainable(opt))
    if ls.fragment_groups is None and ls.fragments > count:
        return ("DistributedOptimizer(local_steps=hvd.LocalSteps(fragments=%d)): the optimizer has %d trainable "
                "parameters and a fragment holds at least one whole parameter; pass fragments <= %d"
                % (ls.fragments, count, count))


@refusal
def _fragments_with_modes(s, opt):
    ls = s.local_steps
    if ls is not None and s.modes and (ls.fragments > 1 or ls.delay > 0):
        return ("DistributedOptimizer(adjuster=hvd.Adjuster(modes=('sync', 'local'))): the adjuster starts each phase of "
                "local steps at the H it predicts and times whole periods, which fragments' fixed schedule does not "
                "give; pass LocalSteps(fragments=1, delay=0) (got fragments=%d, delay=%d), or leave modes out"
                % (ls.fragments, ls.delay))


@refusal
def _inner_rank_with_modes(s, opt):
    ls = s.local_steps
    if ls is not None and s.modes and ls.inner == "rank":
        return ("DistributedOptimizer(adjuster=hvd.Adjuster(modes=('sync', 'local')), local_steps=hvd.LocalSteps("
                "inner='rank')): under modes your local steps' replicas are the clusters; pass inner='cluster', leave "
                "modes out, or leave local_steps out: the automatic route makes each rank a replica itself where "
                "the cluster's reductions cost a share of the step")


@refusal
def _pseudo_rungs(s, opt):
    rungs = s.adjuster.pseudo_rungs if s.adjuster is not None else ()
    if not rungs:
        return None
    what = "hvd.Adjuster(pseudo_rungs=...)"
    if not (s.modes or s.route_kind() == "auto"):
        return ("%s: the adjuster chooses the pseudo-gradient's compression when it moves between the synchronous "
                "route and local steps; pass modes=('sync', 'local'), or leave compression out across clusters (the "
                "automatic route)" % what)
    ls = s.local_steps
    if ls is not None and ls.compression is not None:
        return ("%s and LocalSteps(compression=%r): the pseudo-gradient's compression is given twice; pass the rungs "
                "alone (the adjuster chooses among them) or LocalSteps(compression=...) alone" % (what, ls.compression))
    if ls is not None and ls.overlap:
        return ("%s with LocalSteps(overlap=True): overlap sends the pseudo-gradient uncompressed; leave one out"
                % what)


@refusal
def _pseudo_gradient_twice(s, opt):
    ls = s.local_steps
    if ls is not None and not s.modes and ls.compression is not None and s.compression is not Compression.none:
        return ("DistributedOptimizer(local_steps=...): the pseudo-gradient's compression is given twice "
                "(compression=%r and LocalSteps(compression=%r)); pass one" % (s.compression, ls.compression))


@refusal
def _pseudo_gradient_overlap(s, opt):
    ls = s.local_steps
    if ls is None or not ls.overlap:
        return None
    pseudo = ls.compression if (ls.compression is not None or s.modes) else s.compression
    if s.modes and pseudo is not Compression.none:
        return ("DistributedOptimizer(adjuster=hvd.Adjuster(modes=('sync', 'local'))): LocalSteps(overlap=True) sends "
                "the pseudo-gradient uncompressed, outside the collective thread; pass LocalSteps(compression="
                "hvd.Compression.none, overlap=True) (the optimizer's compression is the synchronous route's)")
    if pseudo is not Compression.none:
        return ("DistributedOptimizer(local_steps=...): overlap=True sends the pseudo-gradient over its own "
                "communicator, outside the collective thread, uncompressed; pass compression=hvd.Compression.none (or "
                "overlap=False to exchange it through %r)" % (pseudo,))


@refusal
def _pseudo_gradient_dtype(s, opt):
    ls = s.local_steps
    rungs = s.adjuster.pseudo_rungs if s.adjuster is not None else ()
    if rungs:   # the adjuster chooses among them (checked with them: _pseudo_rungs)
        what, pseudos = "hvd.Adjuster(pseudo_rungs=...)", rungs
    elif ls is not None:
        what = "DistributedOptimizer(local_steps=...)"
        pseudos = (ls.compression if (ls.compression is not None or s.modes) else s.compression,)
    else:
        return None
    if any(getattr(c, "sparse", False) for c in pseudos):
        for p in _trainable(opt):
            if p.dtype != torch.float32:
                return "%s: a sparse compression takes float32 parameters, got %s" % (what, p.dtype)


@refusal
def _modes_route(s, opt):
    if not s.modes:
        return None
    what = "DistributedOptimizer(adjuster=hvd.Adjuster(modes=('sync', 'local')))"
    if s.homomorphic:
        return ("%s: the synchronous route's compression must be sparse (cacheaware, topk, threshold, randomk) or "
                "none (the automatic route), got %r; THC rungs come from Adjuster(thc_bits=...)" % (what, s.compression))
    if s.op != Average:
        return "%s averages gradients and pseudo-gradients: op must be hvd.Average" % what
    if s.process_set is not global_process_set:
        return "%s runs over the global process set (its clusters are the local groups)" % what
    if s.adjuster.allow_accumulation or s.adjuster.batch_split:
        return "%s: allow_accumulation and batch_split are not carried through local steps" % what
    for name, value in (("dense_below", s.dense_below), ("momentum_correction", s.momentum_correction
                                                         if s.momentum_correction == "masking" else None)):
        if value:
            return "%s: %s=%r is not carried through local steps; leave it out" % (what, name, value)
    if s.passes != 1:
        return "%s runs one backward pass per step: backward_passes_per_step=1" % what
