"""pytest-benchmark: selection kernels beside torch.topk(x.abs(), k) and a
plain numpy.copyto of the same bytes, single thread, 1M/10M/25M float32 at
0.1 %, 1 % and 10 %; and the 4-list merge.

    torch.set_num_threads(1) is applied for the whole module.
    Run:  pytest bench/test_bench_compress.py --benchmark-only -q \
              --benchmark-columns=min,median,rounds --benchmark-sort=name
    A summary table (GB/s, ratios, energy capture, merge rate):
          python bench/compress_report.py
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compress_common import DENSITIES, SIZES, Case, merge_lists  # noqa: E402

from stella_mpi._native import compress as K  # noqa: E402

torch.set_num_threads(1)

METHODS = ["cacheaware+ef", "topk+ef", "topk", "threshold+ef", "randomk+ef", "torch.topk", "numpy.copyto",
           "compressor:cacheaware+ef", "compressor:cacheaware+singles70+ef", "compressor:topk+ef"]
_cases = {}


def case(size, density):
    key = (size, density)
    if key not in _cases:
        _cases.clear()  # keep one case in memory at a time
        _cases[key] = Case(SIZES[size], density)
    return _cases[key]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("density", DENSITIES, ids=lambda d: "%g%%" % (100 * d))
@pytest.mark.parametrize("size", list(SIZES))
def test_select(benchmark, size, density, method):
    c = case(size, density)
    fn = c.methods()[method]
    fn()  # warm: allocations, carried thresholds
    rounds = 3 if method == "torch.topk" and size != "1M" else 7
    benchmark.extra_info.update({"n": c.n, "k": c.k, "bytes": 4 * c.n})
    benchmark.pedantic(fn, rounds=rounds, iterations=1, warmup_rounds=0)


@pytest.mark.parametrize("density", [0.01, 0.1], ids=lambda d: "%g%%" % (100 * d))
def test_merge_4_lists_25m(benchmark, density):
    lists = merge_lists(SIZES["25M"], density)
    entries = sum(i.numel() for i, _ in lists)
    benchmark.extra_info.update({"entries": entries})
    buf = (torch.empty(entries, dtype=torch.int32), torch.empty(entries, dtype=torch.float32))
    benchmark.pedantic(lambda: K.merge(lists, SIZES["25M"], out=buf), rounds=7, iterations=1)
