"""The optimizer's strategies composed from its spec, and the adjuster's glue: who chooses the
route, and how a choice is applied (by replacing an object, at a step boundary, on every rank
at the same step).

:func:`compose` builds the gradient route and the outer synchronization the spec asks for:

================================  ==========================================================
spec                              route, outer sync, tuner
================================  ==========================================================
engine=hvd.CpuEngine(...)         CpuEngineRoute; an adjuster tunes its density
op=hvd.Adasum                     AdasumRoute
local_steps=hvd.LocalSteps(...)   the cluster's DenseRoute (inner="rank": RankRoute) +
                                  LocalStepsSync (an adjuster with the step-time objective
                                  chooses H)
a sparse / THC compressor         SparseRoute / THCRoute; an adjuster tunes density and bits
                                  (:class:`DensityTuner`)
Adjuster(modes=("sync", "local")) :class:`ModeSwitch`: the sparse route and local steps
no stella compressor, 2+ clusters  the automatic route: :class:`ModeSwitch` over every rung
                                  (dense, sparse densities, THC bits, local steps)
otherwise                         DenseRoute (Horovod's)
================================  ==========================================================

The automatic route (``STELLA_WAN_ROUTE=auto``, the default) starts from a measurement of the
link (:mod:`..adjust.link_probe`) and logs one line on rank 0: the clusters, the link, the route
and how to get Horovod's dense numerics instead. Every later change is logged with its reason,
counted in ``hvd.stats()`` (``route``, ``route_reason``, ``route_step``) and marked in the
timeline (``ROUTE``).
"""
import collections
import dataclasses
import functools
import itertools
import logging
import math

import torch

from ..adjust.controller import Estimate, backlog_shape
from ..adjust.link_probe import probe_link
from ..adjust.local_steps_rule import LocalStepsRule
from ..adjust.mode_rule import BLOCKING, ModeRule, PseudoRung, Schedule
from ..adjust.session import KEEP_WINDOWS, adjust_session, thc_wire_bytes
from ..adjust.settings import MODES, AdjusterSettings
from ..api.allgather import allgather
from ..api.allreduce import (allreduce_async, allreduce_tensors_async, compressed_allreduce_async,
                             grouped_allreduce_async, new_outputs)
from ..api.functions import broadcast_object
from ..api.handles import GroupHandle, finished_at, synchronize
from ..api.queries import rank
from ..api.reduce_ops import Average, Max, Min
from ..base import timeline
from ..base.errors import NonFiniteGradientError
from ..comm.hierarchy import allreduce_bytes
from ..compression import Compression
from ..core import state
from ..core.process_sets import global_process_set
from .agreement import check_agreement
from .buckets import plan_pseudo_gradient_buckets
from .cluster_channel import ClusterChannel
from .clusters import cluster_process_set
from .fragments import fragment_shares
from .outer_channel import OuterChannel
from .outer_sync import INNERS, LocalSteps, LocalStepsSync, NoOuterSync, saved_fragments
from .routes.adasum import AdasumRoute
from .routes.cpu_engine import CpuEngineRoute
from .routes.sync import ENTRY_BYTES, DenseRoute, RankRoute, SparseRoute, THCRoute

log = logging.getLogger("stella_mpi")
route_log = logging.getLogger("stella_mpi.route")   # shown by default on rank 0 (core/state.py)

# the automatic route's defaults: the synchronous route's sparse compressor (its own defaults:
# singles beside blocks, momentum correction, the warm-up), the pseudo-gradient of local steps,
# and the adjuster's rungs
AUTO_DENSITY = 0.01
AUTO_PSEUDO_BITS = 4
# the THC rung's outer step, by the inner optimizer (:func:`auto_outer_of`)
AUTO_OUTER = "nesterov"            # SGD and the rest: DiLoCo's outer Nesterov (lr 0.7, momentum 0.9)
AUTO_OUTER_ADAPTIVE = "average"    # the Adam family (a param group with ``betas``): averaging
AUTO_THC_BITS = (2, 4, 8)
_exchanges = itertools.count()   # names each optimizer's pseudo-gradient exchange (same order on every rank)


def auto_pseudo_rungs():
    """The automatic route's pseudo-gradient rungs (fresh compressors): THC 4 bits, and
    SparseLoCo's chunked top-k at 1 % and 3 % of each 4096-entry chunk with 2-bit values, its
    residual decayed by 0.95 per exchange (bench/bench_parity.py, 4 seeds: with the outer step
    of :func:`auto_outer_of`, 1 % is +0.15 % held-out loss over uncompressed local 8 at 1/160 of
    its bytes)."""
    return (Compression.thc(bits=AUTO_PSEUDO_BITS),
            Compression.sparseloco(density=0.01, bits=2, feedback_decay=0.95),
            Compression.sparseloco(density=0.03, bits=2, feedback_decay=0.95))


def adaptive_inner(opt):
    """Whether the inner optimizer ``opt`` is of the Adam family (Adam, AdamW, NAdam, RAdam,
    Adamax, and any optimizer whose param groups hold ``betas``): it scales each coordinate's step
    by its own running second moment."""
    return any("betas" in g for g in opt.param_groups)


def auto_thc_outer(adaptive):
    """The ``LocalSteps`` outer preset of the automatic route's THC rung (and of its default
    local steps): averaging under an ``adaptive`` inner optimizer, else DiLoCo's Nesterov."""
    return AUTO_OUTER_ADAPTIVE if adaptive else AUTO_OUTER


def selective(comp):
    """Whether ``comp`` selects entries and holds the others back: sparse, not THC."""
    return getattr(comp, "sparse", False) and not getattr(comp, "homomorphic", False)


def auto_outer_of(comp, nclusters, adaptive=False):
    """The automatic route's outer SGD hyperparameters for a pseudo rung.

    * A sparse rung: the clusters' sum (``LocalSteps(outer="sum")``: lr C, no momentum), because
      the mean over clusters halves an entry one cluster sent and Nesterov's momentum on top of
      error feedback overshoots (bench/bench_parity.py, 4 seeds at 1 %: sum +0.15 %, averaging
      +4.6 %, Nesterov +16 % over uncompressed local 8).
    * THC under an ``adaptive`` inner optimizer (:func:`adaptive_inner`): averaging
      (``AUTO_OUTER_ADAPTIVE``). With Adam inside, averaging ended 12-19 % below DiLoCo's Nesterov
      at equal steps in 10 of 10 pairs, on clusters of 1 and 2 ranks, blocking and in fragments
      (bench/results/outer_step_31_s10.json), 9 % below on the time-to-loss bench's LM
      (outer_step_31_adam_lm_s11.json), and 4-8 % below at 40 s in time to loss
      (time_to_loss_31_adam_s11_*.json).
    * THC under SGD and the rest: DiLoCo's Nesterov (``AUTO_OUTER``; on the time-to-loss bench's
      LM, 2 clusters of 2 ranks, it ended 10 % below averaging)."""
    outer = "sum" if selective(comp) else auto_thc_outer(adaptive)
    return LocalSteps(every=1, outer=outer).preset_hyperparameters(nclusters)


