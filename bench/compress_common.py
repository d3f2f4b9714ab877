"""Shared setup of the compression benchmarks: data, the methods measured side
by side (C kernels, torch.topk, a plain copy), energy capture."""
import numpy as np
import torch

from stella_mpi._native import compress as K
from stella_mpi.compression import Compression, Memory, TensorContext

SIZES = {"1M": 1_000_000, "10M": 10_000_000, "25M": 25_000_000}
DENSITIES = [0.001, 0.01, 0.1]


def gaussian(n, seed=0):
    return np.random.default_rng(seed).standard_normal(n, dtype=np.float32)


def blocky(n, seed=0):
    """Gaussian with magnitudes varying in blocks of 256 (exponential scales)."""
    rng = np.random.default_rng(seed)
    scale = rng.exponential(1.0, (n + 255) // 256).astype(np.float32).repeat(256)[:n]
    return rng.standard_normal(n, dtype=np.float32) * scale


class Case:
    """One tensor and everything the methods need, allocated once (so that the
    timings do not include first-touch page faults)."""

    def __init__(self, n, density, data=gaussian):
        self.n = n
        self.k = max(1, int(round(density * n)))
        self.g = data(n)
        self.gt = torch.from_numpy(self.g)
        self.residual = np.zeros(n, np.float32)
        self.dst = np.empty_like(self.g)
        self.state_block = K.SelState()
        self.state_topk = K.SelState()
        self.compressors = {"compressor:cacheaware+ef": Compression.cacheaware(density=density),
                            "compressor:cacheaware+singles70+ef": Compression.cacheaware(density=density, singles=0.7),
                            "compressor:topk+ef": Compression.topk(density=density)}
        self.memory = Memory()

    def methods(self):
        g, r, k = self.g, self.residual, self.k
        return {
            "cacheaware+ef": lambda: K.block_topk(g, k, residual=r, state=self.state_block),
            "cacheaware": lambda: K.block_topk(g, k, state=self.state_block),
            "topk+ef": lambda: K.topk(g, k, residual=r, state=self.state_topk),
            "topk": lambda: K.topk(g, k),
            "threshold+ef": lambda: K.threshold_select(g, K.estimate_threshold(g, k, r), 0, min(self.n, 2 * k + 16),
                                                       residual=r),
            "randomk+ef": lambda: K.randomk_select(g, k, 12345, residual=r),
            "torch.topk": lambda: torch.topk(self.gt.abs(), k),
            "numpy.copyto": lambda: np.copyto(self.dst, g),
            # the compressors' whole select(), error feedback included (Python glue and all)
            **{name: self._select_with(name) for name in self.compressors},
        }

    def _select_with(self, name):
        comp, ctx = self.compressors[name], TensorContext(name, 0, (self.n,))
        return lambda: comp.select(self.gt, ctx, memory=self.memory)


def energy_capture(x, k):
    """Fraction of the exact top-k's squared L2 energy each selection captures (one step, no feedback)."""
    exact = K.topk(x, k)[1].numpy().astype(np.float64)
    e_exact = float(np.sum(exact * exact))
    out = {}
    for name, (idx, val) in {
        "topk": K.topk(x, k),
        "cacheaware": K.block_topk(x, k),
        "threshold": K.threshold_select(x, K.estimate_threshold(x, k), 0, min(x.size, 2 * k + 16)),
        "randomk": K.randomk_select(x, k, 12345),
    }.items():
        v = val.numpy().astype(np.float64)
        out[name] = (float(np.sum(v * v)) / e_exact, v.size)
    return out


def merge_lists(n, density, w=4):
    """w top-k selections of different Gaussian tensors (the lists a rank receives)."""
    k = max(1, int(round(density * n)))
    return [K.topk(gaussian(n, seed=s), k) for s in range(w)]
