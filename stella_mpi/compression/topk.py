"""Exact top-k by magnitude, with error feedback fused into the C selection pass."""
from .._native import compress as kernels
from .contracts import SparseCompressor


class TopKCompressor(SparseCompressor):
    """Exact top-k by magnitude (a selection algorithm, not a sort)."""
    name = "topk"
    payload_from_sizes = True

    def _select(self, flat, n, k, residual, ctx):
        idx, val = kernels.topk(flat, k, residual, self.state(ctx.name, n))
        return idx, val, None
