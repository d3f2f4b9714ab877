"""StellaTrain's cache-aware block selection, optionally with single entries beside the blocks."""
import torch

from .._native import compress as kernels
from . import device_select
from .contracts import SparseCompressor


class CacheAwareCompressor(SparseCompressor):
    """StellaTrain's cache-aware selection: whole 64-byte blocks of 16 floats
    with the largest sum of magnitudes, ceil(k / 16) of them, found in one
    pass with a threshold carried per tensor from step to step.

    ``singles=s`` (0 <= s < 1, default 0.7; 0: StellaTrain's blocks only) spends the share ``s``
    of the blocks' bytes on the largest single entries outside the blocks instead: fewer blocks,
    then an exact top-k of what they left, in the same bytes on the wire (the codec's mixed
    scheme: block ids, then 16-bit offsets of the singles). Real gradients are not spread evenly
    over blocks, so a block's 16 entries often carry less than a few single entries would
    (``bench/bench_selection_quality.py``); with momentum correction and the warm-up, singles 0.7
    is within 2 % of dense at equal steps where blocks alone were 4-6 % above
    (``bench/bench_parity.py``). The price is a second selection pass (about 2x the blocks'
    selection time, as slow as top-k)."""
    SINGLES = 0.7
    name = "cacheaware"

    def __init__(self, density=0.01, value_dtype="float32", error_feedback=True, singles=SINGLES, **route):
        super().__init__(density, value_dtype, error_feedback, **route)
        singles = float(singles)
        if not 0.0 <= singles < 1.0:
            raise ValueError("singles is the share of the bytes spent on single entries, in [0, 1); got %r" % singles)
        self.singles = singles

    def __repr__(self):
        return "%s, singles=%g)" % (super().__repr__()[:-1], self.singles)

    def _extra_settings(self):
        return (self.singles,)

    @classmethod
    def _extra_kwargs(cls, extra):
        (singles,) = extra
        return {"singles": singles}

    def split(self, n, k):
        """(blocks, singles) of the selection of k entries out of n: ``ceil(k/16)`` blocks
        without singles; with them, ``round((1 - s) * ceil(k/16))`` blocks and as many single
        entries as the bytes of the blocks given up pay for (the codec's sizes: a block costs 16
        values and its id, a single a value and a 16-bit offset). The same on every rank: it
        depends on n, k and the settings only. Density 1 (k == n) sends every entry, as blocks."""
        nblocks, _ = kernels.block_count(n, k)
        if not self.singles or nblocks == 0 or k >= n:
            return nblocks, 0
        block_bytes, single_bytes = kernels.block_and_single_bytes(n, self.value_dtype)
        keep = int(round((1.0 - self.singles) * nblocks))
        singles = (nblocks - keep) * block_bytes // single_bytes
        return keep, max(0, min(singles, n - 16 * keep))

    def _select(self, flat, n, k, residual, ctx):
        nb, m = self.split(n, k)
        idx, val = kernels.block_topk(flat, min(16 * nb, n), residual, self.state(ctx.name, n))
        if m:
            singles = self._singles(flat, m, residual, idx,
                                    lambda src: kernels.topk(src, m, None, self.state(ctx.name + "#singles", n)))
            idx, val = kernels.merge([(idx, val), singles], n)   # two ascending, disjoint lists
        return idx, val, None

    def _select_on_device(self, flat, n, k, residual, ctx):
        nb, m = self.split(n, k)
        idx, val = device_select.block_topk(flat, min(16 * nb, n), residual)
        if m:
            s_idx, s_val = self._singles(flat, m, residual, idx, lambda src: device_select.topk(src, m))
            both = torch.cat([idx, s_idx])
            order = torch.sort(both).indices
            idx, val = both[order], torch.cat([val, s_val])[order]
        return idx, val, None

    @staticmethod
    def _singles(flat, m, residual, blocks, topk):
        """The m largest entries the blocks left (indices ascending, values). With error
        feedback the residual is acc with the blocks' entries at +0.0, so the top-k of the
        residual is the top-k outside the blocks; without it, a copy of the gradient with the
        blocks zeroed serves. Picks of magnitude 0 (inside a block, or zeros outside) are
        dropped: they would send nothing, and a pick inside a block would repeat its index. The
        residual loses exactly what the singles send (sent + residual == acc)."""
        if residual is None:
            src = flat.clone()
            src[blocks.long()] = 0.0
        else:
            src = residual
        s_idx, s_val = topk(src)
        keep = s_val != 0
        s_idx, s_val = s_idx[keep], s_val[keep]
        if residual is not None:
            residual[s_idx.long()] = 0.0
        return s_idx, s_val
