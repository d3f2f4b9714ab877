"""Bytes per rank and step across clusters as the number of clusters grows: Compression.thc
(integer lanes summed along MPI's allreduce) against the sparse all-gather (cache-aware 1 %),
side by side in one run per cluster count (issue 14's target: THC's bytes stay flat).

    .venv/bin/python bench/bench_thc_bytes.py                       # 2, 4, 8 and 16 clusters
    .venv/bin/python bench/bench_thc_bytes.py --clusters 2 4 8 --numel 4000000

Each cluster count C is one real MPI job (mpirun -np C, one rank per cluster, STELLA_CLUSTERS=C,
the sparse route forced to its all-gather unless --sparse-algo says otherwise)
that reduces the same gradient buffer (--numel float32, a few heavy-tailed tensors) --steps times
through each compressor and reads the bytes each rank sent across clusters from hvd.stats (what
the route counts and paces: the ring volume of the lanes' allreduce, the C-1 payloads of the
all-gather), plus the seconds per step on this machine (loopback, CPU-bound: not a WAN).
Writes bench/results/thc_bytes.json and, with matplotlib, thc_bytes.png.
"""
import argparse
import json
import os
import statistics
import sys
import time

from provenance import provenance

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
CONFIGS = [("thc4", "thc", {"bits": 4}), ("thc2", "thc", {"bits": 2}), ("cacheaware1%", "cacheaware", {"density": 0.01}),
           ("topk1%", "topk", {"density": 0.01})]


def worker(args):
    import torch

    import stella_mpi as hvd
    hvd.init()
    g = torch.Generator().manual_seed(hvd.rank())
    # heavy-tailed like gradients: Student-t-ish, a few layers of different scales
    base = torch.randn(args.numel, generator=g) / (torch.rand(args.numel, generator=g) + 0.05)
    out = {}
    for label, name, kw in CONFIGS:
        comp = getattr(hvd.Compression, name)(**kw)
        times, sent = [], []
        hvd.stats(end_step=True)
        for step in range(args.steps + 1):
            x = base * (1 + 0.1 * step)
            t0 = time.perf_counter()
            hvd.allreduce(x, compression=comp, name="bytes." + label)
            dt = time.perf_counter() - t0
            last = hvd.stats(end_step=True)["last_step"]
            if step:   # the first step warms up
                times.append(dt)
                sent.append(last["wan_bytes_sent"])
        out[label] = {"bytes_per_rank": statistics.median(sent), "seconds": statistics.median(times)}
    if hvd.rank() == 0:
        with open(args.out, "w") as f:
            json.dump(out, f)
    hvd.shutdown()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clusters", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--numel", type=int, default=2_000_000)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--sparse-algo", default="allgather", choices=["allgather", "tree", "auto"],
                   help="the sparse route's algorithm (STELLA_SPARSE_ALGO); the issue compares the all-gather")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    os.makedirs(RESULTS, exist_ok=True)
    mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
    sys.path.insert(0, os.path.dirname(HERE))
    from tests.mpi_launch import run_job
    rows = {}
    for c in args.clusters:
        out = os.path.join(RESULTS, ".thc_bytes_%d.json" % c)
        cmd = [mpirun, "-np", str(c), "-env", "STELLA_CLUSTERS", str(c), "-env", "STELLA_SPARSE_ALGO", args.sparse_algo,
               sys.executable, os.path.abspath(__file__),
               "--worker", "--numel", str(args.numel), "--steps", str(args.steps), "--out", out]
        print("%d clusters ..." % c, flush=True)
        proc = run_job(cmd, 1800, capture_output=True, text=True)   # (no MPICH files left behind)
        if proc.returncode != 0:
            sys.exit("%d clusters failed:\n%s" % (c, (proc.stdout + proc.stderr)[-3000:]))
        with open(out) as f:
            rows[c] = json.load(f)
        os.remove(out)
    labels = [lab for lab, _, _ in CONFIGS]
    print("\nbytes each rank sends across clusters per step (%d float32 = %.1f MB dense)" % (args.numel, args.numel * 4 / 1e6))
    print("%-9s" % "clusters" + "".join("%16s" % lab for lab in labels) + "   thc4 / cacheaware1%")
    for c in args.clusters:
        r = rows[c]
        print("%-9d" % c + "".join("%16.0f" % r[lab]["bytes_per_rank"] for lab in labels)
              + "   %.2f" % (r["thc4"]["bytes_per_rank"] / r["cacheaware1%"]["bytes_per_rank"]))
    first = args.clusters[0]
    print("\ngrowth from %d clusters (bytes per rank relative to %d clusters)" % (first, first))
    for c in args.clusters:
        print("%-9d" % c + "".join("%16.2f" % (rows[c][lab]["bytes_per_rank"] / rows[first][lab]["bytes_per_rank"])
                                   for lab in labels))
    print("\nseconds per step on this machine (loopback, %d ranks on its cores)" % max(args.clusters))
    for c in args.clusters:
        print("%-9d" % c + "".join("%16.3f" % rows[c][lab]["seconds"] for lab in labels))
    cmd = "bench/bench_thc_bytes.py " + " ".join(sys.argv[1:])
    with open(os.path.join(RESULTS, "thc_bytes.json"), "w") as f:
        json.dump({"command": cmd.strip(), "provenance": provenance(), "numel": args.numel,
                   "rows": {str(c): rows[c] for c in args.clusters}}, f, indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for lab in labels:
        ax.plot(args.clusters, [rows[c][lab]["bytes_per_rank"] / 1e6 for c in args.clusters], marker="o", label=lab)
    ax.set_xlabel("clusters")
    ax.set_ylabel("MB sent per rank and step")
    ax.set_xscale("log", base=2)
    ax.legend()
    ax.set_title("cross-cluster bytes per rank, %d entries" % args.numel)
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, "thc_bytes.png"), dpi=120)


if __name__ == "__main__":
    main()
