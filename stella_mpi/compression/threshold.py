"""Element-wise threshold selection with a sampled threshold."""
import math

from .._native import compress as kernels
from .contracts import SparseCompressor


class ThresholdCompressor(SparseCompressor):
    """Element-wise threshold selection: the threshold is estimated from a
    sample of acc each step; everything above it is sent, at most
    ``slack * k`` entries. ``exact=True`` sends exactly k (the threshold then
    only speeds the exact selection up)."""
    name = "threshold"

    def __init__(self, density=0.01, value_dtype="float32", exact=False, slack=2.0, error_feedback=True, **route):
        super().__init__(density, value_dtype, error_feedback, **route)
        self.exact = bool(exact)
        self.slack = float(slack)
        if not self.slack >= 1.0:
            raise ValueError("slack must be >= 1, got %r" % slack)

    def _extra_settings(self):
        return (self.exact, self.slack)

    @classmethod
    def _extra_kwargs(cls, extra):
        exact, slack = extra
        return {"exact": exact, "slack": slack}

    def _select(self, flat, n, k, residual, ctx):
        t = kernels.estimate_threshold(flat, k, residual)
        if math.isnan(t):
            t = math.inf  # more than k NaNs: they all pass anyway
        if self.exact or k >= n:
            lo = hi = k  # density 1 sends everything: a sampled threshold could miss a few
        else:
            lo, hi = 0, min(n, int(math.ceil(self.slack * k)) + 16)
        idx, val = kernels.threshold_select(flat, t, lo, hi, residual, self.state(ctx.name, n))
        return idx, val, None
