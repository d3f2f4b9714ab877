"""Print the compression benchmark table: throughput in GB/s of input for each
method beside torch.topk(x.abs(), k) and numpy.copyto of the same bytes (single
thread, best of R runs), the ratios the targets are stated in, the fraction
of the exact top-k's squared L2 energy each method captures (Gaussian data and
data whose magnitudes vary in blocks of 256), and the 4-list merge rate.

    python bench/compress_report.py [--sizes 1M,10M,25M] [--repeat 5]
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compress_common import DENSITIES, SIZES, Case, blocky, energy_capture, gaussian, merge_lists  # noqa: E402

from stella_mpi import _native  # noqa: E402
from stella_mpi._native import compress as K  # noqa: E402

ORDER = ["cacheaware+ef", "cacheaware", "topk+ef", "topk", "threshold+ef", "randomk+ef", "torch.topk", "numpy.copyto"]


def best_time(fn, repeat):
    fn()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1M,10M,25M")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("SIMD path: %s; torch %s, %d thread" % (_native.simd_active(), torch.__version__, torch.get_num_threads()))
    print("\n## selection throughput, GB/s of float32 input (best of %d)\n" % args.repeat)
    print("| size | density | " + " | ".join(ORDER) + " | cacheaware+ef / torch.topk | cacheaware+ef / copy | topk / torch.topk |")
    print("|" + "---|" * (len(ORDER) + 5))
    for size in args.sizes.split(","):
        for d in DENSITIES:
            c = Case(SIZES[size], d)
            m = c.methods()
            t = {name: best_time(m[name], 2 if name == "torch.topk" and size != "1M" else args.repeat)
                 for name in ORDER}
            gbs = {name: 4 * c.n / t[name] / 1e9 for name in ORDER}
            print("| %s | %g%% | " % (size, 100 * d) + " | ".join("%.2f" % gbs[x] for x in ORDER)
                  + " | %.1fx | %.2fx | %.1fx |" % (t["torch.topk"] / t["cacheaware+ef"],
                                                    t["numpy.copyto"] / t["cacheaware+ef"],
                                                    t["torch.topk"] / t["topk"]))
            sys.stdout.flush()
            del c, m
    print("\n## energy captured: fraction of exact top-k's sum of squares (1M elements, one step)\n")
    print("| data | density | topk | cacheaware | threshold (entries) | randomk |")
    print("|---|---|---|---|---|---|")
    for label, gen in (("gaussian", gaussian), ("blocks of 256", blocky)):
        x = gen(1_000_000, seed=5)
        for d in DENSITIES:
            k = int(round(d * x.size))
            e = energy_capture(x, k)
            print("| %s | %g%% | %.3f | %.3f | %.3f (%d) | %.3f |" % (
                label, 100 * d, e["topk"][0], e["cacheaware"][0], e["threshold"][0], e["threshold"][1],
                e["randomk"][0]))
    print("\n## merge of 4 sorted lists (top-k of 4 different 25M tensors), input entries per second\n")
    print("| density | entries in | union out | time ms | M entries/s |")
    print("|---|---|---|---|---|")
    for d in (0.001, 0.01, 0.1):
        lists = merge_lists(SIZES["25M"], d)
        entries = sum(i.numel() for i, _ in lists)
        buf = (torch.empty(entries, dtype=torch.int32), torch.empty(entries, dtype=torch.float32))
        t = best_time(lambda: K.merge(lists, SIZES["25M"], out=buf), args.repeat)
        out = K.merge(lists, SIZES["25M"])[0].numel()
        print("| %g%% | %d | %d | %.2f | %.0f |" % (100 * d, entries, out, 1e3 * t, entries / t / 1e6))


if __name__ == "__main__":
    main()