def compose(opt):
    """Install the route, the outer synchronization and the tuner ``opt._spec`` asks for."""
    spec = opt._spec
    # before any communicator or collective of a route: settings that differ by rank end here
    check_agreement(spec, [(opt._names[p], p) for p in opt._params])
    kind = spec.route_kind()
    pset = spec.process_set
    if kind == "cpu":
        route = CpuEngineRoute(opt, pset, spec.compression, spec.engine)
        opt._install(route, NoOuterSync())
        session = adjust_session(spec.adjuster, spec.compression, pset, overlap=spec.engine.staleness == 1, passes=1)
        if session is not None:
            route.set_compression(session.compression)
            _budget_warmup(route, session, None)
            opt._session = session
            opt._tuner = DensityTuner(opt, session)
        if spec.engine.model is not None:
            route.attach(spec.engine.model)
        return
    if kind == "adasum":
        opt._install(AdasumRoute(opt, pset, spec.compression), NoOuterSync())
        return
    if spec.local_steps is not None and not spec.modes:
        rule = LocalStepsRule(spec.adjuster, spec.local_steps.every) if spec.adjuster is not None else None
        pseudo = spec.local_steps.compression if spec.local_steps.compression is not None else spec.compression
        if spec.local_steps.inner == "rank":   # each rank a replica: nothing reduced at the inner step
            route = RankRoute(opt, spec.process_set)
        else:
            route = DenseRoute(opt, cluster_process_set(), kind="cluster")
        opt._install(route, local_steps_sync(opt, spec.local_steps, pseudo, route.channel, rule))
        return
    if kind == "auto" or spec.modes:
        ModeSwitch.build(opt)
        return
    if kind in ("sparse", "thc"):
        opt._install(sparse_route(opt, spec.compression), NoOuterSync())
        session = adjust_session(spec.adjuster, spec.compression, pset, overlap=False, passes=spec.passes)
        if session is not None:
            opt._session = session
            opt._tuner = DensityTuner(opt, session)
            opt._route.set_compression(session.compression)
            _budget_warmup(opt._route, session, None)
        return
    opt._install(DenseRoute(opt, pset, spec.compression, spec.op, spec.predivide, local_clip=spec.local_clip),
                 NoOuterSync())


def sparse_route(opt, compression):
    """The synchronous compressed route of ``compression``: THC's or a sparse compressor's."""
    spec = opt._spec
    if getattr(compression, "homomorphic", False):
        return THCRoute(opt, spec.process_set, compression, spec.op, spec.predivide)
    return SparseRoute(opt, spec.process_set, compression, spec.op, spec.predivide, warmup=spec.warmup_steps(),
                       dense_below=spec.dense_below, local_clip=spec.local_clip)


class PseudoGradientExchange:
    """The exchange of local steps' pseudo-gradients over all ranks through ``comp``: a sparse
    or THC compressor (error feedback per bucket shard), or a dense one (fp16/bf16/none).

    ``launch(deltas)`` submits the collectives and returns at once (the handle of what is in
    flight); ``wait(pending)`` synchronizes them and returns the mean pseudo-gradients; calling
    the exchange, ``exchange(deltas)``, is ``wait(launch(deltas))``. ``fragment(i)`` is the
    exchange of Streaming DiLoCo's fragment ``i``: the same compressor, its collectives named
    ``<name>.f<i>`` (so its error-feedback residuals are its own).

    A sparse or THC exchange is cut into buckets of ``STELLA_FUSION_THRESHOLD`` bytes, as the
    gradient route's (one residual per bucket shard, ``<name>.<i>``; one bucket keeps ``name``):
    a single fused buffer of the whole model needed a second copy of every parameter and, from
    2**31 elements per shard on (a 70B model on 8 GPUs per cluster), more than the kernels take
    (bench/scale_study.py, docs/design/scale.md). Every bucket is waited for before a refused
    one raises, so all ranks leave the exchange alike."""

    def __init__(self, comp, name):
        self.comp = comp
        self.name = name

    def fragment(self, index, count=None):
        """Fragment ``index``'s exchange, its collectives named ``<name>.f<index>`` (with
        ``count``, the adjuster's schedules: ``<name>.f<index>of<count>``)."""
        return _FragmentExchange(self, "%s.f%d%s" % (self.name, index, "" if count is None else "of%d" % count))

    def arrived(self, pending):
        """The time.perf_counter() at which the last collective of the exchange ``pending``
        ended, or None while one runs (or cannot tell)."""
        return None if any(callable(h) for h in pending[0]) else finished_at(GroupHandle(pending[0]))

    def __call__(self, deltas):
        return self.wait(self.launch(deltas))

    def launch(self, deltas):
        """Submit the exchange of ``deltas`` (the list is reduced in place by a sparse
        compressor); returns (handles, the dense compressor's contexts or None)."""
        comp, name = self.comp, self.name
        if getattr(comp, "sparse", False):
            groups = plan_pseudo_gradient_buckets(deltas, state.current().config.fusion_threshold)
            return [compressed_allreduce_async(g, comp, name if len(groups) == 1 else "%s.%d" % (name, i), Average,
                                               inplace=True) for i, g in enumerate(groups)], None
        pairs = [comp.compress(d) for d in deltas]
        # gradients=True: a NaN/Inf on any rank refuses the exchange on every rank (as the
        # sparse and THC exchanges do), unless STELLA_NONFINITE=off
        handle = allreduce_tensors_async([c.contiguous() for c, _ in pairs], new_outputs, name, Average, 1.0, 1.0,
                                         global_process_set, "grouped_allreduce", gradients=True)
        return [handle], [ctx for _, ctx in pairs]

    def wait(self, pending):
        """The mean pseudo-gradients of the exchange ``pending`` (collective: every rank waits
        for it). NonFiniteGradientError, on every rank alike, when some rank's was not finite."""
        handles, contexts = pending
        out, error = [], None
        for h in handles:
            try:
                out += synchronize(h)
            except NonFiniteGradientError as e:
                error = error or e
        if error is not None:
            raise error
        if contexts is None:
            return out
        return [self.comp.decompress(o, ctx) for o, ctx in zip(out, contexts)]

    def drop(self, pending):
        """Complete the exchange ``pending`` and forget its result (a checkpoint being loaded
        replaces what it would have applied). Every rank launched it, so every rank's wait ends."""
        for h in pending[0]:
            try:
                synchronize(h)
            except NonFiniteGradientError:
                pass


class _FragmentExchange(PseudoGradientExchange):
    """A fragment's exchange: the whole exchange's compressor (a rung taken applies to every
    fragment), collectives of its own name."""

    def __init__(self, whole, name):
        self.whole = whole
        self.name = name

    @property
    def comp(self):
        return self.whole.comp


def pseudo_gradient_exchange(comp, name):
    """The :class:`PseudoGradientExchange` of local steps' pseudo-gradients through ``comp``,
    its collectives named ``name``."""
    return PseudoGradientExchange(comp, name)


def nonfinite_state_dropper(opt):
    """() -> the names of the parameters whose inner optimizer state held a NaN or Inf, that
    state dropped (a refused exchange sends every rank back to the anchor; a state that is not
    finite would poison the next period too)."""
    def drop():
        dropped = []
        for p in opt._params:
            st = opt.state.get(p)
            if st and any(torch.is_tensor(t) and t.is_floating_point() and not bool(torch.isfinite(t).all())
                          for t in st.values()):
                opt.state[p] = {}
                dropped.append(opt._names[p])
        return dropped
    return drop


def local_steps_sync(opt, settings, pseudo, cluster_channel, rule=None):
    """The LocalStepsSync of ``opt`` (its exchange through ``pseudo``, its channel with overlap,
    the all-gather of period times for ``rule``); ``cluster_channel``: the ClusterChannel of its
    cluster route, or None, where pace "time" agrees the end of a period."""
    name = "local_steps.%d.delta" % next(_exchanges)
    named = [(opt._names[p], p) for p in opt._params]
    return LocalStepsSync(settings, named, pseudo_gradient_exchange(pseudo, name),
                          channel=OuterChannel(name) if settings.overlap else None, rule=rule,
                          gather=lambda row: allgather(row, name=name + ".times"),
                          cluster_id=global_process_set.topology.cluster_id,
                          drop_nonfinite_state=nonfinite_state_dropper(opt),
                          cluster_any=cluster_any(name, cluster_channel) if settings.pace == "time" else None,
                          clusters=global_process_set.topology.num_clusters)


