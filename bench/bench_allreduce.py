"""Hierarchical allreduce vs torch.distributed gloo all_reduce, side by side in one run,
and the cost of the cross-rank agreement check per collective.

    mpirun -np 4 -env STELLA_CLUSTERS 2 .venv/bin/python bench/bench_allreduce.py --numel 25000000

Each repetition runs both allreduces on the same tensor back to back (alternating which goes
first), so both see the same machine load. Rank 0 prints a table and writes JSON to
bench/results/allreduce.json.
"""
import argparse
import dataclasses
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

import stella_mpi as hvd
from stella_mpi.core import state
from baseline_dist import init_gloo_world
from provenance import provenance


def timed(fn, reps):
    out = []
    for _ in range(reps):
        hvd.barrier()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def agreement_cost(reps):
    """Seconds per small allreduce with and without the agreement round."""
    x = torch.ones(1)
    rt = state.current()
    res = {}
    for label, check in (("with_check", True), ("without_check", False)):
        hvd.barrier()
        rt.collective_thread.config = dataclasses.replace(rt.collective_thread.config, check_collectives=check)
        for _ in range(20):
            hvd.allreduce(x, name="warm")
        t0 = time.perf_counter()
        for i in range(reps):
            hvd.allreduce(x, name="agreement.bench")
        res[label] = (time.perf_counter() - t0) / reps
    rt.collective_thread.config = dataclasses.replace(rt.collective_thread.config, check_collectives=True)
    return res


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--numel", type=int, default=25_000_000)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--small-reps", type=int, default=500)
    args = p.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    init_gloo_world(timeout_s=120)
    t = torch.randn(args.numel)
    a, b = t.clone(), t.clone()
    hvd.allreduce_(a, op=hvd.Sum)           # warm up both paths (connections, buffers)
    dist.all_reduce(b)
    stella, gloo = [], []
    for rep in range(args.reps):
        order = [("stella", stella), ("gloo", gloo)]
        if rep % 2:
            order.reverse()
        for name, sink in order:
            if name == "stella":
                sink += timed(lambda: hvd.allreduce_(a, op=hvd.Sum, name="bench.25m"), 1)
            else:
                sink += timed(lambda: dist.all_reduce(b), 1)
    agree = agreement_cost(args.small_reps)
    eng = state.current().collective_thread
    if hvd.rank() == 0:
        ms = lambda xs: 1000 * statistics.median(xs)  # noqa: E731
        result = {
            "ranks": hvd.size(), "clusters": hvd.num_clusters(), "numel": args.numel, "reps": args.reps,
            "intra_backend": hvd.global_process_set.intra.name,
            "stella_hierarchical_ms": ms(stella), "gloo_flat_ms": ms(gloo),
            "ratio_gloo_over_stella": statistics.median(gloo) / statistics.median(stella),
            "stella_all_ms": [1000 * x for x in stella], "gloo_all_ms": [1000 * x for x in gloo],
            "small_allreduce_us_with_check": 1e6 * agree["with_check"],
            "small_allreduce_us_without_check": 1e6 * agree["without_check"],
            "agreement_round_us_mean": 1e6 * eng.check_seconds / max(eng.checks, 1),
        }
        print("allreduce of %d float32 on %d ranks in %d clusters (intra: %s), median of %d:"
              % (args.numel, hvd.size(), hvd.num_clusters(), result["intra_backend"], args.reps))
        print("  stella_mpi hierarchical  %8.1f ms" % result["stella_hierarchical_ms"])
        print("  torch.distributed gloo   %8.1f ms" % result["gloo_flat_ms"])
        print("  ratio gloo / stella      %8.2f x" % result["ratio_gloo_over_stella"])
        if eng.negotiator is not None:   # STELLA_CHECK_COLLECTIVES only matters in order mode
            print("negotiation by name: 1-element allreduce %.1f us (%.1f us per round on average); "
                  "bench/bench_negotiation.py compares it with the agreement round of STELLA_NEGOTIATION=order"
                  % (result["small_allreduce_us_with_check"], result["agreement_round_us_mean"]))
        else:
            print("agreement check: 1-element allreduce %.1f us with the check, %.1f us without (%.1f us per "
                  "agreement round on average)" % (result["small_allreduce_us_with_check"],
                                                    result["small_allreduce_us_without_check"],
                                                    result["agreement_round_us_mean"]))
        os.makedirs(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"), exist_ok=True)
        with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "allreduce.json"), "w") as f:
            json.dump(dict(result, provenance=provenance()), f, indent=1)
    dist.destroy_process_group()
    hvd.shutdown()


if __name__ == "__main__":
    main()
