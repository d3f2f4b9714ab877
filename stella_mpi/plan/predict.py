"""Prediction of one route on one set of clusters, from the calibration, with the adjuster's
cost model (:mod:`..adjust.controller`, :mod:`..adjust.mode_rule`): one source of truth for what
a step costs.

For a layout (clusters of GPU kinds and uplinks) and a route, per optimizer step:

* **compute**: each cluster kind's seconds per sample -- this machine's (kind ``here``) from the
  calibration's fit, times the oversubscription of its host's cores; a GPU kind's from the
  model's FLOPs per sample over its throughput (:mod:`.gpus`) -- the global batch split in
  proportion to throughput (``controller.split_batch``), the slowest rank's pass counting;
* **WAN bytes and messages**: exactly what each rank's counters will record (:mod:`.wire`);
  a cluster's uplink carries what its ranks send (and, separately, what they receive), so the
  busiest uplink's time is the wire's, at the link's goodput (its nominal rate times the
  efficiency the calibration measured across a link, or the user's); a token-bucket shaper
  (``--link-burst``, tc tbf's burst) lets what refilled while the link idled through at once;
* **fixed**: the optimizer, the dense reduction inside the cluster (a ring over the cluster's
  fabric), the route's CPU work (selection, encoding, decoding, merge: measured on this route
  in the calibration and scaled to the layout's shard and cluster count by the kernels' costs,
  :mod:`.kernel_costs`), and what else the calibration's step held (bookkeeping);
* the step from :meth:`Controller.predict` (synchronous: compute + fixed + latency + wire;
  the CPU engine: max(compute, fixed + wire)), or for local steps ``local_step_time`` plus the
  exchange over H (:mod:`..adjust.mode_rule`).

Steps to a target are the route's own, measured in the calibration's run at equal steps (or
``--target-steps`` times the route's measured ratio to dense); time, cost and the work
revocations take follow.
"""
import math
import os
from dataclasses import dataclass
from typing import List, Optional

from ..adjust.controller import Controller, Estimate, split_batch
from ..adjust.mode_rule import local_step_time
from ..adjust.settings import AdjusterSettings
from ..comm.sparse_exchange import choose_algorithm
from .._native import compress as codec
from . import wire

STEADY = 100000           # the step whose traffic is predicted: past every warm-up
HERE = "here"            # the kind of this machine's CPU ranks (what the planner is checked against)
RESET_S = 5.0            # seconds an elastic reset takes after a revocation (bench_elastic.py: under 5 s)


@dataclass(frozen=True)
class Cluster:
    count: int
    kind: str
    link_bps: float
    price: Optional[float] = None          # USD per GPU-hour
    revocations: float = 0.0               # per GPU-hour
    host: Optional[str] = None


@dataclass(frozen=True)
class Layout:
    clusters: List[Cluster]
    global_batch: int
    delay_s: float = 0.0
    burst_bytes: float = 0.0               # a token-bucket shaper's burst (tc tbf's; 0: none)
    cores: Optional[int] = None            # cores of a ``here`` host (default: this machine's)

    @property
    def sizes(self):
        return [c.count for c in self.clusters]

    def ranks(self):
        """(cluster index, Cluster) of every world rank, cluster by cluster."""
        return [(i, c) for i, c in enumerate(self.clusters) for _ in range(c.count)]

    def oversubscription(self, cluster):
        """How many ranks share each core of ``cluster``'s host (1 for GPUs: a rank each)."""
        if cluster.kind != HERE:
            return 1.0
        host = cluster.host or HERE
        sharing = sum(c.count for c in self.clusters if c.kind == HERE and (c.host or HERE) == host)
        return max(1.0, sharing / float(self.cores or os.cpu_count() or 1))


def sharing_ratio(layout, machine, cluster):
    """How many times more ranks share each core of ``cluster``'s host than shared this
    machine's in the calibration (1 for GPU kinds)."""
    if cluster.kind != HERE:
        return 1.0
    return layout.oversubscription(cluster) / machine.sharing


