"""Executor of ``hvd.allreduce(..., compression=<sparse or thc>)`` and of DistributedOptimizer's
sparse buckets: dense inside each cluster, compressed across clusters (selection with error
feedback, comm/sparse_exchange.py, or homomorphic quantization, comm/thc_exchange.py)."""
import time

import torch

from ...comm.sparse_exchange import sparse_cross_step
from ...comm.thc_exchange import thc_cross_step
from ...compression.memory import Memory
from ...compression.registry import get_factory
from ...base.errors import NonFiniteGradientError
from ..fusion import fuse, unfuse
from ..nonfinite import has_nonfinite
from .dense import neutral_device, on_device

# What a joined rank (hvd.join) uses on the sparse route: the others' compressor rebuilt from the
# description (kept, so its per-tensor selection state carries over steps), and its own
# error-feedback memory for the shard of its cluster's sum that it still owns while joined.
_JOINED_COMPRESSORS = {}
_JOINED_MEMORY = Memory()


def execute_sparse_allreduce(pset, desc, inputs, joined):
    """inputs: (tensors, outputs, compressor, memory). float32, op sum or average. CUDA tensors
    are reduced inside the cluster and selected on their device; only the selection crosses to
    the host for the WAN (comm/sparse_exchange.py)."""
    tensors = inputs[0]
    return on_device(pset, tensors[0].device, lambda: _sparse_allreduce(pset, desc, inputs))


def _sparse_allreduce(pset, desc, inputs):
    tensors, outputs, comp, memory = inputs
    started = time.perf_counter()
    hier = pset.hierarchy
    buf, direct = fuse(tensors, outputs, torch.float32, hier.scratch)
    if desc["prescale"] != 1.0:
        buf.mul_(desc["prescale"])
    scale = desc["postscale"] / (pset.nranks if desc["op"] == "average" else 1)
    if pset.topology.num_clusters == 1 or pset.nranks == 1:
        hier.allreduce(buf, "sum")          # no WAN: nothing to compress
        buf.mul_(scale)
    else:
        mem = memory if comp.error_feedback else None
        # the route across clusters: homomorphic quantization (summed on the wire) or selection
        step = thc_cross_step if getattr(comp, "homomorphic", False) else sparse_cross_step
        hier.reduce_across_clusters(buf, "sum", step(hier, comp, mem, desc["name"], desc["step"], desc["seed"], scale))
        if pset.nonfinite_policy != "off" and has_nonfinite([buf]):
            # every rank holds the same sum, so every rank refuses alike: inputs passed the check,
            # so an entry overflowed (a sum beyond float32, a 16-bit value beyond its range), or a
            # peer sent a value that is not finite
            raise NonFiniteGradientError("%s: the %s sum over clusters is not finite (an entry overflowed, or a "
                                         "peer sent a value that is not finite); refused on every rank"
                                         % (desc["name"], "THC" if step is thc_cross_step else "sparse"))
    if not direct:
        unfuse(buf, outputs)
    hier.stats.add(engine_s=time.perf_counter() - started)
    return outputs


def neutral_sparse_allreduce(desc):
    """A joined rank's part: zeros (it contributes nothing; Average still divides by the set's
    size, as for a dense allreduce). It still owns a shard of its cluster's sum, so it selects
    and exchanges that shard with the same compressor as the others."""
    settings = tuple(desc["compressor"])
    comp = _JOINED_COMPRESSORS.get(settings)
    if comp is None:
        comp = get_factory(settings[0]).from_settings(settings)
        _JOINED_COMPRESSORS[settings] = comp
    tensors = [torch.zeros(tuple(s), dtype=torch.float32, device=neutral_device(desc)) for s in desc["shapes"]]
    return (tensors, [torch.empty_like(t) for t in tensors], comp, _JOINED_MEMORY)
