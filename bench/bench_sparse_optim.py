"""Sparse optimizer throughput (c_src/optim.c on the pinned pool) beside dense torch.optim steps
on the same parameter, side by side in one run.

    .venv/bin/python bench/bench_sparse_optim.py                          # 10M and 60M, 1 % and 0.1 %
    .venv/bin/python bench/bench_sparse_optim.py --sizes 10000000 --reps 3   # quicker

For each size and density: the same k = n * density updates per step, indices
  block     whole 16-float blocks, ascending (what cache-aware selection sends),
  sorted    uniformly scattered, ascending (what top-k / the merge sends),
  unsorted  uniformly scattered in random order; the timed step includes torch.sort and the
            value gather that put them in order;
optimizers SGD(momentum=0.9) and Adam, modes
  lazy      listed coordinates only,
  exact     listed coordinates, each catching up the steps it missed (lists rotate over
            --lists different draws, so a listed coordinate missed about that many steps),
  exact+cu  exact, then every coordinate brought to the step (APPLY_CATCH_UP: what a caller
            that reads all parameters every step pays),
on a pool of 1 and 2 pinned workers; and torch.optim.SGD(momentum=0.9) / Adam (default
single-tensor path, and fused=True) dense steps on a parameter of the same size with torch
using 1 and 2 threads. "ns/upd" divides the step time by k for every row, dense ones included
(the dense step delivers the same k useful updates plus n - k zero-gradient ones).
Writes bench/results/sparse_optim.json.
"""
import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

from stella_mpi._native.pool import CpuPool
from stella_mpi.optim.sparse_optim import SparseAdam, SparseSGD
from provenance import provenance


def make_lists(rng, n, k, order, count):
    out = []
    for _ in range(count):
        if order == "block":
            nb = n // 16
            blocks = np.unique(rng.integers(0, nb, size=k // 16 + k // 160 + 8))[: max(1, k // 16)]
            idx = (blocks[:, None] * 16 + np.arange(16)).reshape(-1)
        else:
            idx = np.unique(rng.integers(0, n, size=k + k // 50 + 8))
            idx = rng.permutation(idx)[:k]
            if order == "sorted":
                idx = np.sort(idx)
        out.append((torch.from_numpy(idx.astype(np.int32)), torch.from_numpy(rng.standard_normal(idx.size).astype(np.float32))))
    return out


def timed(fn, reps):
    fn()  # warm-up (first touch of the state buffers)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10000000,60000000")
    ap.add_argument("--densities", default="0.01,0.001")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--lists", type=int, default=8, help="distinct index lists rotated over steps")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "sparse_optim.json"))
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    densities = [float(d) for d in args.densities.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    allowed = sorted(os.sched_getaffinity(0))
    rng = np.random.default_rng(0)
    rows = []

    def emit(**r):
        rows.append(r)
        print("%-9s %6s %-8s %-5s %-9s %2d thr  %9.2f ms  %8.1f ns/upd  %8.2f M upd/s"
              % (r["n_h"], r["density"], r["order"], r["opt"], r["mode"], r["threads"], r["ms"], r["ns_per_update"],
                 r["mupd_s"]), flush=True)

    print("allowed cores %s, torch %s" % (allowed, torch.__version__))
    for n in sizes:
        n_h = "%dM" % (n // 1_000_000)
        base = torch.randn(n)
        for density in densities:
            k = int(n * density)
            lists = {o: make_lists(rng, n, k, o, args.lists) for o in ("block", "sorted", "unsorted")}
            for thr in threads:
                pool = CpuPool([allowed[i % len(allowed)] for i in range(thr)])
                for oname, cls, hp in (("sgd", SparseSGD, dict(lr=0.01, momentum=0.9)), ("adam", SparseAdam, dict(lr=1e-3))):
                    for mode in ("lazy", "exact", "exact+cu"):
                        p = base.clone()
                        opt = cls([p], mode="lazy" if mode == "lazy" else "exact", **hp)
                        for order, ls in lists.items():
                            it = iter(range(10 ** 9))

                            def step():
                                idx, val = ls[next(it) % len(ls)]
                                if order == "unsorted":
                                    idx, perm = torch.sort(idx)
                                    val = val[perm]
                                opt.step([(idx, val)], pool=pool, catch_up=mode == "exact+cu", timeout_ms=600_000)
                            # settle EXACT's gaps: a full rotation of the lists before timing
                            for _ in range(len(ls)):
                                step()
                            t = timed(step, args.reps)
                            emit(n=n, n_h=n_h, density=density, order=order, opt=oname, mode=mode, threads=thr,
                                 ms=t * 1e3, ns_per_update=t * 1e9 / k, mupd_s=k / t / 1e6, k=k)
                        del opt, p
                pool.close()
                # dense torch on the same parameter size, same thread count
                prev = torch.get_num_threads()
                torch.set_num_threads(thr)
                for oname, make in (("sgd", lambda q: torch.optim.SGD([q], lr=0.01, momentum=0.9)),
                                    ("adam", lambda q: torch.optim.Adam([q], lr=1e-3)),
                                    ("adam", lambda q: torch.optim.Adam([q], lr=1e-3, fused=True))):
                    q = base.clone().requires_grad_(True)
                    q.grad = torch.zeros(n)
                    idx, val = lists["sorted"][0]
                    q.grad[idx.long()] = val
                    o = make(q)
                    label = "dense" + ("-fused" if o.defaults.get("fused") else "")
                    t = timed(o.step, args.reps)
                    emit(n=n, n_h=n_h, density=density, order="-", opt=oname, mode=label, threads=thr,
                         ms=t * 1e3, ns_per_update=t * 1e9 / k, mupd_s=k / t / 1e6, k=k)
                    del o, q
                torch.set_num_threads(prev)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"provenance": provenance(), "allowed_cores": allowed, "torch": torch.__version__, "reps": args.reps,
                   "lists": args.lists,
                   "rows": rows}, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
