"""The planner's calibration: a job under stellarun (two clusters on this machine) that measures
what the prediction needs and writes it as JSON (rank 0).

* the model's compute: forward and backward at several batch sizes (one thread per rank, as
  a rank runs), fitted as ``intercept + per_sample * batch``, and its FLOPs per sample
  (``torch.utils.flop_counter``: what a GPU kind's throughput turns into seconds);
* the optimizer's step on the model's parameters;
* the link between the clusters as stella_mpi measures it before an automatic route's first
  step (``adjust/link_probe.py``: the latency of a tiny exchange, the bandwidth of large ones),
  and the bandwidth of a plain MPI all-reduce between the ranks here (the fabric inside a
  cluster on this machine);
* the kernels' costs per entry (:mod:`.kernel_costs`), on rank 0;
* each route's own run (:mod:`.routes`, the real optimizer) for ``quality_steps`` steps from the
  same initial weights and data: its held-out loss at equal steps, the steps it takes to the
  target, and its step's parts as ``hvd.stats()`` counts them (the exchange, the CPU work of
  selection/encoding/decoding/merge, the WAN bytes and messages).
"""
import argparse
import json
import os
import statistics
import time

import numpy as np
import torch
from mpi4py import MPI

from .predict import steps_to
from .routes import select
from .workload import load, split_source


