"""The routes the planner predicts, by name: what crosses the WAN (a :class:`.wire.Route`), whether
the exchange overlaps compute (the CPU engine at staleness 1), the outer optimizer of local steps,
and how the calibration builds the real optimizer for it (so the quality measured is the
route's own)."""
import os
from dataclasses import dataclass

from ..optim.outer_sync import LocalSteps
from .wire import Route


@dataclass(frozen=True)
class PlanRoute:
    name: str
    wire: Route
    overlap: bool = False      # the CPU engine, staleness 1: the exchange runs beside compute
    note: str = ""
    outer: str = "average"     # local steps' outer optimizer (a LocalSteps preset)

    def __post_init__(self):
        if self.wire.kind == "local":   # LocalSteps' own refusal of an outer it does not know
            LocalSteps(every=self.wire.every, outer=self.outer)
        elif self.outer != "average":
            raise ValueError("PlanRoute %r: outer=%r is local steps' outer optimizer; route kind %r has none (leave "
                             "outer 'average')" % (self.name, self.outer, self.wire.kind))

    def pseudo_compression(self, hvd):
        """The ``hvd.Compression`` local steps' pseudo-gradient crosses with (its Route's own
        compressor: the settings the planner's wire model counts)."""
        p = self.wire.pseudo
        if p is None or p.kind == "dense":
            return hvd.Compression.none
        if p.kind == "fp16":
            return hvd.Compression.fp16
        return p.make_compressor()

    def build(self, hvd, optimizer, model):
        """The ``hvd.DistributedOptimizer`` of this route around ``optimizer``."""
        w = self.wire
        named = model.named_parameters()
        if self.overlap:
            comp = w.make_compressor()
            return hvd.DistributedOptimizer(optimizer, named_parameters=named, compression=comp,
                                            engine=hvd.CpuEngine(staleness=1, model=model))
        if w.kind in ("dense", "fp16"):
            # Horovod's route, not the automatic one: asked for explicitly
            before = os.environ.get("STELLA_WAN_ROUTE")
            os.environ["STELLA_WAN_ROUTE"] = "dense"
            try:
                return hvd.DistributedOptimizer(optimizer, named_parameters=named,
                                                compression=getattr(hvd.Compression, "none" if w.kind == "dense"
                                                                    else "fp16"))
            finally:
                if before is None:
                    os.environ.pop("STELLA_WAN_ROUTE", None)
                else:
                    os.environ["STELLA_WAN_ROUTE"] = before
        if w.kind in ("sparse", "thc"):
            return hvd.DistributedOptimizer(optimizer, named_parameters=named, compression=w.make_compressor())
        if w.kind == "local":
            return hvd.DistributedOptimizer(optimizer, named_parameters=named, local_steps=hvd.LocalSteps(
                every=w.every, outer=self.outer, compression=self.pseudo_compression(hvd), fragments=w.fragments,
                delay=w.delay, inner=w.inner))
        raise ValueError("route %r: no way to build kind %r" % (self.name, w.kind))


def _sparse(name, compressor, density, **kw):
    return PlanRoute(name, Route(kind="sparse", compressor=compressor, density=density), **kw)


# SparseLoCo's recipe (Templar, 2025; bench/bench_time_to_loss.py local8+sparseloco): the
# pseudo-gradient's top 1 % per chunk of 4096 at 2 bits, error feedback decayed by 0.95, the
# clusters' sparse pseudo-gradients summed (outer "sum": an entry one cluster sent is not halved)
SPARSELOCO_1 = Route(kind="sparse", compressor="sparseloco", density=0.01, chunk=4096, bits=2, feedback_decay=0.95)


def _sparseloco(name, every):
    return PlanRoute(name, Route(kind="local", every=every, pseudo=SPARSELOCO_1), outer="sum",
                     note="SparseLoCo: 1 %% per chunk of %d at %d bits, outer sum" % (SPARSELOCO_1.chunk,
                                                                                   SPARSELOCO_1.bits))


ROUTES = (
    PlanRoute("dense", Route(kind="dense"), note="Horovod's dense fp32 allreduce"),
    PlanRoute("fp16", Route(kind="fp16"), note="dense, 16-bit on the wire"),
    _sparse("topk-1%", "topk", 0.01),
    _sparse("cacheaware-1%", "cacheaware", 0.01),
    _sparse("cacheaware-0.1%", "cacheaware", 0.001),
    PlanRoute("thc-8", Route(kind="thc", bits=8)),
    PlanRoute("thc-4", Route(kind="thc", bits=4)),
    PlanRoute("thc-2", Route(kind="thc", bits=2)),
    PlanRoute("local-8-thc4", Route(kind="local", every=8, pseudo=Route(kind="thc", bits=4))),
    PlanRoute("local-32-thc4", Route(kind="local", every=32, pseudo=Route(kind="thc", bits=4))),
    PlanRoute("local-8-f4-thc4", Route(kind="local", every=8, fragments=4, delay=1, pseudo=Route(kind="thc", bits=4)),
              note="Streaming DiLoCo: 4 fragments, one every 2 steps, each in flight for 1 step"),
    PlanRoute("local-32-thc4-rank", Route(kind="local", every=32, inner="rank", pseudo=Route(kind="thc", bits=4)),
              note="each rank a replica: nothing reduced inside the cluster at inner steps; its quality is "
                   "measured on the calibration's clusters (of one rank: local-32-thc4's), not what replicas "
                   "of one rank's batch cost on clusters of several"),
    _sparseloco("local-8-sparseloco1", 8),
    _sparseloco("local-32-sparseloco1", 32),
    PlanRoute("cpu-engine-1%", Route(kind="sparse", compressor="cacheaware", density=0.01), overlap=True,
              note="the C optimizer on the CPU, exchange beside compute (staleness 1)"),
)
BY_NAME = {r.name: r for r in ROUTES}


def select(names):
    """The routes named in ``names`` (a comma-separated string or None: all), in table order."""
    if not names:
        return list(ROUTES)
    wanted = [n.strip() for n in str(names).split(",") if n.strip()]
    unknown = [n for n in wanted if n not in BY_NAME]
    if unknown:
        raise ValueError("--routes: unknown route(s) %s; the planner knows %s" % (", ".join(unknown),
                                                                                  ", ".join(BY_NAME)))
    return [r for r in ROUTES if r.name in wanted]
