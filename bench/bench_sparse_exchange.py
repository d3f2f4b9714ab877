"""Per-step communication time for the gradient set of a ~25M-parameter model: dense
hierarchical allreduce vs the sparse cross-cluster route at 1 % and 0.1 % density, side by
side in one run, with the bytes that cross the WAN per step.

    mpirun -np 4 -env STELLA_CLUSTERS 2 .venv/bin/python bench/bench_sparse_exchange.py
    mpirun -np 4 -env STELLA_CLUSTERS 4 .venv/bin/python bench/bench_sparse_exchange.py --algos allgather,tree

The gradients are random tensors shaped like a 25M-parameter transformer (embedding, 8
blocks, head), fused into buckets as DistributedOptimizer does; each configuration reduces
the same gradients ``--steps`` times (alternating configurations, so all see the same load).
Rank 0 prints a table and writes bench/results/sparse_exchange.json. Without WAN emulation
this measures loopback: the CPU cost of the route, not a slow link (see stellarun --wan).
"""
import argparse
import json
import os
import statistics
import time

import torch

import stella_mpi as hvd
from provenance import provenance


def gradient_set(seed):
    """Shapes of a 26.2M-parameter transformer (d=512, 7 layers, vocab 8192)."""
    d, layers, vocab = 512, 7, 8192
    shapes = [(vocab, d)]
    for _ in range(layers):
        shapes += [(3 * d, d), (3 * d,), (d, d), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,), (d,), (d,), (d,), (d,)]
    shapes += [(d,), (d,)]
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) * (1 + (i % 7)) for i, s in enumerate(shapes)]


def buckets(tensors, cap_bytes):
    out, cur, size = [], [], 0
    for t in reversed(tensors):
        if cur and size + t.numel() * 4 > cap_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append(t)
        size += t.numel() * 4
    if cur:
        out.append(cur)
    return out


def run_step(bucket_list, config, step):
    t0 = time.perf_counter()
    if config["compression"] is None:
        handles = [hvd.grouped_allreduce_async_(b, name="bench.dense.%d" % i) for i, b in enumerate(bucket_list)]
    else:
        handles = [hvd.compressed_allreduce_async(b, config["compression"], "bench.%s.%d" % (config["label"], i),
                                              step=step, inplace=True) for i, b in enumerate(bucket_list)]
    for h in handles:
        hvd.synchronize(h)
    return time.perf_counter() - t0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--compressor", default="cacheaware")
    p.add_argument("--algos", default="auto",
                   help="comma-separated cross-cluster algorithms for the sparse routes: auto, allgather, tree")
    args = p.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    grads = gradient_set(hvd.rank())
    nparams = sum(t.numel() for t in grads)
    configs = [{"label": "dense", "compression": None, "algo": "auto"}]
    for algo in args.algos.split(","):
        for density, tag in ((0.01, "1%"), (0.001, "0.1%")):
            label = "%s-%s" % (args.compressor, tag) + ("" if algo == "auto" else "-" + algo)
            configs.append({"label": label, "algo": algo,
                            "compression": getattr(hvd.Compression, args.compressor)(density=density)})
    results = {c["label"]: {"times": [], "wan_bytes": []} for c in configs}
    for step in range(args.steps + 1):                # step 0 warms up every path
        order = configs if step % 2 == 0 else list(reversed(configs))
        for c in order:
            work = [t.clone() for t in grads]
            bl = buckets(work, args.bucket_mb * 2 ** 20)
            hvd.global_process_set.hierarchy.sparse_algorithm = c["algo"]
            hvd.barrier()
            hvd.stats(end_step=True)
            dt = run_step(bl, c, step)
            last = hvd.stats(end_step=True)["last_step"]
            if step:
                results[c["label"]]["times"].append(dt)
                results[c["label"]]["wan_bytes"].append(last["wan_bytes_sent"])
                for phase in ("select_s", "encode_s", "exchange_s", "decode_s", "merge_s"):
                    results[c["label"]].setdefault(phase, []).append(last[phase])
    # the slowest rank sets the step time; WAN bytes are summed over ranks
    summary = {}
    for label, r in results.items():
        t = torch.tensor([statistics.median(r["times"])])
        slowest = hvd.allreduce(t, op=hvd.Max, name="bench.t.%s" % label).item()
        b = torch.tensor([statistics.median(r["wan_bytes"])], dtype=torch.float64)
        total_bytes = hvd.allreduce(b, op=hvd.Sum, name="bench.b.%s" % label).item()
        summary[label] = {"step_s": slowest, "wan_bytes_per_step_all_ranks": total_bytes,
                          "phases_s_rank0": {k: statistics.median(v) for k, v in r.items()
                                             if k.endswith("_s")}}
    if hvd.rank() == 0:
        dense = summary["dense"]
        print("gradient set: %.1fM parameters, %d ranks in %d clusters, buckets of %.0f MB, median of %d steps"
              % (nparams / 1e6, hvd.size(), hvd.num_clusters(), args.bucket_mb, args.steps))
        print("%-18s %10s %12s %16s %12s" % ("route", "step ms", "vs dense", "WAN MB/step", "bytes ratio"))
        for label, s in summary.items():
            print("%-18s %10.1f %11.2fx %16.3f %11.4f" % (
                label, 1000 * s["step_s"], dense["step_s"] / s["step_s"], s["wan_bytes_per_step_all_ranks"] / 1e6,
                s["wan_bytes_per_step_all_ranks"] / max(dense["wan_bytes_per_step_all_ranks"], 1)))
            if label != "dense":
                print("    rank 0 phases (ms): " + ", ".join("%s %.1f" % (k[:-2], 1000 * v)
                                                             for k, v in s["phases_s_rank0"].items()))
            for k100 in (100e6, 1e9):
                s.setdefault("wan_s_at", {})["%dMbit" % (k100 / 1e6)] = \
                    s["wan_bytes_per_step_all_ranks"] / max(hvd.size() // hvd.num_clusters(), 1) * 8 / k100
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "sparse_exchange.json"), "w") as f:
            json.dump({"provenance": provenance(), "parameters": nparams, "ranks": hvd.size(),
                       "clusters": hvd.num_clusters(),
                       "steps": args.steps, "summary": summary}, f, indent=1)
    hvd.shutdown()


if __name__ == "__main__":
    main()