def cluster_any(name, channel=None):
    """flag -> whether any rank of this rank's cluster passed True (one small MAX allreduce
    inside the cluster, on ``channel`` (a ClusterChannel) when there is one; every rank of it
    calls it at the same step): pace "time"'s end of a period, agreed inside each cluster."""
    topo = global_process_set.topology
    if topo.cluster_size == 1:
        return lambda flag: bool(flag)
    if channel is not None:
        return channel.any
    pset = cluster_process_set()

    def any_(flag):
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        return bool(synchronize(allreduce_async(t, op=Max, name=name + ".period_over", process_set=pset))[0])
    return any_


def payload_per_entry(comp, nclusters):
    """Wire bytes one rank sends per shard entry of the pseudo-gradient through ``comp``, as the
    routes count them: THC's summed words and scales; a sparse selection's entries gathered from
    the C - 1 other clusters (its bytes per entry: values and indices); a dense allreduce."""
    if getattr(comp, "homomorphic", False):
        return thc_wire_bytes(comp.bits, nclusters, comp.block_log2)
    if getattr(comp, "sparse", False):
        return (nclusters - 1) * comp.density * (getattr(comp, "entry_bytes", None) or ENTRY_BYTES.get(comp.name, 6.0))
    width = 2 if comp.name in ("fp16", "bf16") else 4
    n = 1 << 20
    return allreduce_bytes(width * n, nclusters) / n


# A sparse pseudo-gradient of density d at H = every holds back
#     PSEUDO_SPARSE_KAPPA * sqrt((1 - d) / d) * sparse_pseudo_factor(every)
# (the synchronous sparse backlog's shape, on a scale of its own): least at H =
# PSEUDO_SPARSE_EVERY, more on either side. A short H exchanges often, and the residual decays at every exchange (feedback_decay), on
# a pseudo-gradient of few steps: PSEUDO_SPARSE_EVERY / H. A long H makes an entry wait about 1/d
# exchanges, H/d steps: sqrt(H / PSEUDO_SPARSE_EVERY), the wait's square root as in the sparse
# backlog's shape. The scale is not the run's kappa: that is the synchronous route's residual ratio,
# which moved 10x with the density it was measured at (0.13 at 0.1 %, 1.33 at 1 % on the byte LM)
# and says little of the pseudo-gradient's. Calibrated on the byte LM of
# bench/bench_time_to_loss.py (as backlog_cost was), one run per rate of the automatic route and
# of each rung fixed, whose sync phases measured kappa 0.13: with 8 and 0.13, the rule chooses
# the rung that reached the lower loss in 40 s at 5, 20 and 100 Mbit/s and 1 Gbit/s (SparseLoCo
# at H <= 8 on the slow links, THC 4 bits at 100 Mbit/s and 1 Gbit/s; 6.5 to 10 agree on all
# four, with thin margins at 20 Mbit/s and 1 Gbit/s). That was before entering local steps
# charged the automatic route's sparse rungs SPARSE_SUM_PERIOD under SGD (below): their entry
# is now THC's from 10 Mbit/s up; this backlog still scores them in local mode. At equal steps
# on bench/bench_parity.py's smaller LM, SparseLoCo 1 % (outer sum, seed 0) cost +1.0, +1.2,
# +2.9 and +6.4 % at H = 2, 8, 32 and 64 where THC 4 bits cost 0.0, 0.9 and 1.4 % at H = 8, 32
# and 64.
PSEUDO_SPARSE_EVERY = 8.0
PSEUDO_SPARSE_KAPPA = 0.13


def sparse_pseudo_factor(every):
    """How much more than the synchronous rung of its density a sparse pseudo-gradient holds back
    at H = ``every`` (1 at ``PSEUDO_SPARSE_EVERY``)."""
    every = max(int(every), 1)
    return max(PSEUDO_SPARSE_EVERY / every, math.sqrt(every / PSEUDO_SPARSE_EVERY))


# The inner steps an outer step with momentum (the automatic route's DiLoCo Nesterov, lr 0.7,
# momentum 0.9, on THC 4-bit pseudo-gradients) needs to reach a loss at period H, over what it
# needs at H = 32: the least there, far more at short periods, where the outer momentum compounds
# over a few steps' progress (at H = 2 it trained worse than dense synchronous SGD), a little more
# at 64. Measured with ``bench/bench_parity.py --hidden 1024 --lr 0.05 --steps 600`` (the
# time-to-loss bench's byte LM, 2 clusters of 2 ranks), seeds 0 and 1: held-out loss over dense
# +27.8, +10.6, +0.7, -3.5, -8.5 and -6.8 % at H = 2 to 64 (bench/results/parity_outer_period.json);
# each loss converted to the steps dense training needed to reach it on its measured curve (1500
# steps, evaluated every 50) and taken over H = 32's. Interpolated in log H between the measured
# points, extrapolated from the end segments.
# Later in training it differs (bench/results/parity_thc_period_midrun_s18.json: from step 320
# of H = 32, a fresh outer step, four seeds): 4.4, 1.57, 1 and 0.90 at H = 8, 16, 32 and 64.
# Not charged: before step 320 H = 64 costs more, and its 10 % is inside the dead band
# (docs/guides/local-steps.md, "THC's own period cost mid-run").
OUTER_MOMENTUM_PERIOD = ((2, 9.33), (4, 2.98), (8, 1.62), (16, 1.33), (32, 1.0), (64, 1.08))


# The same for averaging under an Adam-family inner optimizer (the automatic route's THC outer
# step there): level up to H = 16, a little more beyond. Measured on the same LM with Adam 2e-3,
# 600 steps, seed 0 (bench/results/outer_period_31_adam_s11.json): held-out loss 1.771, 1.783,
# 1.777, 1.780, 1.810 and 1.834 at H = 2 to 64, and 1.80 for dense; each converted to the steps
# dense training needed to reach it on its curve (1500 steps, evaluated every ~30, its running
# minimum) and taken over the mean of H = 2-16: 0.99-1.01 there (taken as 1), 1.16 at 32, 1.19
# at 64.
OUTER_AVERAGE_PERIOD = ((2, 1.0), (16, 1.0), (32, 1.16), (64, 1.19))


def outer_period_cost(every, table=OUTER_MOMENTUM_PERIOD):
    """The inner steps an outer step needs at H = ``every``, over its best H's, interpolated in
    ``table`` (default the automatic route's outer Nesterov's: :data:`OUTER_MOMENTUM_PERIOD`)."""
    x = math.log2(max(float(every), 1.0))
    pts = [(math.log2(h), math.log(c)) for h, c in table]
    i = max(1, min(len(pts) - 1, next((k for k, (px, _) in enumerate(pts) if px >= x), len(pts) - 1)))
    (x0, y0), (x1, y1) = pts[i - 1], pts[i]
    return math.exp(y0 + (y1 - y0) * (x - x0) / (x1 - x0))


# The inner steps the automatic route's sparse rungs (auto_pseudo_rungs: SparseLoCo's chunked
# top-k of 4096 entries, 2-bit values, residual decayed 0.95; the clusters' sum as outer step)
# need to reach a loss at period H under SGD from the start of training, over what the THC rung
# (DiLoCo's Nesterov on THC 4 bits) needs at H = 32: OUTER_MOMENTUM_PERIOD's unit and reference.
# Measured as that was (bench/bench_parity.py --hidden 1024 --lr 0.05 --steps 600, seeds 0 and
# 1, each loss converted to dense's steps on its curve; THC H = 32's mean steps over each one's):
# bench/results/parity_sparse_period_s15.json. At 600 steps THC at H = 32 ended at 1.839 and
# 1.786, SparseLoCo 3 % at 1.888-1.943 (least at H = 8-16), 1 % at 1.907-2.003. It holds the
# compression's cost too (THC, entering beside it, keeps its own small backlog: about 0.3 % of
# the score, counted once more against the sparse rungs). It is charged where local steps are
# entered from the synchronous route (PseudoRung.entry_period), in place of the rung's backlog
# and period: early in training, as it was measured; a re-entry late in a run (after a phase
# back on the synchronous route, or a checkpoint loaded there) is charged it too, though later
# in training it over-charges. Charged in local mode too, it kept THC to the end at 20 Mbit/s
# (2.5x, 1.9x, 2.1x and 2.7x torchft's time to its loss, against 3.5x for the route moving to
# SparseLoCo at step 336 the same session): later in training a sparse pseudo-gradient costs
# less, SPARSE_SUM_LATER (below), which local mode charges.
SPARSE_SUM_PERIOD = {
    0.01: ((2, 1.541), (8, 1.426), (16, 1.467), (32, 1.576), (64, 1.649)),
    0.03: ((2, 1.381), (8, 1.327), (16, 1.307), (32, 1.415), (64, 1.437)),
}

