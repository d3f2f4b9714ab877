"""The routes the planner predicts, by name: what crosses the WAN (a :class:`.wire.Route`), whether
the exchange overlaps compute (the CPU engine at staleness 1), and how the calibration builds
the real optimizer for it (so the quality measured is the route's own)."""
import os
from dataclasses import dataclass

from .wire import Route


@dataclass(frozen=True)
class PlanRoute:
    name: str
    wire: Route
    overlap: bool = False      # the CPU engine, staleness 1: the exchange runs beside compute
    note: str = ""

    def build(self, hvd, optimizer, model):
        """The ``hvd.DistributedOptimizer`` of this route around ``optimizer``."""
        w = self.wire
        named = model.named_parameters()
        if self.overlap:
            comp = getattr(hvd.Compression, w.compressor)(density=w.density)
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
        if w.kind == "sparse":
            return hvd.DistributedOptimizer(optimizer, named_parameters=named,
                                            compression=getattr(hvd.Compression, w.compressor)(density=w.density))
        if w.kind == "thc":
            return hvd.DistributedOptimizer(optimizer, named_parameters=named,
                                            compression=hvd.Compression.thc(bits=w.bits))
        if w.kind == "local":
            p = w.pseudo
            comp = hvd.Compression.thc(bits=p.bits) if p is not None and p.kind == "thc" else hvd.Compression.none
            return hvd.DistributedOptimizer(optimizer, named_parameters=named, compression=comp,
                                            local_steps=hvd.LocalSteps(every=w.every))
        raise ValueError("route %r: no way to build kind %r" % (self.name, w.kind))


def _sparse(name, compressor, density, **kw):
    return PlanRoute(name, Route(kind="sparse", compressor=compressor, density=density), **kw)


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
