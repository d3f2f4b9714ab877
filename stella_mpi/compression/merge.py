"""Combining selections: the order-keeping k-way merge and the return to a dense buffer."""
import torch

from .._native import compress as kernels
from .contracts import Selection


def merge_selections(selections):
    """k-way merge of selections of the same tensor: union of the indices
    (ascending), values summed in list order (identical bits on every rank
    that merges the same list in the same order)."""
    selections = list(selections)
    if not selections:
        raise ValueError("merge_selections needs at least one selection")
    numel = selections[0].numel
    for s in selections:
        if s.numel != numel:
            raise ValueError("cannot merge selections of %d and %d elements" % (numel, s.numel))
    idx, val = kernels.merge([(s.indices, s.values) for s in selections], numel)
    return Selection(idx, val, numel)


def scatter_add(dense_out, selection, scale=1.0):
    """dense_out[i] += value * scale for every selected entry (float32 CPU, contiguous)."""
    if dense_out.numel() != selection.numel:
        raise ValueError("dense buffer has %d elements, the selection %d" % (dense_out.numel(), selection.numel))
    kernels.scatter_add(dense_out.view(-1) if isinstance(dense_out, torch.Tensor) else dense_out,
                        selection.indices, selection.values, scale)
    return dense_out