# The same cost later in training, in the same unit: each rung from step 320 of THC at H = 32
# (the model, each rank's SGD momentum and the data position carried over, a fresh outer step),
# 320 steps more; each loss converted to the steps a dense continuation from that point needed to
# reach it; THC at H = 32 kept on over each rung, the median of four seeds (seed 0's reference
# ended on a bump and read 0.69-1.05 throughout): bench/results/parity_sparse_period_midrun_s16.json.
# THC restarted with a fresh outer step costs 1.00-1.21 on the same measure, dense 1.12-1.24.
# Charged in local mode (PseudoRung.later_period), in place of the rung's backlog, which charged
# 1.02-1.04 at any H: SparseLoCo 3 % at H = 8-16 then costs what THC does at H = 32, 1 % a
# quarter more there and three quarters more at H = 64. (THC's own period cost in local mode is
# still OUTER_MOMENTUM_PERIOD's, measured from scratch; the two share H = 32's reference.) Below
# H = 8 (not measured later in training) it rises as from the start of training, where H = 2 cost
# 1.04-1.08 times H = 8 (extrapolated from H = 8-16 it fell instead, and a 1 % rung at H = 2
# outscored THC).
_SPARSE_SUM_LATER_MEASURED = {
    0.01: ((8, 1.237), (16, 1.273), (32, 1.408), (64, 1.754)),
    0.03: ((8, 1.069), (16, 1.011), (32, 1.128), (64, 1.236)),
}
SPARSE_SUM_LATER = {
    d: ((2, pts[0][1] * dict(SPARSE_SUM_PERIOD[d])[2] / dict(SPARSE_SUM_PERIOD[d])[pts[0][0]]),) + pts
    for d, pts in _SPARSE_SUM_LATER_MEASURED.items()
}


def sparse_period_cost(density, tables=SPARSE_SUM_PERIOD):
    """The period cost of the automatic route's sparse rung of ``density`` under SGD, over THC's
    at H = 32: from the start of training (:data:`SPARSE_SUM_PERIOD`), or as ``tables`` measured
    it (:data:`SPARSE_SUM_LATER`); None where that density was not measured."""
    table = next((t for d, t in tables.items() if math.isclose(d, density)), None)
    return None if table is None else functools.partial(outer_period_cost, table=table)


def _measured_sparse(comp, hp, adaptive):
    """Whether rung ``comp`` with outer SGD hyperparameters ``hp`` is a sparse rung as
    :data:`SPARSE_SUM_PERIOD` and :data:`SPARSE_SUM_LATER` measured it: SparseLoCo (of a measured
    density), 2-bit values, chunks of 4096, residual decayed 0.95, summed over the clusters (no
    momentum, lr above 1), an inner optimizer not of the Adam family."""
    return (selective(comp) and not adaptive and getattr(comp, "bits", None) == 2
            and getattr(comp, "chunk", None) == 4096 and getattr(comp, "feedback_decay", None) == 0.95
            and hp.get("momentum", 0.0) == 0 and hp.get("lr", 1.0) > 1.0)


def entry_period_of(comp, hp, adaptive):
    """The ``PseudoRung.entry_period`` of rung ``comp`` with outer SGD hyperparameters ``hp``: its
    cost from the start of training (:func:`sparse_period_cost`) where :func:`_measured_sparse`,
    else None."""
    return sparse_period_cost(comp.density) if _measured_sparse(comp, hp, adaptive) else None


def later_period_of(comp, hp, adaptive):
    """The ``PseudoRung.later_period`` of rung ``comp`` with outer SGD hyperparameters ``hp``: its
    cost later in training (:data:`SPARSE_SUM_LATER`) where :func:`_measured_sparse`, else None."""
    return sparse_period_cost(comp.density, SPARSE_SUM_LATER) if _measured_sparse(comp, hp, adaptive) else None


def average_period_cost(every):
    """:func:`outer_period_cost` of averaging under an Adam-family inner optimizer
    (:data:`OUTER_AVERAGE_PERIOD`)."""
    return outer_period_cost(every, OUTER_AVERAGE_PERIOD)


def period_cost_of(hp, adaptive):
    """The period cost (``PseudoRung.period``) of an outer SGD with hyperparameters ``hp``: an
    outer step with momentum, :func:`outer_period_cost`; averaging (lr 1, no momentum) under an
    ``adaptive`` inner optimizer, :func:`average_period_cost`; otherwise (the clusters' sum of a
    sparse rung, or averaging under SGD, not measured) None, 1 at every H."""
    if hp.get("momentum", 0.0) > 0:
        return outer_period_cost
    if adaptive and hp.get("lr") == 1.0:
        return average_period_cost
    return None


def _backlog_of(controller, comp):
    return lambda est, every: pseudo_backlog(controller, est, comp, every)


def pseudo_backlog(controller, est, comp, every=1):
    """The backlog ``comp`` leaves on the pseudo-gradient at H = ``every``: a THC rung's as the
    controller counts it; a sparse rung's the synchronous shape of its density on the scale
    ``PSEUDO_SPARSE_KAPPA``, times :func:`sparse_pseudo_factor` (none, fp16 and bf16 leave none)."""
    if getattr(comp, "homomorphic", False):
        return controller.backlog(est, 1.0, comp.bits)
    if getattr(comp, "sparse", False):
        return PSEUDO_SPARSE_KAPPA * backlog_shape(comp.density) * sparse_pseudo_factor(every)
    return 0.0


def _announce(opt, step, reason):
    """Log (rank 0), count (hvd.stats()) and mark (timeline) the route now in force."""
    route = opt.route
    opt.route_changes.append((step, route, reason))
    state.current().wan_stats.annotate(route=route, route_reason=reason, route_step=step)
    timeline.instant("ROUTE", step=step, route=route, reason=reason)
    if rank() == 0:
        route_log.info("from step %d: %s (%s)", step, route, reason)


def _budget_warmup(route, session, decision):
    """Under the adjuster the density warm-up may raise the density only as far as the step-time
    budget allows (``Adjuster.target``; before the first estimate: not above the start)."""
    if hasattr(route, "warmup_cap"):
        est = decision.estimate if decision is not None else None
        route.warmup_cap = session.controller.budget_density(est) if est is not None else \
            session.compression.density if not getattr(session.compression, "homomorphic", False) else 1.0


