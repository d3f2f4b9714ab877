"""Random-k: indices every rank draws alike, so the payload carries values only."""
from .._native import compress as kernels
from . import device_select
from .contracts import SparseCompressor


class RandomKCompressor(SparseCompressor):
    """Random-k: the same k indices on every rank, a pure function of (seed,
    name, step, numel, k); the payload carries the values only."""
    name = "randomk"
    implicit_indices = True
    payload_from_sizes = True

    def _key(self, ctx):
        return kernels.randomk_key(ctx.seed, ctx.name, ctx.step)

    def _select(self, flat, n, k, residual, ctx):
        key = self._key(ctx)
        idx, val = kernels.randomk_select(flat, k, key, residual)
        return idx, val, key

    def _select_on_device(self, flat, n, k, residual, ctx):
        key = self._key(ctx)
        idx, val = device_select.randomk(flat, k, key, residual)
        return idx, val, key

    def _expected_key(self, ctx, numel):
        return self._key(ctx)
