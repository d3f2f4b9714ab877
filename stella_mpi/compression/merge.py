"""Combining selections: the order-keeping k-way merge and the return to a dense buffer."""
import torch

from .._native import compress as kernels
from ..base.devices import on_device_route, route_for
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
    """dense_out[i] += value * scale for every selected entry (float32, contiguous). On the
    device route (a CUDA buffer) the host selection goes host-to-device on the side stream and
    is added there with the C kernel's arithmetic (value times scale in float32, then added)."""
    if dense_out.numel() != selection.numel:
        raise ValueError("dense buffer has %d elements, the selection %d" % (dense_out.numel(), selection.numel))
    if on_device_route(dense_out):
        if len(selection):
            if selection.indices.numel() and int(selection.indices.max()) >= selection.numel:
                raise ValueError("selection index out of range")
            route = route_for(dense_out.device)
            idx = route.to_device(selection.indices).long()
            val = route.to_device(selection.values) * float(scale)
            dense_out.view(-1).index_add_(0, idx, val)
        return dense_out
    kernels.scatter_add(dense_out.view(-1) if isinstance(dense_out, torch.Tensor) else dense_out,
                        selection.indices, selection.values, scale)
    return dense_out