class DensityTuner:
    """The adjuster on one synchronous compressed route (or the CPU engine): its session's
    decisions move the density, the THC bits and the backward passes, from the next step on. A
    move between a sparse rung and a THC rung replaces the route object (the residuals and
    velocities are the optimizer's, so they carry over)."""

    def __init__(self, opt, session):
        self.opt = opt
        self.session = session
        self.switches = []
        self.reason = None
        self.local = None

    def describe(self):
        return self.opt._route.describe()

    def after_step(self, measured):
        opt = self.opt
        route = opt._route
        steps = route._steps if route.kind == "cpu" else opt._step_count
        d = self.session.end_step(steps, opt.backward_passes_per_step)
        if d is None:
            return
        self.apply(d)

    def apply(self, d):
        opt, comp = self.opt, self.session.compression
        route = opt._route
        _budget_warmup(route, self.session, d)
        if route.kind == "cpu":
            route.set_compression(comp)
        elif route.kind != ("thc" if getattr(comp, "homomorphic", False) else "sparse"):
            opt._install(sparse_route(opt, comp), opt._outer)
        else:
            route.set_compression(comp)
        if d.passes != opt.backward_passes_per_step:
            opt.set_backward_passes_per_step(d.passes)
        if d.changed:
            _announce(opt, opt._step_count, d.reason)

    def save(self, out):
        pass

    def restore(self, state_dict):
        return lambda: None

    def sync_state(self, root_rank):
        pass


