"""The selection kernels in torch operations, for tensors that live on a GPU.

The CUDA route selects where the gradient is, so that only the selected entries cross PCIe.
These functions follow the C kernels' rules (c_src/stella_compress.h) bit for bit, and are
checked against them on CPU tensors (tests/unit/test_device_select.py):

* error feedback: ``acc = grad + residual`` (one IEEE add per element); on return the residual is
  ``acc`` with the sent entries set to +0.0, so ``sent + residual == acc`` exactly;
* magnitude order: the bits of ``|x|``, every NaN just above +Inf; ties go to the lower index.
  The order is made total by one 64-bit key per unit, ``magnitude << 32 | ~index``, so
  ``torch.topk`` picks exactly the C kernel's set whatever its own tie-breaking;
* cache-aware blocks: 16 consecutive floats (the short tail padded with zeros), scored by the
  sum of magnitudes added in the C kernel's fixed pairwise order (lane i + lane i+8, then i+4,
  i+2, i+1), the ``ceil(k/16)`` highest-scoring blocks taken whole;
* random-k: the indices are the C draw (a pure function of key, n and k, computed on the host:
  k integers cross PCIe instead of the gradient).

One difference is documented rather than hidden: the threshold compressor's sampled threshold is
a CPU speed device (one pass instead of a selection); on the device route the threshold
compressor sends the exact top-k instead, as ``ThresholdCompressor(exact=True)`` does.
The C kernels carry a threshold from step to step to stay one pass; ``torch.topk`` needs none.
"""
import torch

from .._native import compress as kernels

BLOCK = 16
_KEY_NAN = 0x7F800001
_LOW32 = (1 << 32) - 1


def magnitude_keys(x):
    """The C kernels' magnitude key of every element of float32 ``x`` (int64, NaN above +Inf)."""
    bits = x.contiguous().view(torch.int32).to(torch.int64) & 0x7FFFFFFF
    return bits.clamp_(max=_KEY_NAN)


def _top_units(keys, m):
    """Positions of the ``m`` largest keys (ties: the lower position), ascending."""
    n = keys.numel()
    if m >= n:
        return torch.arange(n, device=keys.device)
    if m <= 0:
        return torch.empty(0, dtype=torch.int64, device=keys.device)
    order = (keys << 32) | (_LOW32 - torch.arange(n, device=keys.device, dtype=torch.int64))
    pos = torch.topk(order, m, sorted=False).indices
    return torch.sort(pos).values


def block_scores(acc):
    """Score of every 16-float block of flat ``acc``: the sum of magnitudes in the C kernel's
    fixed pairwise order (so the float32 bits are the C kernel's)."""
    n = acc.numel()
    nb = (n + BLOCK - 1) // BLOCK
    a = acc.abs()
    if nb * BLOCK != n:
        a = torch.cat([a, torch.zeros(nb * BLOCK - n, dtype=a.dtype, device=a.device)])
    a = a.view(nb, BLOCK)
    u = a[:, :8] + a[:, 8:]
    w = u[:, :4] + u[:, 4:]
    y = w[:, :2] + w[:, 2:]
    return y[:, 0] + y[:, 1]


def _accumulate(flat, residual):
    """acc = grad + residual (or grad itself without error feedback)."""
    if residual is None:
        return flat
    if residual.device != flat.device or residual.numel() != flat.numel():
        raise ValueError("the residual (%d elements on %s) does not match the tensor (%d on %s)"
                         % (residual.numel(), residual.device, flat.numel(), flat.device))
    return flat + residual


def _take(acc, idx, residual):
    """(int32 indices, values) of ``idx`` in ``acc``; the residual becomes acc minus them."""
    val = acc[idx]
    if residual is not None:
        residual.copy_(acc)
        residual[idx] = 0.0
    return idx.to(torch.int32), val


def topk(flat, k, residual=None):
    """Exact top-k by magnitude (the C kernel ``stella_topk_f32``)."""
    acc = _accumulate(flat, residual)
    return _take(acc, _top_units(magnitude_keys(acc), int(k)), residual)


def block_topk(flat, k, residual=None):
    """Cache-aware block selection (``stella_block_topk_f32``): ceil(k/16) whole blocks."""
    acc = _accumulate(flat, residual)
    n = acc.numel()
    nblocks, _ = kernels.block_count(n, k)
    blocks = _top_units(magnitude_keys(block_scores(acc)), nblocks)
    lanes = torch.arange(BLOCK, device=acc.device, dtype=torch.int64)
    idx = (blocks[:, None] * BLOCK + lanes[None, :]).reshape(-1)
    idx = idx[idx < n]
    return _take(acc, idx, residual)


def randomk(flat, k, key, residual=None):
    """Random-k (``stella_randomk_select_f32``): the C draw, then a gather on the device."""
    acc = _accumulate(flat, residual)
    idx = kernels.randomk_indices(key, acc.numel(), int(k)).to(acc.device, non_blocking=True).long()
    return _take(acc, idx, residual)
