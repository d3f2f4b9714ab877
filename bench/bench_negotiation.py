"""The cost of matching collectives by name (STELLA_NEGOTIATION=name, the default) against the
older per-collective agreement round in submission order (STELLA_NEGOTIATION=order), side by
side in one run, the two modes alternating (hvd.shutdown() and hvd.init() between them):

    mpirun -np 2 .venv/bin/python bench/bench_negotiation.py
    mpirun -np 4 -env STELLA_CLUSTERS 2 .venv/bin/python bench/bench_negotiation.py

Per mode it measures:
- one small collective: the mean time of a synchronous 1-element allreduce (a cached name);
- compute while idle: a matmul loop with no collective in flight, which the idle rounds slow
  down only by the CPU they take;
- one DistributedOptimizer step (forward, backward, reduction, update), median, on the byte LM
  of examples/ (2.4M parameters) and the 25.2M-parameter MLP of the comm workload;
- 200 tensors of 1 KB allreduced in one step: all submitted, then all synchronized. With
  negotiation by name they are fused. In name mode the same 200 also run with fusion off (one
  collective each, still negotiated together), and one at a time (submit, wait, next).

Under ``stellarun --wan RATE --wan-delay D`` every message between the clusters crosses the
emulated link. That includes the negotiation rounds and the order mode's agreement rounds.

It reports each figure and the ratios name/order, plus fused against one-by-one. Results go to
bench/results/negotiation_np<N>.json.
"""
import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
import stella_mpi as hvd  # noqa: E402
from e2e_train import RandomTask, comm_heavy_model, timed_optimizer_steps  # noqa: E402
from stdlib_text import ByteBatches, ByteMLP, load_corpus  # noqa: E402
from stella_mpi.core import state  # noqa: E402
from provenance import provenance  # noqa: E402


def small_collective(reps):
    t = torch.ones(1)
    for _ in range(20):
        hvd.allreduce(t, name="bench.small")
    hvd.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        hvd.allreduce(t, name="bench.small")
    return (time.perf_counter() - t0) / reps


def optimizer_steps(make, steps):
    model, batch = make()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                   named_parameters=model.named_parameters())
    return statistics.median(timed_optimizer_steps(model, opt, batch, steps))


def compute_while_idle(seconds=0.3):
    """Compute with no collective in flight (a forward pass, an evaluation): what the idle
    negotiation rounds of the collective thread take from it. Returns seconds per matmul."""
    a = torch.randn(256, 256)
    hvd.barrier()
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        a = torch.tanh(a @ a)
        n += 1
    return (time.perf_counter() - t0) / n


def many_small(count, one_by_one):
    tensors = [torch.full((256,), float(i)) for i in range(count)]   # 1 KB each
    hvd.barrier()
    t0 = time.perf_counter()
    if one_by_one:
        for i, t in enumerate(tensors):
            hvd.synchronize(hvd.allreduce_async(t, name="bench.many.%d" % i, op=hvd.Sum))
    else:
        handles = [hvd.allreduce_async(t, name="bench.many.%d" % i, op=hvd.Sum) for i, t in enumerate(tensors)]
        for h in handles:
            hvd.synchronize(h)
    return time.perf_counter() - t0


def measure(mode, makes, args):
    os.environ["STELLA_NEGOTIATION"] = mode
    hvd.init()
    try:
        thread = state.current().collective_thread
        row = {"small_collective_s": small_collective(args.reps), "compute_while_idle_s": compute_while_idle()}
        for name, make in makes.items():
            row["step_%s_s" % name] = optimizer_steps(make, args.steps)
        many_small(args.count, False)   # warm the names
        row["many_small_submitted_s"] = statistics.median(many_small(args.count, False) for _ in range(3))
        row["many_small_one_by_one_s"] = statistics.median(many_small(args.count, True) for _ in range(3))
        if mode == "name":   # submitted together, fusion off: one collective each, negotiated together
            fused = thread.config
            thread.config = dataclasses.replace(fused, fusion_threshold=0)
            try:
                row["many_small_unfused_s"] = statistics.median(many_small(args.count, False) for _ in range(3))
            finally:
                thread.config = fused
        row["rounds"] = thread.checks
        row["round_mean_s"] = thread.check_seconds / max(thread.checks, 1)
        row["fused_ops"] = thread.fused_ops
        return row
    finally:
        hvd.shutdown()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--count", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--models", default="lm_2.4M,mlp_25M", help="which DistributedOptimizer workloads to time")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    rank, size, clusters = hvd.rank(), hvd.size(), hvd.num_clusters()
    hvd.shutdown()
    corpus = load_corpus(4_000_000)
    lm_data = ByteBatches(corpus, 32, 64, seed=1 + rank)
    task = RandomTask(rank, 32)

    def lm():
        torch.manual_seed(0)
        return ByteMLP(32, hidden=1024), lm_data.next

    def mlp():
        torch.manual_seed(0)
        return comm_heavy_model(), task.next

    makes = {k: v for k, v in {"lm_2.4M": lm, "mlp_25M": mlp}.items() if k in args.models.split(",")}
    samples = {"order": [], "name": []}
    for i in range(args.rounds):
        for mode in (("order", "name") if i % 2 == 0 else ("name", "order")):   # neither always runs first
            samples[mode].append(measure(mode, makes, args))
            if os.environ.get("BENCH_VERBOSE"):
                print(rank, mode, {k: round(v * 1e3, 3) for k, v in samples[mode][-1].items() if k.endswith("_s")},
                      flush=True)
    hvd.init()
    summary = {}
    for mode, rows in samples.items():
        keys = sorted(k for k in rows[0] if k.endswith("_s"))
        local = torch.tensor([statistics.median(r[k] for r in rows) for k in keys], dtype=torch.float64)
        worst = hvd.allreduce(local, op=hvd.Max, name="bench.summary." + mode)   # the slowest rank decides
        summary[mode] = dict(zip(keys, worst.tolist()))
        summary[mode]["rounds"] = rows[-1]["rounds"]
        summary[mode]["fused_ops"] = rows[-1]["fused_ops"]
    if rank == 0:
        o, n = summary["order"], summary["name"]
        print("%d ranks, %d cluster(s); medians over %d rounds, slowest rank" % (size, clusters, args.rounds))
        print("%-34s %12s %12s %8s" % ("", "order", "name", "name/order"))
        for k in [k for k in o if k.endswith("_s")]:
            print("%-34s %10.3f ms %10.3f ms %8.3f" % (k[:-2], 1e3 * o[k], 1e3 * n[k], n[k] / o[k]))
        print("200 x 1 KB, name mode: submitted together and fused %.1f ms; submitted together, fusion off %.1f ms "
              "(%.1fx); one by one %.1f ms (%.1fx)"
              % (1e3 * n["many_small_submitted_s"], 1e3 * n["many_small_unfused_s"],
                 n["many_small_unfused_s"] / n["many_small_submitted_s"], 1e3 * n["many_small_one_by_one_s"],
                 n["many_small_one_by_one_s"] / n["many_small_submitted_s"]))
        print("200 x 1 KB submitted together: order mode (each its own round) %.1f ms, name mode %.1f ms: %.1fx"
              % (1e3 * o["many_small_submitted_s"], 1e3 * n["many_small_submitted_s"],
                 o["many_small_submitted_s"] / n["many_small_submitted_s"]))
        out = args.out or os.path.join(HERE, "results", "negotiation_np%d_c%d.json" % (size, clusters))
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "provenance": provenance(), "size": size, "clusters": clusters,
                       "results": summary}, f, indent=1)
    hvd.shutdown()


if __name__ == "__main__":
    main()
