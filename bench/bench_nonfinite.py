"""The cost of the non-finite gradient check (STELLA_NONFINITE=skip, the default) against no
check (off), side by side in one run, interleaved, on the bench models:

    mpirun -np 4 -env STELLA_CLUSTERS 2 .venv/bin/python bench/bench_nonfinite.py

For each model (the byte LM of examples/, 2.4M parameters; the 25.2M-parameter MLP of the comm
workload) and route (dense, sparse cacheaware 1 %), it times DistributedOptimizer steps with the
check on and off in alternating rounds and reports the median step of each and their ratio,
plus the check alone (has_nonfinite over the step's gradients) per step. Results go to
bench/results/nonfinite.json.
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
from stella_mpi.core.nonfinite import has_nonfinite  # noqa: E402
from provenance import provenance  # noqa: E402


def workloads(rank):
    corpus = load_corpus(4_000_000)
    lm_data = ByteBatches(corpus, 32, 64, seed=1 + rank)

    def lm():
        torch.manual_seed(0)
        return ByteMLP(32, hidden=1024), lm_data.next

    task = RandomTask(rank, 32)

    def mlp():
        torch.manual_seed(0)
        return comm_heavy_model(), task.next
    return {"lm_2.4M": lm, "mlp_25M": mlp}


def run(make, compression, policy, steps):
    rt = state.current()
    old = rt.config
    rt.config = dataclasses.replace(old, nonfinite=policy)
    try:
        model, batch = make()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                       named_parameters=model.named_parameters(), compression=compression)
        times = timed_optimizer_steps(model, opt, batch, steps)
        grads = [p.grad for p in model.parameters()]
        t0 = time.perf_counter()
        for _ in range(5):
            has_nonfinite(grads)
        return times, (time.perf_counter() - t0) / 5
    finally:
        rt.config = old


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "nonfinite.json"))
    args = ap.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    results = []
    for wname, make in workloads(hvd.rank()).items():
        for route, comp in (("dense", hvd.Compression.none), ("sparse 1%", hvd.Compression.cacheaware(density=0.01))):
            samples = {"skip": [], "off": []}
            check_s = []
            for _ in range(args.rounds):
                for policy in ("off", "skip"):
                    times, check = run(make, comp, policy, args.steps)
                    samples[policy] += times
                    check_s.append(check)
            worst = hvd.allreduce(torch.tensor([statistics.median(samples["off"]), statistics.median(samples["skip"]),
                                                statistics.median(check_s)], dtype=torch.float64), op=hvd.Max)
            off, skip, check = worst.tolist()
            row = {"workload": wname, "route": route, "off_ms": 1e3 * off, "skip_ms": 1e3 * skip,
                   "ratio": skip / off, "check_ms": 1e3 * check, "check_share": check / skip}
            results.append(row)
            if hvd.rank() == 0:
                print("%-8s %-9s  off %8.1f ms   skip %8.1f ms   ratio %.3f   check alone %6.2f ms (%.1f %% of a step)"
                      % (wname, route, row["off_ms"], row["skip_ms"], row["ratio"], row["check_ms"],
                         100 * row["check_share"]), flush=True)
    if hvd.rank() == 0:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "provenance": provenance(), "size": hvd.size(),
                       "clusters": hvd.num_clusters(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