def layout_from_spec(spec):
    cl = [Cluster(count=int(c["count"]), kind=c["kind"], link_bps=float(c["link"]), price=c.get("price"),
                  revocations=float(c.get("revocations", 0.0)), host=c.get("host")) for c in spec["clusters"]]
    return Layout(clusters=cl, global_batch=int(spec["global_batch"]), delay_s=float(spec.get("link_delay_s") or 0.0),
                  cores=spec.get("cores"), burst_bytes=float(spec.get("link_burst_bytes") or 0.0))


def _median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


class Machine:
    """What the calibration measured, as the prediction reads it."""

    def __init__(self, calib, table=None, kernel_costs=None):
        self.calib = calib
        self.table = table or {}
        self.costs = kernel_costs
        comp = calib.get("compute") or []
        self.per_sample_s = _median([c["per_sample_s"] for c in comp]) if comp else None
        self.intercept_s = _median([c["intercept_s"] for c in comp]) if comp else 0.0
        flops = [c["flops_per_sample"] for c in comp if c.get("flops_per_sample")]
        self.flops_per_sample = _median(flops) if flops else calib.get("flops_per_sample")
        # the calibration's ranks shared this host's cores as much: what it measured holds that sharing
        self.sharing = max(1.0, calib.get("ranks", 2) / float(calib.get("cores") or os.cpu_count() or 1))
        self.calib_sizes = calib.get("cluster_sizes") or [1, 1]
        link = calib.get("link") or {}
        self.link_efficiency = link.get("efficiency") or 1.0                  # a transfer's goodput
        self.allreduce_efficiency = link.get("allreduce_efficiency") or self.link_efficiency

    def seconds_per_pass(self, kind, batch, oversub):
        """Forward and backward of ``batch`` samples on one rank of ``kind`` (``oversub``: how
        many times more ranks share a core than in the calibration)."""
        if kind == HERE:
            if self.per_sample_s is None:
                raise ValueError("kind 'here' needs a model the calibration ran (a script, not a named size)")
            return (self.intercept_s + self.per_sample_s * batch) * oversub
        gpu = self.gpu(kind)
        if not self.flops_per_sample:
            raise ValueError("GPU kind %r: the model's FLOPs per sample are unknown (the FLOP counter could not "
                             "follow the model)" % kind)
        return batch * self.flops_per_sample / (gpu.tflops * 1e12 * gpu.mfu)

    def gpu(self, kind):
        from .gpus import get_gpu
        return get_gpu(kind, self.table or None)

    def optimizer_s(self, kind, numel, oversub):
        """The optimizer's step: measured here; on a GPU, memory-bound and small beside the
        pass (counted as 0: the table has no memory bandwidth)."""
        if kind == HERE:
            return self.calib.get("optimizer_s", 0.0) * oversub
        return 0.0

    def fabric_bps(self, kind, oversub):
        if kind == HERE:
            return self.calib["fabric_bps"] / oversub
        return self.gpu(kind).intra_gbps * 8e9


def _kernel_model(costs, w, rows, nclusters):
    """The kernels' CPU seconds (selection, encoding, decoding, merge) of one exchange through
    ``w`` (a synchronous wire route) on the busiest of ``rows``; None without kernel costs."""
    if costs is None:
        return None
    n = max(t["elements"] for t in rows)
    k = max(t["entries_sent"] for t in rows)
    if w.kind == "sparse":
        return costs.sparse_cpu_s(w.compressor, n, k, nclusters, choose_algorithm(w.algorithm, nclusters, 8 * k))
    if w.kind == "thc":
        return costs.thc_cpu_s(n, w.bits, nclusters)
    return costs.dense_cpu_s(n, nclusters)


