"""``DistributedOptimizer(op=hvd.Adasum)``: Horovod's delta optimizer as a gradient route.

Each rank applies the wrapped optimizer to its own gradients. The change of the parameters,
``delta = after - before``, is then combined over the ranks with Adasum (comm/adasum.py), and
every rank sets ``parameters = before + Adasum(deltas)``. This is Horovod's
``_DistributedAdasumOptimizer``. There each parameter's local step and reduction start in its
gradient hook; here they run in ``step()``, one grouped Adasum allreduce over all the step's
deltas, so nothing overlaps backward. Each tensor keeps its own dot products. The results are
the same.

With ``backward_passes_per_step = k``, the gradients of k backward passes accumulate before
the step, as in Horovod. Gradient compression (``hvd.Compression.fp16``) applies to the deltas;
sparse compressors do not combine with Adasum (refused by the spec).
"""
import torch

from ...api.allreduce import allreduce_tensors_async, inplace_outputs
from ...api.handles import synchronize
from ...api.reduce_ops import Adasum
from ...core import state


class AdasumRoute:
    kind = "adasum"
    needs_synchronize = False

    def __init__(self, opt, process_set, compression):
        self.opt = opt
        self.process_set = process_set
        self.compression = compression

    def describe(self):
        return "adasum"

    def launch_in_backward(self):
        return False

    def hooked_params(self):
        return []   # gradients accumulate until step(): nothing leaves during backward

    def grad_ready(self, p):
        """Gradients accumulate until step() (nothing leaves during backward)."""

    def synchronize(self):
        """Nothing to wait for: the reduction happens in ``step()`` (as in Horovod)."""

    def skip_synchronize_refusal(self):
        return AssertionError("Skipping synchronization is not supported when using Adasum optimizer.")

    def update(self, closure=None):
        opt = self.opt
        loss = closure() if closure is not None else None
        params = [p for p in opt._params if p.grad is not None]
        rt = state.current()
        opt._step_count += 1
        if not params or rt.size == 1 or not self.process_set.included():
            opt._user_step()
            return loss
        before = [p.detach().clone() for p in params]
        opt._user_step()
        with torch.no_grad():
            deltas = []
            contexts = []
            for p, start in zip(params, before):
                delta, ctx = self.compression.compress(p.detach() - start)
                deltas.append(delta.contiguous())
                contexts.append(ctx)
            by_dtype = {}
            for i, d in enumerate(deltas):
                by_dtype.setdefault(d.dtype, []).append(i)
            handles = []
            for dtype, idx in by_dtype.items():
                name = "DistributedOptimizer.adasum.%s.%s" % (str(dtype).replace("torch.", ""),
                                                              opt._names[params[idx[0]]])
                handles.append(allreduce_tensors_async([deltas[i] for i in idx], inplace_outputs, name, Adasum, 1.0,
                                                       1.0, self.process_set, "grouped_allreduce"))
            for h in handles:
                synchronize(h)
            for p, start, delta, ctx in zip(params, before, deltas, contexts):
                p.copy_(start + self.compression.decompress(delta, ctx).to(p.dtype))
        return loss

    def reset(self):
        pass