class ModeSwitch:
    """The optimizer that moves between a synchronous route (tuned by the adjuster's session:
    densities, THC bits, dense) and local steps (the cluster's route and a LocalStepsSync, H
    chosen by the local-steps rule), on every rank at the same step, by the time-to-loss
    objective (adjust/mode_rule.py).

    * To local steps, after a synchronous decision: the parameters (the same on every rank)
      become the anchor, H starts at the mode rule's prediction, the rule's history and the
      outer optimizer's state are cleared (they belong to a past phase). With momentum
      correction each rank's velocity is averaged inside its cluster into SGD's momentum buffer
      (cheap: no WAN), so the cluster's momentum goes on where the ranks' left off.
    * Back to the synchronous route, after an exchange (with ``overlap``, after
      ``sync_clusters()``): every rank holds the agreed parameters. With momentum correction the
      cluster's momentum buffer becomes each rank's velocity again (the mean over ranks of
      the velocities is then the mean of the clusters' momentum: no WAN exchange); otherwise the
      user's optimizer state (SGD's momentum, Adam's moments; not its step counts) is averaged
      over all ranks, weighted by cluster size, because each cluster's followed its own
      gradients and the synchronous route needs it equal everywhere.

    * Each rank a replica (the automatic route's own local steps): from the entry, where the
      cluster's reductions in the synchronous steps took at least half the hysteresis of a local
      step's predicted time (:meth:`_predicted_inner_share`); else after a period of local
      steps (the first of a phase included) in which they took that share of the wall time on
      its slowest rank, inner steps reduce nothing from the next step on (RankRoute, as
      ``LocalSteps(inner="rank")``), for the rest of the run; the checkpoint's ``stella_mode``
      holds it. With momentum correction each rank's velocity is then its own momentum buffer.

    The error-feedback residuals (the optimizer's) and the controller's estimates and rung carry
    over: what was not sent is sent when the route is back.
    """

    def __init__(self, opt, sync_route, cluster_route, session, local, rungs, adjuster, probe=None, rung_outers=None):
        self.opt = opt
        self.sync_route = sync_route
        self.cluster_route = cluster_route   # local steps' gradient route (DenseRoute kind "cluster", or RankRoute)
        self._cluster_dense = cluster_route   # (kept: its lane was built collectively, at construction)
        self.chooses_inner = False    # the automatic route's own local steps: it moves to "rank" by measurement
        self._busy_mark = None        # (local.clock(), the lane's busy seconds) at the last measure
        self.session = session
        self.local = local
        self.rungs = tuple(rungs)     # the pseudo-gradient's compressions (one when it is not chosen)
        # per rung, the outer SGD's hyperparameters (the automatic route's), or None: the user's outer
        self.rung_outers = rung_outers
        self.switches = []            # [(step, mode, reason)], the same on every rank
        self.reason = None
        self.votes = collections.deque(maxlen=KEEP_WINDOWS)   # every mode decision: (step, mode, reason)
        self.rule = None
        if session is not None:
            ctrl = session.controller
            nclusters = opt._spec.clusters
            # (a fragment holds at least one parameter: F above their count is not offered)
            fitting = tuple(f for f in adjuster.fragments if f <= len(local.named)) or (1,)
            self.rule = ModeRule(dataclasses.replace(adjuster, fragments=fitting), ctrl, nclusters,
                                 [PseudoRung(n, payload_per_entry(c, nclusters), _backlog_of(ctrl, c), period,
                                             entry, later)
                                  for n, c, period, entry, later in zip(
                                      self.rung_names, self.rungs, self._rung_periods(local),
                                      self._measured_periods(entry_period_of),
                                      self._measured_periods(later_period_of))],
                                 link_bps=probe.pair_bps if probe is not None else None,
                                 schedules=schedules_fit(local.settings, opt._spec.process_set.topology,
                                                         inner_steps_off_thread(opt, cluster_route)),
                                 shares={f: fragment_shares(local.named, f) for f in fitting})
            local.schedules_chosen = self.rule.schedules

    def _measured_periods(self, of):
        """Per rung, its measured cost as local steps are entered (``of`` :func:`entry_period_of`)
        or in local mode (:func:`later_period_of`): the automatic route's rungs only (their outer
        steps are the ones measured)."""
        if not self.rung_outers:
            return [None] * len(self.rungs)
        adaptive = adaptive_inner(self.opt)
        return [of(c, hp, adaptive) for c, hp in zip(self.rungs, self.rung_outers)]

    def _rung_periods(self, local):
        """Per rung, the period cost of the outer step it runs with (:func:`period_cost_of`): the
        automatic route's outer step for that rung, else the user's outer optimizer's (the largest
        momentum and learning rate of its groups)."""
        adaptive = adaptive_inner(self.opt)
        if self.rung_outers:
            return [period_cost_of(hp, adaptive) for hp in self.rung_outers]
        groups = [g for outer in local.outers for g in outer.param_groups]
        hp = {k: max((float(g.get(k, 0.0)) for g in groups), default=0.0) for k in ("momentum", "lr")}
        return [period_cost_of(hp, adaptive)] * len(self.rungs)

    @property
    def pseudo(self):
        """The pseudo-gradient's compression now."""
        return self.rungs[self.rule.pseudo_index] if self.rule is not None else self.rungs[0]

    @property
    def rung_names(self):
        """The rungs as logs and checkpoints name them."""
        return [_comp_name(c) for c in self.rungs]

    @classmethod
    def build(cls, opt):
        """The ModeSwitch of a spec with modes or the automatic route."""
        spec = opt._spec
        automatic = spec.route_kind() == "auto"
        adjuster = spec.adjuster or AdjusterSettings()
        settings = dataclasses.replace(adjuster, modes=MODES,
                                       thc_bits=adjuster.thc_bits or (AUTO_THC_BITS if automatic else ()))
        if spec.stella_compression:
            base = spec.compression
        else:   # the automatic route's sparse rungs; 16-bit values where the user asked for fp16/bf16
            value_dtype = {"fp16": "float16", "bf16": "bfloat16"}.get(getattr(spec.compression, "name", ""), "float32")
            base = Compression.cacheaware(density=AUTO_DENSITY, value_dtype=value_dtype)
        adaptive = adaptive_inner(opt)
        ls = spec.local_steps or LocalSteps(every=8, outer=auto_thc_outer(adaptive))
        if schedules_fit(ls) and ls.mix == 0:   # the adjuster's delays keep the cluster's progress
            ls = dataclasses.replace(ls, mix="progress")
        # the pseudo-gradient's rungs: the user's (the adjuster's, or LocalSteps' one); the
        # automatic route's; THC 4 bits
        rungs = adjuster.pseudo_rungs or ((ls.compression,) if ls.compression is not None else
                                          auto_pseudo_rungs() if automatic else
                                          (Compression.thc(bits=AUTO_PSEUDO_BITS),))
        # the outer step follows the rung where the route chose the outer optimizer too
        rung_outers = [auto_outer_of(c, spec.clusters, adaptive) for c in rungs] if spec.local_steps is None else None
        pset = spec.process_set
        probe = probe_link(pset) if automatic and pset.included() and spec.clusters >= 2 else None
        session = adjust_session(settings, base, pset, overlap=False, passes=spec.passes) \
            if spec.clusters >= 2 else None
        if session is not None:
            sync = sparse_route(opt, session.compression)
            _budget_warmup(sync, session, None)
        elif spec.stella_compression:
            sync = sparse_route(opt, base)
        else:   # one cluster, no stella compressor: nothing crosses a WAN, Horovod's route
            sync = DenseRoute(opt, pset, spec.compression, spec.op, spec.predivide)
        cluster_route = DenseRoute(opt, cluster_process_set(), kind="cluster")
        local = local_steps_sync(opt, ls, rungs[0], cluster_route.channel, LocalStepsRule(settings, ls.every))
        switch = cls(opt, sync, cluster_route, session, local, rungs, settings, probe, rung_outers)
        if spec.local_steps is None and switch.rule is not None:   # the route's own local steps: it
            switch.chooses_inner = True                             # chooses the replicas too
            local.inner_busy = switch._inner_busy
        opt._tuner = switch
        opt._session = session
        opt._install(sync, NoOuterSync())
        if session is not None:
            why = "the adjuster's first rung"
            if probe is not None:
                why = "link measured at %.0f Mbit/s, %.1f ms latency" % (probe.bandwidth_bps / 1e6,
                                                                         1e3 * probe.latency_s)
            switch._start_line(probe, automatic, why)

    # ---------------- what runs

    @property
    def mode(self):
        return self.opt.mode

    def describe(self):
        if self.opt._outer.kind == "local":
            return "local steps H=%d, pseudo-gradient %s%s" % (self.local.every, _comp_name(self.pseudo),
                                                              ", each rank a replica" if self.inner == "rank" else "")
        return self.opt._route.describe()

    def _start_line(self, probe, automatic, why):
        opt, spec = self.opt, self.opt._spec
        topo = spec.process_set.topology
        sizes = "+".join(str(len(m)) for m in topo.cluster_members)
        route = opt.route
        opt.route_changes.append((0, route, why))
        state.current().wan_stats.annotate(route=route, route_reason=why, route_step=0,
                                           wan_probe_bps=probe.bandwidth_bps if probe else None)
        timeline.instant("ROUTE", step=0, route=route, reason=why)
        if rank() != 0:
            return
        how = ("automatic route across %d clusters (%s ranks); %s; starting with %s, then the adjuster chooses "
               "dense, sparse densities, THC bits or local steps by time to loss. For Horovod's exact dense numerics: "
               "STELLA_WAN_ROUTE=dense (stellarun --wan-route dense)" % (topo.num_clusters, sizes, why, route)
               if automatic else
               "%d clusters (%s ranks); the adjuster moves between %s and local steps, starting with %s"
               % (topo.num_clusters, sizes, _comp_name(spec.compression), route))
        route_log.info("%s", how)

    # ---------------- the step

    def after_step(self, measured):
        opt = self.opt
        if opt._outer.kind == "local":
            if self.rule is not None and measured is not None:
                compute, exchange, wire = measured
                rung, now = self.rule.pseudo_index, self.schedule
                _, self.reason = self.rule.after_local(compute, exchange, self.local.every, wire, now,
                                                       self.local.steady_s)
                self.votes.append((opt._step_count, self.rule.mode, self.reason))
                if self.rule.mode == "sync":
                    self._enter_sync()
                    return
                if self.rule.pseudo_index != rung or self.rule.predicted_schedule.kind != now.kind:
                    self._take_rung(self.rule.predicted_every)
            self._choose_inner()
            return
        session = self.session
        if session is None:
            return
        d = session.end_step(opt._step_count, opt.backward_passes_per_step)
        if d is None:
            return
        comp = session.compression
        route = opt._route
        if route.kind != ("thc" if getattr(comp, "homomorphic", False) else "sparse"):
            self.sync_route = sparse_route(opt, comp)
            opt._install(self.sync_route, opt._outer)
        else:
            route.set_compression(comp)
        _budget_warmup(opt._route, session, d)
        if d.estimate is not None:
            mode, self.reason = self.rule.after_sync(d.estimate)
            self.votes.append((opt._step_count, mode, self.reason))
            if mode == "local":
                self._enter_local()
                return
        if d.changed:
            _announce(opt, opt._step_count, d.reason)

    def _record(self, mode):
        opt = self.opt
        self.switches.append((opt._step_count, mode, self.reason))
        log.info("stella_mpi: from step %d %s (%s)", opt._step_count,
                 "local steps" if mode == "local" else "synchronous", self.reason)
        timeline.instant("ADJUST_MODE", step=opt._step_count, mode=mode, reason=self.reason)
        _announce(opt, opt._step_count, self.reason)

    def _set_mode(self, mode):
        """The route of the next step: local steps on the cluster's set with the session paused,
        or the synchronous route with the session resumed."""
        opt = self.opt
        if mode == "local":
            opt._session = None
            opt._install(self.cluster_route, self.local)
        else:
            opt._session = self.session
            self.session.resume()
            opt._install(self.sync_route, NoOuterSync())

    @property
    def schedule(self):
        """The schedule local steps run (or would run) now."""
        return Schedule(*self.local.schedule)

    def _take_rung(self, every):
        """Local steps go on through the rule's pseudo rung from the next period, at H = ``every``
        (the rung's predicted H; the local-steps rule starts over from it). The exchange keeps its
        collectives' names, so the residual carries over. Where the schedule is not the
        whole-model blocking one before or after, the clusters are synchronized first
        (``sync_clusters``: the exchange in flight applied, every fragment exchanged) and a new
        phase starts under the rule's schedule (fresh anchors; each parameter's outer state kept,
        in whichever fragment it now is)."""
        sched = self.rule.predicted_schedule
        if self.rule.schedules and (self.local.streaming or sched != BLOCKING):
            self.local.sync_clusters()
            # the same phase under another schedule: the outer momentum goes on (_use_rung clears it
            # where the rung's outer hyperparameters change)
            self.local.restart(every, (sched.fragments, sched.delay), keep_outer_state=True)
            self._use_rung()
        else:
            self._use_rung()
            self.local.progress.every = every
            if self.local.rule is not None:
                self.local.rule.restart(every)
        self._record("local")

    def _use_rung(self):
        """The rule's pseudo rung in force: the exchange's compressor, and the outer SGD's
        hyperparameters of that rung (the automatic route's: the clusters' sum for a sparse rung,
        Nesterov for THC), its state cleared when they change (a momentum of the other rung's
        steps); the user's outer optimizer is left as it is."""
        self.local.exchange.comp = self.pseudo
        if self.rule is not None and self.local.rule is not None:   # H by time to loss, for this rung
            self.local.rule.score = self.rule.period_score()
        hp = self.rung_outers[self.rule.pseudo_index] if self.rung_outers and self.rule is not None else None
        if hp is None:
            return
        for outer in self.local.outers:
            if any(g.get(k) != v for g in outer.param_groups for k, v in hp.items()):
                for g in outer.param_groups:
                    g.update(hp)
                outer.state.clear()

    def _enter_local(self):
        every, sched = self.rule.predicted_every, self.rule.predicted_schedule
        share = self._predicted_inner_share()
        if share is not None:   # (installed below, with local steps)
            self._use_inner("rank")
            self.reason += ("; each rank a replica, nothing reduced at inner steps: the cluster's reductions took "
                            "%.0f %% of a local step's predicted time in the synchronous steps" % (100 * share))
        self._start_share()
        self.local.restart(every, (sched.fragments, sched.delay) if self.rule.schedules else None)
        self._use_rung()
        self._velocity_to_buffers()
        self._set_mode("local")
        self._record("local")

    def _enter_sync(self):
        self.local.sync_clusters()
        if self.opt._mc is not None:
            self._buffers_to_velocity()
        else:
            self._average_optimizer_state()
        self._set_mode("sync")
        self._record("sync")

    # ---------------- the replicas: each cluster, or each rank

    @property
    def inner(self):
        """The replicas of local steps: "cluster" (its DenseRoute) or "rank" (RankRoute)."""
        return "rank" if self.cluster_route.kind == "rank" else "cluster"

    def _inner_busy(self):
        """The share of this rank's wall time (its steps and their exchanges) spent in its
        cluster's reductions since the last call (since entering or taking local steps for the
        first call of a phase; 0 where its cluster reduces nothing: one rank, or each rank a
        replica already); LocalStepsSync gathers it with the period's times. The route's busy
        seconds count every way the cluster reduces (its channel, the negotiation, NCCL, a GPU
        staged through the host): the channel's alone left GPU clusters at 0."""
        mark, self._busy_mark = self._busy_mark, self._busy_now()
        if not self._cluster_reduces() or mark is None or self._busy_mark[0] <= mark[0]:
            return 0.0
        return (self._busy_mark[1] - mark[1]) / (self._busy_mark[0] - mark[0])

    def _cluster_reduces(self):
        """Whether inner steps reduce anything: the cluster's route, on a cluster of several ranks."""
        route = self.cluster_route
        return route.kind == "cluster" and route.process_set.included() and route.process_set.size() > 1

    def _busy_now(self):
        """(local steps' clock, the cluster route's busy seconds): the marks the share is taken between."""
        return self.local.clock(), self.cluster_route.busy_s

    def _start_share(self):
        """The share of the cluster's reductions is measured from now on (a phase of local steps
        entered or taken): a share gathered before, in another phase, is dropped."""
        self._busy_mark = self._busy_now()
        self.local.inner_busy_share = None

    def _predicted_inner_share(self):
        """The automatic route's replicas as it enters local steps: the share of a local step's
        predicted wall time (``ModeRule.predicted_step_s``: the step, an upper bound, and what
        the exchange blocks, over H; :meth:`_choose_inner` measures steps and exchanges alike)
        that the cluster's reductions took in the synchronous steps (the hierarchy's
        intra-cluster stages of the slowest rank, ``Estimate.intra_s``, from the gathered
        telemetry: the same on every rank). Where it reaches the dead band's share that
        :meth:`_choose_inner` asks of the measured one, each rank is a replica from the first
        local step, and the share is returned. Otherwise None: the first period of local steps
        measures it. (Deciding at the first period's end cost the byte LM at 1 Gbit/s 32 steps
        of about 100 ms where each rank a replica steps in about 70.)"""
        if not self.chooses_inner or self.inner != "cluster":
            return None
        est, step = self.rule.sync_estimate, self.rule.predicted_step_s
        if est is None or not step or step <= 0.0:
            return None
        share = est.intra_s / step
        return share if share >= self.rule.settings.hysteresis / 2 else None

    def _choose_inner(self):
        """The automatic route's replicas, after each period of local steps that gathered the
        ranks' times (the first one of a phase included): where the cluster's reductions took at
        least the dead band's share of the wall time (steps and exchanges) on its slowest rank
        (half the hysteresis, as for
        every other move of the adjuster), each rank becomes a replica from the next step
        (``LocalSteps(inner="rank")``: no reduction at inner steps), for the rest of the run. The
        decision is taken from gathered values: the same on every rank. Each replica then sees
        one rank's batch, not its cluster's; on the byte LM that cost 0.5-0.6 % of held-out loss
        at equal steps, for steps 1.2x shorter (docs/guides/local-steps.md)."""
        share, self.local.inner_busy_share = self.local.inner_busy_share, None
        if not self.chooses_inner or self.inner != "cluster" or share is None:
            return
        if share < self.rule.settings.hysteresis / 2:
            return
        self.reason = ("the cluster's reductions took %.0f %% of the time of local steps and their exchanges (the "
                       "slowest rank's): each rank a replica, nothing reduced at inner steps" % (100 * share))
        self._use_inner("rank")
        _announce(self.opt, self.opt._step_count, self.reason)

    def _use_inner(self, inner):
        """Local steps' replicas from the next step: each cluster (its DenseRoute) or each rank
        (RankRoute). The mode rule measures its steps and schedules again."""
        if inner == self.inner:
            return
        opt = self.opt
        self.cluster_route = RankRoute(opt, opt._spec.process_set) if inner == "rank" else self._cluster_dense
        if opt._outer is self.local:
            opt._install(self.cluster_route, self.local)
        if self.rule is not None:
            # the steps are measured again (what a past phase measured of the cluster's does not
            # hold); a schedule entered from a prediction is still corrected from the first
            # measured periods (the choice comes at the entry or the first period, before any). A
            # checkpoint's mode is taken after this, with its own calibration (_take_mode)
            self.rule.take(self.rule.mode, recalibrate=self.rule.mode == "local")

    # ---------------- the user's optimizer state across a switch

    def _velocity_to_buffers(self):
        """Momentum correction: each rank's velocity, averaged inside its cluster, becomes SGD's
        momentum buffer (the cluster's momentum in local steps)."""
        opt = self.opt
        mc = opt._mc
        if mc is None:
            return
        held = [p for p in opt._mc_groups if opt._names[p] in mc.velocity]
        if not held:
            return
        if self.inner == "rank":   # each rank a replica: its own velocity
            for p in held:
                opt.state[p]["momentum_buffer"] = mc.velocity[opt._names[p]].detach().clone()
            return
        cluster = self.cluster_route.process_set
        out = synchronize(grouped_allreduce_async([mc.velocity[opt._names[p]].contiguous() for p in held],
                                                  op=Average, name="mode_switch.velocity", process_set=cluster))
        for p, v in zip(held, out):
            opt.state[p]["momentum_buffer"] = v.clone()

    def _buffers_to_velocity(self):
        """Momentum correction: the cluster's momentum buffer (the same on its ranks) becomes
        each rank's velocity; the buffers themselves are left to SGD, which does not read them
        while the route carries velocities."""
        opt = self.opt
        for p in opt._mc_groups:
            buf = opt.state.get(p, {}).get("momentum_buffer")
            if buf is not None:
                opt._mc.velocity[opt._names[p]] = buf.detach().clone()

    def _average_optimizer_state(self):
        """Every floating-point tensor of the user's optimizer state averaged over all ranks,
        weighted by cluster size as the pseudo-gradients are (one dense exchange, at the switch
        only)."""
        opt = self.opt
        held = [(p, key) for p in opt._params for key, t in sorted(opt.state.get(p, {}).items())
                if torch.is_tensor(t) and t.is_floating_point() and t.numel() > 0 and key != "step"]
        if not held:
            return
        tensors = [opt.state[p][key].contiguous() for p, key in held]
        out = synchronize(grouped_allreduce_async(tensors, op=Average, name="mode_switch.state"))
        for (p, key), t in zip(held, out):
            opt.state[p][key].copy_(t)

    # ---------------- checkpoints

    def _saved_mode(self):
        return {"mode": self.opt.mode,
                "sync_estimate": self.rule.saved_estimate() if self.rule is not None else None,
                "pseudo": _comp_name(self.pseudo), "inner": self.inner}

    def _saved_schedule(self, saved):
        """(H, F, delay) of a local-steps state ``saved`` (a checkpoint's, the root's) where the
        adjuster chooses the schedule and the state's differs from the current one (None
        otherwise: the state is checked against the optimizer's own), with the names of its
        fragments; ValueError naming a schedule that does not fit this optimizer."""
        if not self.local.schedules_chosen or not isinstance(saved, dict):
            return None, None
        fragments = saved_fragments(saved)
        delay, every = saved.get("delay", 0), saved.get("every", self.local.every)
        if (every, fragments, delay) == (self.local.every,) + self.local.schedule:
            return None, None
        try:
            _, cut = self.local.planned(every, fragments, delay)
        except (TypeError, ValueError) as e:
            raise ValueError("DistributedOptimizer checkpoint: stella_local_steps holds the schedule every=%r, "
                             "fragments=%r, delay=%r, which does not fit this optimizer: %s"
                             % (every, fragments, delay, e)) from None
        return (every, fragments, delay), cut

    def save(self, out):
        out["stella_local_steps"] = self.local.state_dict()
        out["stella_mode"] = self._saved_mode()

    def restore(self, state_dict):
        """Check the checkpoint's mode and local-steps state now (before anything is loaded);
        returns what takes them afterwards (the parameters are taken as loaded, no exchange)."""
        saved_mode = state_dict.pop("stella_mode", {"mode": "sync", "sync_estimate": None})
        mode, estimate, pseudo = checked_mode(saved_mode, self.rung_names)
        inner = checked_inner(saved_mode, self.chooses_inner)
        saved = state_dict.pop("stella_local_steps", None)
        schedule = None
        if saved is not None:
            schedule, cut = self._saved_schedule(saved)
            self.local.check(saved, cut)

        def take():
            self.local.drop_in_flight()
            if saved is not None:   # (checked above: a refused checkpoint changes nothing)
                self._load_local(saved, schedule)
            self._use_inner(inner)
            self._take_mode(mode, estimate, pseudo)
        return take

    def _load_local(self, saved, schedule):
        """Local steps take the state ``saved``, replanned first to its ``schedule`` (H, F, delay)
        where :meth:`_saved_schedule` found one."""
        if schedule is not None:
            self.local.replan(*schedule)
        self.local.load_state_dict(saved)

    def _take_mode(self, mode, estimate, pseudo=None):
        if self.session is None:
            return
        if mode != self.opt.mode:
            if mode == "local" and not self.local.anchor:
                self.local.capture()
            self._set_mode(mode)
        self.rule.take(mode, estimate, pseudo, self.schedule)
        self._use_rung()
        self._start_share()   # (a checkpoint's local steps: measured from here)

    def sync_state(self, root_rank):
        """broadcast_optimizer_state: ``root_rank``'s local-steps state and mode on every rank (a
        checkpoint loaded on the root alone may have changed its mode)."""
        self.local.drop_in_flight()
        mine = self.local.state_dict_on_host() if rank() == root_rank else None
        theirs = broadcast_object(mine, root_rank, name="local_steps.state")
        self._load_local(theirs, self._saved_schedule(theirs)[0])
        saved_mode = broadcast_object(self._saved_mode() if rank() == root_rank else None, root_rank,
                                      name="mode_switch.mode")
        self._use_inner(checked_inner(saved_mode, self.chooses_inner))
        self._take_mode(*checked_mode(saved_mode, self.rung_names))