def _median_time(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _sized(batch, size):
    """A batch of ``size`` samples cut from (or repeated out of) ``batch``: tensors whose first
    dimension is the sample."""
    x, y = batch
    reps = -(-size // x.shape[0])
    cat = (lambda t: torch.cat([t] * reps)[:size]) if reps > 1 else (lambda t: t[:size])
    return cat(x), cat(y)


def measure_compute(w, per_rank):
    """{sizes, seconds, intercept_s, per_sample_s, flops_per_sample}: forward and backward."""
    batch = w.next_batch()
    sizes = sorted({max(1, per_rank // 4), max(1, per_rank // 2), per_rank, 2 * per_rank})
    model = w.model

    def pass_of(x, y):
        model.zero_grad(set_to_none=True)
        w.loss(model(x), y).backward()
    seconds = []
    for b in sizes:
        x, y = _sized(batch, b)
        pass_of(x, y)   # warm
        seconds.append(_median_time(lambda: pass_of(x, y), 7))
    slope, intercept = np.polyfit(np.array(sizes, float), np.array(seconds), 1)
    flops = None
    try:
        from torch.utils.flop_counter import FlopCounterMode
        x, y = _sized(batch, per_rank)
        with FlopCounterMode(display=False) as counter:
            pass_of(x, y)
        flops = counter.get_total_flops() / per_rank
    except Exception:   # (a model the counter cannot follow: GPU kinds then have no compute for it)
        flops = None
    return {"sizes": sizes, "seconds": seconds, "per_sample_s": max(float(slope), 0.0),
            "intercept_s": max(float(intercept), 0.0), "flops_per_sample": flops}


def measure_optimizer(w):
    """Seconds of the user's optimizer's step on the model's parameters (gradients present)."""
    model = w.model
    x, y = w.next_batch()
    model.zero_grad(set_to_none=True)
    w.loss(model(x), y).backward()
    opt = w.make_optimizer(model.parameters())
    opt.step()
    return _median_time(opt.step, 7)


def measure_fabric(comm, nbytes=4 << 20):
    """Bits per second of a plain MPI all-reduce of ``nbytes`` between the ranks here, as the
    ring counts it (2 (n-1)/n of the buffer each way): the fabric inside a cluster on this host."""
    buf = np.zeros(nbytes // 4, np.float32)
    out = np.empty_like(buf)
    comm.Allreduce(buf, out)
    comm.Barrier()
    took = _median_time(lambda: comm.Allreduce(buf, out), 5)
    n = comm.Get_size()
    return 8.0 * nbytes * 2 * (n - 1) / n / took


def horovod_api():
    """The Horovod functions the calibration and the routes' builders use, from their rooms (the
    planner sits below the package that re-exports them as ``import stella_mpi as hvd``)."""
    from types import SimpleNamespace
    from ..api.allreduce import allreduce
    from ..api.functions import allgather_object, broadcast_parameters
    from ..api.lifecycle import init, shutdown, stats
    from ..api.queries import cluster_id, num_clusters, rank, size
    from ..compression import Compression
    from ..core.process_sets import global_process_set
    from ..optim.distributed import DistributedOptimizer
    from ..optim.outer_sync import LocalSteps
    from ..optim.spec import CpuEngine
    return SimpleNamespace(init=init, shutdown=shutdown, stats=stats, rank=rank, size=size, cluster_id=cluster_id,
                           num_clusters=num_clusters, allreduce=allreduce, allgather_object=allgather_object,
                           broadcast_parameters=broadcast_parameters, Compression=Compression,
                           global_process_set=global_process_set, DistributedOptimizer=DistributedOptimizer,
                           LocalSteps=LocalSteps, CpuEngine=CpuEngine)


def measure_transfer(hvd, comm, sizes, nbytes=4 << 20):
    """Bits per second of a plain transfer between the first ranks of clusters 0 and 1 (both
    ways at once), the median of three: the link's goodput for what crosses it point to point or
    as an all-gather (an all-reduce over more than two clusters moves more than its counters
    say: the probe's goodput is kept apart)."""
    starts = np.cumsum([0] + sizes)
    me = comm.Get_rank()
    a, b = int(starts[0]), int(starts[1])
    buf, got = np.zeros(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    times = []
    for _ in range(3):
        comm.Barrier()
        t0 = time.perf_counter()
        if me in (a, b):
            comm.Sendrecv(buf, dest=b if me == a else a, recvbuf=got, source=b if me == a else a)
        times.append(time.perf_counter() - t0)
    took = comm.bcast(statistics.median(times), root=a)
    return 8.0 * nbytes / took


def run_route(hvd, route, source, per_rank, model_args, init_state, steps, target, every_eval):
    """One route's run from ``init_state``: per-step parts and the held-out curve."""
    w = load(source, per_rank, hvd.rank(), model_args)   # a fresh model: the last route's hooks stay on its own
    w.model.load_state_dict(init_state)
    opt = route.build(hvd, w.make_optimizer(w.model.parameters()), w.model)
    rows, curve = [], []

    def held_out():
        return hvd.allreduce(torch.tensor(float(w.evaluate(w.model))), name="plan.eval").item()
    if w.evaluate is not None:
        curve.append((0, held_out()))
    hvd.stats(end_step=True)
    for step in range(1, steps + 1):
        t0 = time.perf_counter()   # a whole iteration of a training loop: the batch, the pass, the step
        x, y = w.next_batch()
        opt.zero_grad()
        w.loss(w.model(x), y).backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        last = hvd.stats()["last_step"]
        rows.append({"step_s": t2 - t0, "compute_s": t1 - t0, "optimizer_call_s": t2 - t1,
                     "exchange_s": last["exchange_s"],
                     "cpu_s": last["select_s"] + last["encode_s"] + last["decode_s"] + last["merge_s"],
                     "wan_bytes_sent": last["wan_bytes_sent"], "wan_bytes_received": last["wan_bytes_received"],
                     "wan_messages": last["wan_messages"], "residual_ratio": last.get("residual_norm_ratio")})
        if w.evaluate is not None and (step % every_eval == 0 or step == steps):
            if route.overlap:
                opt.drain()
            curve.append((step, held_out()))
    if route.overlap:
        opt.drain()   # the CPU engine's updates in flight
    tail = rows[len(rows) // 2:]   # past the sparse density's warm-up and the first periods

    def med(key):
        return statistics.median(r[key] for r in tail)
    mine = {k: med(k) for k in ("step_s", "compute_s", "optimizer_call_s", "exchange_s", "cpu_s")}
    mine.update({k: sum(r[k] for r in tail) / len(tail) for k in ("wan_bytes_sent", "wan_bytes_received",
                                                                     "wan_messages")})
    ratios = [r["residual_ratio"] for r in tail if r["residual_ratio"]]
    mine["residual_ratio"] = statistics.median(ratios) if ratios else None
    everyone = hvd.allgather_object(mine, name="plan.route.%s" % route.name)
    out = {"ranks": everyone, "curve": curve, "steps": steps,
           "step_s": max(r["step_s"] for r in everyone)}
    if target is not None and curve:
        out["steps_to_target"] = steps_to(curve, target)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description="the planner's calibration (run by stellarun plan)")
    p.add_argument("--spec", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    with open(args.spec) as f:
        spec = json.load(f)
    hvd = horovod_api()
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    source = spec["model"]["source"]
    model_args = spec["model"].get("args") or {}
    comm = MPI.COMM_WORLD
    sizes = [int(n) for n in np.bincount(np.array(comm.allgather(hvd.cluster_id())))]
    out = {"ranks": hvd.size(), "clusters": hvd.num_clusters(), "cluster_sizes": sizes, "model": source,
           "cores": os.cpu_count(), "routes": {}}
    if spec.get("provenance"):   # what made the spec (bench/plan_validation.py records it)
        out["provenance"] = spec["provenance"]
    from ..adjust.link_probe import probe_link
    if hvd.num_clusters() > 1:
        link = probe_link(hvd.global_process_set)
        out["link"] = {"latency_s": link.latency_s, "pair_bps": link.pair_bps, "bandwidth_bps": link.bandwidth_bps}
        rate = os.environ.get("STELLA_WAN_RATE_BPS")   # across stellarun's emulated link: its goodput
        if rate:   # (the median of five probes: one is a single transfer, as noisy as the link)
            pairs = [link.pair_bps] + [probe_link(hvd.global_process_set).pair_bps for _ in range(4)]
            out["link"]["nominal_bps"] = float(rate)
            out["link"]["probes_bps"] = pairs
            out["link"]["allreduce_efficiency"] = statistics.median(pairs) / float(rate)
            out["link"]["efficiency"] = measure_transfer(hvd, comm, sizes) / float(rate)
    else:   # one cluster: the latency of a tiny MPI all-reduce stands for a message's
        tiny = np.zeros(4, np.float32)
        out["link"] = {"latency_s": _median_time(lambda: comm.Allreduce(MPI.IN_PLACE, tiny), 21),
                       "pair_bps": None, "bandwidth_bps": None}
    out["fabric_bps"] = measure_fabric(comm)
    from . import kernel_costs
    costs = kernel_costs.measure(quick=True) if hvd.rank() == 0 else None
    comm.Barrier()
    out["kernel_costs"] = costs.to_dict() if costs is not None else None
    if split_source(source)[0] is not None:
        probe = load(source, 1, hvd.rank(), model_args)
        global_batch = spec.get("global_batch") or probe.global_batch or 64
        per_rank = max(1, global_batch // hvd.size())
        w = load(source, per_rank, hvd.rank(), model_args)
        hvd.broadcast_parameters(w.model.state_dict(), root_rank=0)
        init_state = {k: v.clone() for k, v in w.model.state_dict().items()}
        out.update(global_batch=global_batch, per_rank_batch=per_rank,
                   param_numels=[int(p.numel()) for p in w.model.parameters()],
                   tokens_per_sample=w.tokens_per_sample, has_evaluate=w.evaluate is not None)
        compute = measure_compute(w, per_rank)
        out["compute"] = hvd.allgather_object(compute, name="plan.compute")
        out["optimizer_s"] = max(hvd.allgather_object(measure_optimizer(w), name="plan.optimizer"))
        steps = int(spec.get("quality_steps") or 300)
        every_eval = max(1, steps // 30)
        for route in select(spec.get("routes")):
            if hvd.rank() == 0:
                print("stella plan: calibrating %s (%d steps)" % (route.name, steps), flush=True)
            out["routes"][route.name] = run_route(hvd, route, source, per_rank, model_args, init_state, steps,
                                                  spec.get("target_loss"), every_eval)
    if hvd.rank() == 0:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
        print("stella plan: calibration written to %s" % args.out, flush=True)
    hvd.shutdown()