def payload_scale(route, param_numels, fusion_bytes, measured):
    """For a compressor whose payload depends on the data (cache-aware blocks, threshold): its
    bytes over what the same number of entries as explicit indices would take, measured in the
    calibration's run of this route (its ranks' mean bytes sent per step, on its layout); 1
    without a measurement."""
    if measured is None or not measured.get("mean_wan_bytes_sent"):
        return 1.0
    sized = wire.step_traffic(route, measured["cluster_sizes"], param_numels, fusion_bytes=fusion_bytes,
                              step=STEADY, payload=_as_indices(1.0))
    mean = sum(t["wan_bytes_sent"] for t in sized) / len(sized)
    return measured["mean_wan_bytes_sent"] / max(mean, 1)


def _as_indices(scale):
    """A payload callable: k entries with explicit indices in the codec's smallest scheme, times
    ``scale``."""
    def payload(q):
        comp = q.compressor
        k = comp.k_for(q.n)
        nbytes = codec.payload_size(q.n, k, 0, codec.choose_scheme(q.n, k), comp.value_dtype)
        return wire.Payload(int(round(nbytes * scale)), k)
    return payload


def _payload_for(w, param_numels, fusion_bytes, measured):
    """The payload callable the wire model needs for a data-dependent sparse compressor (None
    for the others)."""
    if w is None or w.kind != "sparse" or getattr(w.make_compressor(), "payload_from_sizes", False):
        return None
    return _as_indices(payload_scale(w, param_numels, fusion_bytes, measured))



def period_traffic(route, sizes, param_numels, fusion_bytes=None, payload=None, step=None):
    """[each rank's counters] of every step of one period (H steps of local steps, else one
    step), in steady state (past the density warm-up), or from optimizer step ``step``;
    ``payload``: the wire model's callable for a data-dependent compressor (:func:`_payload_for`)."""
    w = route.wire
    every = w.every if w.kind == "local" else 1
    base = STEADY - STEADY % every if step is None else step
    return [wire.step_traffic(w, sizes, param_numels, fusion_bytes=fusion_bytes, step=base + s, payload=payload)
            for s in range(every)]


def summed(steps):
    """Each rank's counters summed over ``steps`` (:func:`period_traffic`)."""
    return [{k: sum(step[r][k] for step in steps) for k in wire.COUNTED} for r in range(len(steps[0]))]


def traffic_of(route, sizes, param_numels, fusion_bytes=None, payload=None, step=None):
    """Each rank's counters summed over one period (:func:`period_traffic`)."""
    return summed(period_traffic(route, sizes, param_numels, fusion_bytes, payload, step))


def _compute(machine, layout, oversub, measured):
    """(seconds of the slowest rank's pass, samples per rank): the global batch split by
    throughput; this machine's pass from the route's own measured pass in a training loop (the
    batch, forward, backward, the hooks) when there is one, scaled by the fit to the batch."""
    per_sample = [machine.seconds_per_pass(c.kind, 1, 1.0) - (machine.intercept_s if c.kind == HERE else 0.0)
                  for c in layout.clusters]
    throughput = [1.0 / (max(ps, 1e-12) * o) for ps, o, c in zip(per_sample, oversub, layout.clusters)
                  for _ in range(c.count)]
    batch = split_batch(layout.global_batch, throughput, None)
    anchor = 1.0
    if measured is not None and machine.per_sample_s is not None:
        fitted = machine.seconds_per_pass(HERE, machine.calib.get("per_rank_batch", 1), 1.0)
        anchor = measured["compute_s"] / fitted if fitted > 0 else 1.0
    passes = [machine.seconds_per_pass(c.kind, b, oversub[i]) * (anchor if c.kind == HERE else 1.0)
              for (i, c), b in zip(layout.ranks(), batch)]
    return max(passes), batch


def _intra_s(machine, kind, k, numel, oversub):
    """The dense reduction inside a cluster of ``k`` ranks: a ring's 2 (k-1)/k of the gradient."""
    return 2.0 * (k - 1) / k * 32.0 * numel / machine.fabric_bps(kind, oversub) if k > 1 else 0.0


def _intra_per_step(route, intra_s):
    """A step's share of the reductions inside its cluster: one a step, or with each rank a replica
    (``LocalSteps(inner="rank")``) none at inner steps, and the exchange's dense reduction of the
    pseudo-gradient inside the cluster once a period."""
    w = route.wire
    return intra_s / w.every if w.kind == "local" and w.inner == "rank" else intra_s


