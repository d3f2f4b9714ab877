"""``DistributedOptimizer(op=hvd.Adasum)``: Horovod's delta optimizer.

Each rank applies the wrapped optimizer to its own gradients. The change of the parameters,
``delta = after - before``, is then combined over the ranks with Adasum (comm/adasum.py), and
every rank sets ``parameters = before + Adasum(deltas)``. This is Horovod's
``_DistributedAdasumOptimizer``. There each parameter's local step and reduction start in its
gradient hook; here they run in ``step()``, one grouped Adasum allreduce over all the step's
deltas, so nothing overlaps backward. Each tensor keeps its own dot products. The results are
the same.

With ``backward_passes_per_step = k``, the gradients of k backward passes accumulate before
the step, as in Horovod. Gradient compression (``hvd.Compression.fp16``) applies to the deltas;
sparse compressors do not combine with Adasum.
"""
from contextlib import contextmanager

import torch

from ..api.allreduce import allreduce_tensors_async, inplace_outputs
from ..api.handles import synchronize
from ..api.reduce_ops import Adasum
from ..core import state
from .buckets import parameter_names


class _DistributedAdasumOptimizer:
    """Methods of the optimizer ``DistributedOptimizer(op=hvd.Adasum)`` returns (mixed in before
    the user's class)."""

    def __init__(self, params, named_parameters, compression, backward_passes_per_step, process_set):
        super().__init__(params)
        if getattr(compression, "sparse", False):
            raise ValueError("DistributedOptimizer(op=hvd.Adasum) combines whole deltas; a sparse compressor "
                             "does not apply (use Compression.none or fp16)")
        self._compression = compression
        self._process_set = process_set
        self.backward_passes_per_step = backward_passes_per_step
        self._names = parameter_names(self.param_groups, named_parameters)
        self._parameter_names = self._names
        self._params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        self._synchronized = False

    def set_backward_passes_per_step(self, passes):
        self.backward_passes_per_step = passes

    def synchronize(self):
        """Nothing to wait for: the reduction happens in ``step()`` (as in Horovod)."""

    @contextmanager
    def skip_synchronize(self):
        raise AssertionError("Skipping synchronization is not supported when using Adasum optimizer.")

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        params = [p for p in self._params if p.grad is not None]
        rt = state.current()
        if not params or rt.size == 1 or not self._process_set.included():
            super().step()
            return loss
        before = [p.detach().clone() for p in params]
        super().step()
        with torch.no_grad():
            deltas = []
            contexts = []
            for p, start in zip(params, before):
                delta, ctx = self._compression.compress(p.detach() - start)
                deltas.append(delta.contiguous())
                contexts.append(ctx)
            by_dtype = {}
            for i, d in enumerate(deltas):
                by_dtype.setdefault(d.dtype, []).append(i)
            handles = []
            for dtype, idx in by_dtype.items():
                name = "DistributedOptimizer.adasum.%s.%s" % (str(dtype).replace("torch.", ""), self._names[params[idx[0]]])
                handles.append(allreduce_tensors_async([deltas[i] for i in idx], inplace_outputs, name, Adasum, 1.0,
                                                       1.0, self._process_set, "grouped_allreduce"))
            for h in handles:
                synchronize(h)
            for p, start, delta, ctx in zip(params, before, deltas, contexts):
                p.copy_(start + self._compression.decompress(delta, ctx).to(p.dtype))
        return loss
