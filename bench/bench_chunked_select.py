"""SparseLoCo's host selection (the C kernel ``chunk_topk`` with error feedback, then
``quantize``) against ``torch.topk`` of the chunks' magnitudes, side by side in one process on
the same data: median milliseconds per call over a few sizes, one core, and their ratio.

    .venv/bin/python bench/bench_chunked_select.py [--sizes 1000000 6828288] [--out FILE]
    python bench/bench_chunked_select.py --device cuda   (on a GPU machine)

With ``--device cuda`` it times instead ``Compression.sparseloco``'s ``select`` of a CUDA tensor
(decay 0.95, error feedback, a dozen exchanges) on the device (compression/device_chunked.py)
against the host path it replaced (the copy to the host, then the C kernels), in one process on
the same data, and checks that both end with the same bits (selection, scales, residual). With
``--device cpu`` and ``STELLA_DEVICE_PATH=torch`` the same comparison runs the torch operations
on the CPU.

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
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="time Compression.sparseloco's select on this device against the host path")
    p.add_argument("--out")
    args = p.parse_args()
    if args.device:
        return device_vs_host(args)
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


def device_vs_host(args):
    """Compression.sparseloco's select on ``args.device`` against the host path, same data."""
    from stella_mpi.compression import Memory, TensorContext
    from stella_mpi.compression.sparseloco import SparseLoCoCompressor
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    rows = []
    for n in args.sizes:
        x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(args.device)
        got = {}
        for where in ("host", "device"):
            comp = SparseLoCoCompressor(density=args.density, chunk=args.chunk, bits=args.bits, feedback_decay=0.95)
            comp.selects_on_device = where == "device"
            mem, times = Memory(), []
            for i in range(args.repeats + 3):
                sync()
                t = time.perf_counter()
                sel = comp.select(x * (1 + 0.01 * i), TensorContext("s", i, (n,)), mem)
                host = (sel.indices.cpu(), sel.values.cpu(), sel.scales.cpu())   # what the exchange sends
                sync()
                times.append(time.perf_counter() - t)
            got[where] = (1e3 * statistics.median(times[3:]), host, mem.get("s").cpu())
        same = all(torch.equal(a.view(torch.int32) if a.is_floating_point() else a,
                               b.view(torch.int32) if b.is_floating_point() else b)
                   for a, b in zip(got["host"][1] + (got["host"][2],), got["device"][1] + (got["device"][2],)))
        row = {"n": n, "host_ms": got["host"][0], "device_ms": got["device"][0],
               "host_over_device": got["host"][0] / got["device"][0], "same_bits": same}
        rows.append(row)
        print("n=%-9d host path %8.2f ms   %s path %8.2f ms   host/device %.1fx   same bits: %s"
              % (n, row["host_ms"], args.device, row["device_ms"], row["host_over_device"], same), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "provenance": provenance(), "device": args.device,
                       "chunk": args.chunk, "density": args.density, "bits": args.bits, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