def predict(route, layout, machine, param_numels, fusion_bytes=None, measured=None, sync_measured=None):
    """The prediction of ``route`` (a PlanRoute) on ``layout`` in steady state: a dict of seconds,
    bytes and ratios, with ``warmup_extra_s``, what the density warm-up's steps (they send more)
    add over as many steady ones. ``measured``: the calibration's record of this route (the
    busiest rank's medians per step), or None; ``sync_measured``: for local steps, the record of
    the synchronous route of their pseudo-gradient's compression (its CPU work per exchange: a
    local step's median holds no exchange)."""
    ctx = _Prediction(route, layout, machine, param_numels, fusion_bytes, measured, sync_measured)
    out = ctx.at(None)
    out["warmup_extra_s"] = sum(ctx.at(s)["step_s"] - out["step_s"] for s in range(_warmup_steps(route)))
    return out


class _Prediction:
    """What a route's step costs on a layout apart from the step's own traffic (computed once),
    and the step at a given traffic (:meth:`at`)."""

    def __init__(self, route, layout, machine, param_numels, fusion_bytes, measured, sync_measured):
        self.route, self.layout, self.machine = route, layout, machine
        self.params, self.fusion = param_numels, fusion_bytes
        numel = sum(param_numels)
        self.oversub = oversub = [sharing_ratio(layout, machine, c) for c in layout.clusters]
        self.compute, self.batch = _compute(machine, layout, oversub, measured)
        self.local = local = route.wire.kind == "local"
        self.every = route.wire.every if local else 1
        self.sync_wire = (route.wire.pseudo or wire.Route(kind="dense")) if local else route.wire
        self.payload = _payload_for(route.wire.pseudo if local else route.wire, param_numels, fusion_bytes, measured)
        # an MPI all-reduce over more than two clusters (dense fp32, THC, local steps' THC or dense
        # pseudo-gradient) moves more than its counters' ring: its goodput is the probe's
        allreduce = len(layout.clusters) > 2 and self.sync_wire.kind in ("dense", "thc")
        self.efficiency = machine.allreduce_efficiency if allreduce else machine.link_efficiency
        self.latency = machine.calib["link"]["latency_s"] + 2.0 * layout.delay_s
        self.worst = max(range(len(layout.clusters)), key=lambda i: (oversub[i], layout.clusters[i].count))
        kind, k = layout.clusters[self.worst].kind, layout.clusters[self.worst].count
        # the route's CPU work: the calibration's measurement of the synchronous route scaled by
        # the kernels' costs from the calibration's layout to this one (here: at each traffic)
        self.cpu_measured = sync_measured if local else measured
        self.cpu_there = None
        if self.cpu_measured is not None:
            self.calib_traffic = wire.step_traffic(
                self.sync_wire, machine.calib_sizes, param_numels, fusion_bytes=fusion_bytes, step=STEADY,
                payload=_payload_for(self.sync_wire, param_numels, fusion_bytes, self.cpu_measured))
            self.cpu_there = _kernel_model(machine.costs, self.sync_wire, self.calib_traffic,
                                           len(machine.calib_sizes))
        self.intra = _intra_per_step(route, _intra_s(machine, kind, k, numel, oversub[self.worst]))
        rest = _rest(machine, route, measured, param_numels, fusion_bytes) if measured is not None else 0.0
        self.fixed_but_cpu = machine.optimizer_s(kind, numel, oversub[self.worst]) + self.intra + \
            rest * oversub[self.worst]

    def _cpu(self, traffic):
        here = _kernel_model(self.machine.costs, self.sync_wire, traffic, len(self.layout.clusters))
        m = self.cpu_measured
        if m is None:
            cpu = here or 0.0
        elif here is not None and self.cpu_there:
            cpu = m["cpu_s"] * here / self.cpu_there
        else:   # no kernel costs: in proportion to the elements
            cpu = m["cpu_s"] * max(t["elements"] for t in traffic) / max(
                max(t["elements"] for t in self.calib_traffic), 1)
        return cpu * self.oversub[self.worst]

    def _uplink(self, traffic):
        """(bytes, goodput) of the busiest cluster uplink under ``traffic``: a cluster's uplink
        carries what its ranks send (and, separately, what they receive)."""
        ranks = self.layout.ranks()
        busiest = None
        for i, c in enumerate(self.layout.clusters):
            members = [r for r, (ci, _) in enumerate(ranks) if ci == i]
            nbytes = max(sum(traffic[r]["wan_bytes_sent"] for r in members),
                         sum(traffic[r]["wan_bytes_received"] for r in members))
            goodput = c.link_bps * self.efficiency
            t = 8.0 * nbytes / goodput
            if busiest is None or t > busiest[0]:
                busiest = (t, nbytes, goodput)
        return busiest[1], busiest[2]

    def _local_exchanges(self, steps, compute):
        """(exposed seconds, wire seconds, uplink bytes) of local steps' exchanges over one
        period's ``steps`` (one exchange; F with fragments, one per slot of H/F steps). Each
        exchange costs its messages' latency, its busiest uplink's bytes (less what a shaper's
        bucket refilled while the link idled through the slot's local steps) and its CPU work.
        With a delay it is in flight while the next inner step's forward and backward run: that
        much of its latency and wire hides, no more, whatever the delay (the collective thread
        runs one collective at a time, and a step's reductions inside the cluster that take it
        wait behind the exchange). That bound is conservative where no inner step takes the
        thread (clusters of one rank, or CPU tensors on the cluster's channel: then up to
        ``delay`` steps hide it); its CPU work is counted in full (the collective thread shares
        the host with the pass)."""
        w = self.route.wire
        idle = w.every // w.fragments * (compute + self.fixed_but_cpu)
        hidden = compute if w.delay else 0.0
        exposed = wire_s = total = 0.0
        for one in steps:
            if not any(t["wan_messages"] for t in one):
                continue
            nbytes, link = self._uplink(one)
            nbytes = max(nbytes - min(self.layout.burst_bytes, link / 8.0 * idle), 0.0)
            moving = max(t["wan_messages"] for t in one) * self.latency + 8.0 * nbytes / link
            exposed += self._cpu(one) + max(moving - hidden, 0.0)
            wire_s += 8.0 * nbytes / link
            total += nbytes
        return exposed, wire_s, total

    def at(self, step):
        """The prediction with the traffic of optimizer step ``step`` (None: steady state)."""
        route, layout = self.route, self.layout
        steps = period_traffic(route, layout.sizes, self.params, self.fusion, self.payload, step)
        traffic = summed(steps)
        nbytes, link = self._uplink(traffic)
        messages = max(t["wan_messages"] for t in traffic)
        cpu = self._cpu(traffic)
        compute, latency, every = self.compute, self.latency, self.every
        fixed = self.fixed_but_cpu + cpu
        w = route.wire
        density = w.density if w.kind == "sparse" else 1.0
        bits = w.bits if w.kind == "thc" else 0
        elements = max(max(t["elements"] for t in traffic), 1)
        # a shaper's token bucket refills while the link idles (the rest of the step, or the
        # local steps before an exchange: _local_exchanges) and lets that much through at once
        if not self.local:
            idle = compute + fixed + messages * latency
            nbytes = max(nbytes - min(layout.burst_bytes, link / 8.0 * idle), 0.0)
        est = Estimate(compute_s=compute, fixed_s=fixed, latency_s=latency, messages=messages,
                       bytes_per_density=nbytes / density, bandwidth_bps=link,
                       wan_bandwidth_bps=sum(c.link_bps for c in layout.clusters), step_s=0.0, elements=elements,
                       fixed_thc_s=fixed, cpu_s=cpu)
        if self.local:
            exposed, wire_s, nbytes = self._local_exchanges(steps, compute)
            step_s = local_step_time(est) + exposed / every
            wire_s /= every
        else:
            thc = {bits: nbytes / elements} if bits else {}
            ctl = Controller(AdjusterSettings(thc_bits=(bits,) if bits else ()), overlap=route.overlap,
                             thc_bytes=thc)
            step_s = ctl.predict(est, 1, density, bits)
            wire_s = 8.0 * nbytes / link
        sent = max(t["wan_bytes_sent"] for t in traffic) / every
        return {"route": route.name, "step_s": step_s, "compute_s": compute, "utilisation": compute / step_s,
                "wan_bytes_per_step": sent, "cluster_uplink_bytes_per_step": nbytes / every,
                "messages_per_step": messages / every, "wire_s": wire_s, "fixed_s": fixed, "cpu_s": cpu,
                "intra_s": self.intra, "batch_split": list(self.batch), "every": every, "warmup_extra_s": 0.0}