def schedules_fit(ls, topology=None, off_thread=False):
    """Whether the adjuster may choose the schedule (F, delay) of local steps ``ls`` (the user's
    LocalSteps under ``modes``, or the automatic route's): not over the user's own fragments,
    delay, overlap or time pace; and only where every cluster's inner steps reduce without the
    collective thread: every cluster of ``topology`` has one rank (routes/sync.py's
    ``reduce_alone``), or ``off_thread`` (agreed by every rank: each cluster of several ranks
    reduces every gradient on its ClusterChannel). Gradients that go through the collective
    thread wait behind the exchange in flight, so a delay hides nothing: measured on the byte LM,
    2 clusters of 2 ranks at 100 Mbit/s, the steps went from 55-62 ms to 95 ms under 4 delayed
    fragments (docs/guides/local-steps.md), before the channel."""
    alone = topology is None or max(len(m) for m in topology.cluster_members) == 1
    return (ls.fragments == 1 and ls.delay == 0 and not ls.overlap and ls.pace == "steps"
            and ls.fragment_groups is None and not isinstance(ls.outer, torch.optim.Optimizer)
            and (alone or off_thread))


def inner_steps_off_thread(opt, cluster_route):
    """Whether every rank's inner steps reduce without the collective thread: alone in its
    cluster, or on the cluster's channel with every parameter a tensor the channel takes (CUDA
    tensors go through NCCL on the thread). One MIN allreduce over the optimizer's process set,
    so that every rank offers the adjuster the same schedules."""
    mine = cluster_route.process_set.size() == 1 or (
        cluster_route.channel is not None and all(ClusterChannel.takes([p]) for p in opt._params))
    flag = torch.tensor([1 if mine else 0], dtype=torch.int32)
    pset = opt._spec.process_set
    name = state.current().auto_name("DistributedOptimizer.off_thread", pset)
    return bool(synchronize(allreduce_async(flag, op=Min, name=name, process_set=pset))[0])


