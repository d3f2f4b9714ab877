"""SparseLoCo's host selection (the C kernel ``chunk_topk`` with error feedback, then
``quantize``) against ``torch.topk`` of the chunks' magnitudes, side by side in one process on
the same data: median milliseconds per call over a few sizes, one core, and their ratio.

    .venv/bin/python bench/bench_chunked_select.py [--sizes 1000000 6828288] [--out FILE]

``torch.topk`` here only finds the k largest magnitudes of each chunk: no error feedback, no tie
order, no quantisation. It is the yardstick a user would reach for, not an equivalent. Run it
with ``PYTHONPATH`` on another checkout to time that checkout's kernel against the same
yardstick (how bench/results/chunked_select_31.json compares two builds).
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from provenance import provenance  # noqa: E402


def median_ms(fn, repeats):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000, 6_828_288])
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--bits", type=int, default=2)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--out")
    args = p.parse_args()
    torch.set_num_threads(1)
    from stella_mpi._native import chunked as C
    k = max(1, round(args.density * args.chunk))
    rows = []
    for n in args.sizes:
        g = torch.randn(n, generator=torch.Generator().manual_seed(n))
        res = torch.randn(n, generator=torch.Generator().manual_seed(n + 1)) * 0.1
        full = n // args.chunk * args.chunk

        def stella():
            r = res.clone()
            idx, val = C.chunk_topk(g, args.chunk, k, r)
            C.quantize(idx, val.clone(), n, args.chunk, args.bits, r)

        def yardstick():
            torch.topk(g[:full].view(-1, args.chunk).abs(), k, dim=1, sorted=False)

        stella()
        yardstick()
        clone = median_ms(lambda: res.clone(), args.repeats)   # (the residual's copy, in stella's time)
        row = {"n": n, "stella_ms": median_ms(stella, args.repeats) - clone,
               "torch_topk_ms": median_ms(yardstick, args.repeats)}
        row["torch_over_stella"] = row["torch_topk_ms"] / row["stella_ms"]
        rows.append(row)
        print("n=%-9d stella chunk_topk+quantize %8.2f ms   torch.topk of the chunks %8.2f ms   ratio %.2f"
              % (n, row["stella_ms"], row["torch_topk_ms"], row["torch_over_stella"]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "provenance": provenance(), "chunk": args.chunk, "k": k,
                       "bits": args.bits, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