def _warmup_steps(route):
    """Steps of the sparse route's density warm-up (they send more than the steady state)."""
    if route.wire.kind != "sparse":
        return 0
    comp = route.wire.make_compressor()
    return int(getattr(comp, "warmup", 0) or 0)


def _rest(machine, route, measured, param_numels, fusion_bytes):
    """What else the calibration's step held: its iteration less the pass, the optimizer, the
    CPU work, the reduction inside its clusters and the exchange (where the route times none,
    as dense: its wire at the calibration's link). A local step's median holds no exchange."""
    local = route.wire.kind == "local"
    link_c = machine.calib["link"]
    sizes = machine.calib_sizes
    calib_wire = 0.0
    if not local and link_c.get("pair_bps") and len(sizes) > 1:
        rows = wire.step_traffic(route.wire, sizes, param_numels, fusion_bytes=fusion_bytes, step=STEADY,
                                 payload=_payload_for(route.wire, param_numels, fusion_bytes, measured))
        calib_wire = max(t["wan_messages"] * link_c["latency_s"] + 8.0 * max(t["wan_bytes_sent"],
                                                                              t["wan_bytes_received"])
                         / link_c["pair_bps"] for t in rows)
    intra = _intra_per_step(route, _intra_s(machine, HERE, max(sizes), sum(param_numels), 1.0))
    return max(measured["step_s"] - measured["compute_s"] - max(measured["exchange_s"], calib_wire)
               - measured["cpu_s"] - machine.calib.get("optimizer_s", 0.0) - intra, 0.0)


