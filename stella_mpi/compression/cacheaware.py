"""StellaTrain's cache-aware block selection."""
from .._native import compress as kernels
from . import device_select
from .contracts import SparseCompressor


class CacheAwareCompressor(SparseCompressor):
    """StellaTrain's cache-aware selection: whole 64-byte blocks of 16 floats
    with the largest sum of magnitudes, ceil(k / 16) of them, found in one
    pass with a threshold carried per tensor from step to step."""
    name = "cacheaware"

    def _select(self, flat, n, k, residual, ctx):
        idx, val = kernels.block_topk(flat, k, residual, self.state(ctx.name, n))
        return idx, val, None

    def _select_on_device(self, flat, n, k, residual, ctx):
        idx, val = device_select.block_topk(flat, k, residual)
        return idx, val, None