def _comp_name(comp):
    if getattr(comp, "homomorphic", False):
        return "thc %d bits" % comp.bits
    if getattr(comp, "sparse", False):
        bits = getattr(comp, "bits", None)
        decay = getattr(comp, "feedback_decay", 1.0)
        return "%s %g %%%s%s" % (comp.name, 100 * comp.density, " %d bits" % bits if bits else "",
                                 " decay %g" % decay if decay != 1.0 else "")
    return comp.name


def checked_inner(saved, chosen):
    """The replicas of local steps in a checkpoint's ``stella_mode`` ("cluster" where it names
    none: the releases before the choice); ValueError naming a value that is not one, or "rank"
    where this optimizer does not choose them (the user's LocalSteps under modes)."""
    inner = saved.get("inner", "cluster") if isinstance(saved, dict) else "cluster"
    if inner not in INNERS:
        raise ValueError("DistributedOptimizer checkpoint: stella_mode's inner must be one of %s, got %r"
                         % (", ".join(INNERS), inner))
    if inner == "rank" and not chosen:
        raise ValueError("DistributedOptimizer checkpoint: stella_mode's inner is 'rank' (each rank a replica, as the "
                         "automatic route chose), but this optimizer's local steps are the user's (inner='cluster'); "
                         "load it into the automatic route (no local_steps=...)")
    return inner


def checked_mode(saved, rungs=()):
    """(mode, Estimate or None, index of the pseudo rung or None) from a checkpoint's
    ``stella_mode``, whose ``pseudo`` (absent before the rungs: None) must name one of ``rungs``;
    ValueError naming what is wrong (before anything is loaded)."""
    what = "DistributedOptimizer checkpoint: stella_mode"
    if not isinstance(saved, dict) or saved.get("mode") not in MODES:
        raise ValueError("%s must be {'mode': one of %s, 'sync_estimate': ...}, got %r" % (what, MODES, saved))
    pseudo = saved.get("pseudo")
    if pseudo is not None:
        if pseudo not in rungs:
            raise ValueError("%s: the pseudo-gradient went through %r, which is not one of this optimizer's rungs (%s); "
                             "build the optimizer with the same Adjuster(pseudo_rungs=...) or LocalSteps(compression=...)"
                             % (what, pseudo, ", ".join(map(repr, rungs))))
        pseudo = list(rungs).index(pseudo)
    est = saved.get("sync_estimate")
    if est is None:
        return saved["mode"], None, pseudo
    fields = {f.name for f in dataclasses.fields(Estimate)}
    # (a field with a default may be missing: the previous release saved fewer)
    required = {f.name for f in dataclasses.fields(Estimate) if f.default is dataclasses.MISSING}
    if not isinstance(est, dict) or not required <= set(est) <= fields or not all(
            v is None or (isinstance(v, (int, float)) and math.isfinite(v)) for v in est.values()):
        raise ValueError("%s: sync_estimate must hold the numbers %s, got %r" % (what, sorted(fields), est))
    return saved["mode"], Estimate(**est), pseudo

