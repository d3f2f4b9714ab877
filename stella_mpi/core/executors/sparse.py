"""Executor of ``hvd.allreduce(..., compression=<sparse>)`` and of DistributedOptimizer's
sparse buckets: dense inside each cluster, compressed across clusters."""
import time

import torch

from ...comm.sparse_exchange import sparse_cross_step
from ..fusion import fuse, unfuse


def execute_sparse_allreduce(pset, desc, inputs, joined):
    """inputs: (tensors, outputs, compressor, memory). float32, op sum or average."""
    tensors, outputs, comp, memory = inputs
    started = time.perf_counter()
    hier = pset.hierarchy
    buf, direct = fuse(tensors, outputs, torch.float32)
    if desc["prescale"] != 1.0:
        buf.mul_(desc["prescale"])
    scale = desc["postscale"] / (pset.nranks if desc["op"] == "average" else 1)
    if pset.topology.num_clusters == 1 or pset.nranks == 1:
        hier.allreduce(buf, "sum")          # no WAN: nothing to compress
        buf.mul_(scale)
    else:
        mem = memory if comp.error_feedback else None
        hier.reduce_across_clusters(buf, "sum", sparse_cross_step(hier, comp, mem, desc["name"], desc["step"],
                                                                 desc["seed"], scale))
    if not direct:
        unfuse(buf, outputs)
    hier.stats.add(engine_s=time.perf_counter() - started)
    return outputs
