"""Selection quality on real gradients: per layer, the share of the gradient's energy (sum of
squares) that cache-aware blocks capture against exact top-k, at the same number of entries and at
the same bytes on the wire, and what cache-aware with single entries beside its blocks
(``Compression.cacheaware(singles=s)``: fewer blocks plus the largest entries outside them, in the
blocks' bytes) captures, for s = 0.5, 0.7 and 0.85.

    .venv/bin/python bench/bench_selection_quality.py [--density 0.01] [--steps 30] [--out FILE]

Models: the byte-level LM of the convergence test and the main job (examples/stdlib_text.py,
hidden 1024, trained on the stdlib text), the ~25M-parameter MLP of the benchmarks
(bench/e2e_train.comm_heavy_model, random task) and the optimizer tests' small classifier
(tests/mpi/reference.small_model). Each model trains with SGD (momentum 0.9) on one process; at
each step every layer's gradient plus its error-feedback residual (acc) is selected by each
scheme, each with its own residual, as in training. Reported per layer: the mean over steps of
captured energy / energy of acc, and each scheme's payload bytes over the blocks' (the codec's own
encoding of the selection).
"""
import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.join(ROOT, "tests", "mpi"))

from stella_mpi._native import compress as kernels  # noqa: E402
from stella_mpi.compression import device_select  # noqa: E402
from provenance import provenance  # noqa: E402

BLOCK = 16


def payload_bytes(n, idx):
    """Bytes the codec sends for the selection ``idx`` (int32, ascending) of a tensor of n."""
    return kernels.encoded_size(idx.int(), n)[0]


def energy(acc, idx):
    total = float(torch.dot(acc, acc))
    return float((acc[idx.long()] ** 2).sum()) / total if total > 0 else 1.0


def _fast_topk(x, k):
    """Indices (int64, ascending) of the k largest |x| (torch.topk: ties unordered, which does
    not change the energy)."""
    if k <= 0:
        return torch.empty(0, dtype=torch.long)
    return torch.sort(torch.topk(x.abs(), min(k, x.numel()), sorted=False).indices).values


def topk_bytes(n, k):
    """Bytes of a top-k payload of k scattered entries (the codec's scheme for (n, k))."""
    if k <= 0:
        return 0
    return kernels.payload_size(n, k, min(k, (n + BLOCK - 1) // BLOCK), kernels.choose_scheme(n, k, -1))


def k_within(n, budget):
    """The largest k whose top-k payload fits ``budget`` bytes (bisection on the codec's sizes)."""
    lo, hi, best = 1, n, 0
    while lo <= hi:
        mid = (lo + hi) // 2
        if topk_bytes(n, mid) <= budget:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


def topk_within(acc, budget, n):
    return _fast_topk(acc, k_within(n, budget))


def models():
    from stdlib_text import ByteBatches, ByteMLP, load_corpus
    from reference import small_model
    from e2e_train import RandomTask, comm_heavy_model
    corpus = load_corpus()
    lm_data = ByteBatches(corpus, 32, 64, seed=1)
    torch.manual_seed(0)
    yield "byte_lm_2.4M", ByteMLP(32, hidden=1024), lambda step: lm_data.next()
    task = RandomTask(0, 32)
    torch.manual_seed(0)
    yield "mlp_25M", comm_heavy_model(), lambda step: task.next()

    def small_batch(step):
        g = torch.Generator().manual_seed(step)
        return torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g)
    yield "small_classifier", small_model(), small_batch


SINGLES = (0.5, 0.7, 0.85)


def measure(name, model, batch, steps, density, min_numel):
    from stella_mpi.compression import Compression, TensorContext
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    params = [(n, p) for n, p in model.named_parameters() if p.numel() >= min_numel]
    hybrids = {"singles%d" % round(100 * s): Compression.cacheaware(density=density, singles=s) for s in SINGLES}
    schemes = ("topk_same_k", "cacheaware", "topk_same_bytes") + tuple(hybrids)
    residual = {(n, s): torch.zeros(p.numel()) for n, p in params for s in schemes}
    sums = {(n, s): 0.0 for n, _ in params for s in schemes}
    nbytes = {(n, s): 0 for n, _ in params for s in ("cacheaware",) + tuple(hybrids)}
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        for n, p in params:
            g = p.grad.detach().reshape(-1)
            numel = g.numel()
            k = max(1, int(round(density * numel)))
            ctx = TensorContext(n, step, (numel,))
            for s in schemes:
                acc = g + residual[(n, s)]
                if s == "topk_same_k":
                    idx = _fast_topk(acc, k)
                elif s == "cacheaware":
                    idx = device_select.block_topk(acc, k)[0]
                elif s == "topk_same_bytes":
                    idx = topk_within(acc, payload_bytes(numel, device_select.block_topk(acc, k)[0]), numel)
                else:
                    sel = hybrids[s].select(acc, ctx)
                    idx = sel.indices
                    nbytes[(n, s)] += payload_bytes(numel, idx)
                if s == "cacheaware":
                    nbytes[(n, s)] += payload_bytes(numel, idx)
                sums[(n, s)] += energy(acc, idx)
                res = acc.clone()
                res[idx.long()] = 0.0
                residual[(n, s)] = res
        opt.step()
    rows = []
    for n, p in params:
        row = {"model": name, "layer": n, "numel": p.numel()}
        for s in schemes:
            row[s] = sums[(n, s)] / steps
        for s in hybrids:
            row[s + "_bytes_vs_cacheaware"] = nbytes[(n, s)] / nbytes[(n, "cacheaware")]
        row["cacheaware_vs_topk_same_k"] = row["cacheaware"] / row["topk_same_k"]
        row["cacheaware_vs_topk_same_bytes"] = row["cacheaware"] / row["topk_same_bytes"]
        rows.append(row)
        print("%-16s %-14s %9d  top-k %.3f  blocks %.3f  top-k same bytes %.3f  %s" % (
            name, n, p.numel(), row["topk_same_k"], row["cacheaware"], row["topk_same_bytes"],
            "  ".join("%s %.3f (bytes x%.3f)" % (s, row[s], row[s + "_bytes_vs_cacheaware"]) for s in hybrids)),
            flush=True)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default=os.path.join(HERE, "results", "selection_quality.json"))
    args = p.parse_args()
    torch.set_num_threads(2)
    rows = []
    for name, model, batch in models():
        rows += measure(name, model, batch, args.steps, args.density, int(16 / args.density))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(sys.argv), "provenance": provenance(), "density": args.density,
                   "steps": args.steps, "layers": rows}, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