def steps_to(curve, target):
    """Steps at which a held-out curve [(step, loss)] first reaches ``target`` (linear between
    evaluations); None when it never does."""
    prev = None
    for step, loss in curve:
        if loss <= target:
            if prev is None or prev[1] == loss:
                return float(step)
            s0, l0 = prev
            return s0 + (step - s0) * (l0 - target) / (l0 - loss)
        prev = (step, loss)
    return None


def time_to_target(pred, steps, layout, commit_every):
    """Time, cost and revocations' toll of ``steps`` steps at the predicted step time."""
    seconds = steps * pred["step_s"] + pred.get("warmup_extra_s", 0.0)
    rate = sum(c.count * c.revocations for c in layout.clusters) / 3600.0   # revocations per second
    lost_each = commit_every / 2.0 * pred["step_s"] + RESET_S
    out = {"steps": steps, "seconds": seconds}
    if rate > 0:
        share = rate * lost_each
        if share >= 1.0:
            out.update(seconds_with_revocations=math.inf, revocation_note=(
                "%.2f revocations per hour outpace a commit interval's work: commit more often" % (rate * 3600)))
        else:
            out["seconds_with_revocations"] = seconds / (1.0 - share)
            out["lost_to_revocations_s"] = out["seconds_with_revocations"] - seconds
    total = out.get("seconds_with_revocations", seconds)
    if all(c.price is not None for c in layout.clusters):
        out["cost_usd"] = total / 3600.0 * sum(c.count * c.price for c in layout.clusters)
    return out
