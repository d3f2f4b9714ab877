"""``hvd.DistributedOptimizer``: checks the arguments and builds the synchronous optimizer
(:mod:`.synchronous`) or the CPU engine (:mod:`.cpu_engine`)."""
import warnings

import torch

from ..adjust.settings import AdjusterSettings
from ..api.reduce_ops import Adasum, Average
from ..compression import Compression
from ..core import state
from ..core.process_sets import global_process_set
from .adasum import _DistributedAdasumOptimizer
from .cpu_engine import make_cpu_engine_optimizer
from .local_steps import LocalSteps, LocalStepsMixin, cluster_process_set
from .mode_switch import ModeSwitchMixin, check_mode_switch
from .synchronous import _DistributedOptimizer


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none, backward_passes_per_step=1,
                         op=Average, gradient_predivide_factor=1.0, num_groups=0, groups=None,
                         sparse_as_dense=False, process_set=global_process_set, engine=None, staleness=0,
                         cpu_semantics="exact", model=None, adjuster=None, staleness_warmup=0,
                         stale_prediction=None, momentum_correction=False, density_warmup=0, dense_below=0,
                         local_steps=None, local_clip=None):
    """Wrap a torch optimizer so that ``step()`` uses gradients averaged over all ranks
    (Horovod's signature and behaviour). The returned object is an instance of a subclass of
    ``type(optimizer)`` built from its param groups (its state starts empty).

    ``engine="cpu"`` (stella_mpi's CPU engine, see optim/cpu_engine.py) applies SGD/Adam/AdamW in
    C on a pinned worker pool to a float32 master copy of each rank's shard, with ``staleness`` 0
    (synchronous) or 1 (the update of step t runs while step t+1 computes; pass ``model=`` so
    that each layer waits only for its own update), ``cpu_semantics`` "exact" or "lazy".
    With staleness 1, ``stale_prediction`` (default: on with exact semantics) gives the forward the
    master weights one zero-gradient step ahead, and ``staleness_warmup=K`` runs the first K steps
    synchronously (see optim/cpu_engine.py).

    ``momentum_correction=True`` (SGD with momentum and a sparse ``compression``): Deep Gradient
    Compression's momentum correction, each rank keeping the velocity and the sparse route
    carrying velocities (optim/momentum_correction.py); ``momentum_correction="masking"`` adds
    momentum factor masking. ``density_warmup=N``: the sparse route's density falls geometrically
    from 25 % to the compressor's over the first N steps (DGC's warm-up). ``dense_below=N``: tensors
    of fewer than N elements are reduced densely and the large ones get the density that keeps the
    bytes of a step what the compressor alone would send. ``local_clip=C``: DGC's local gradient
    clipping, each rank's gradient clipped to norm C / sqrt(size) before the reduction (so before
    error feedback accumulates it); buckets then leave at synchronize() instead of during backward.

    ``adjuster=hvd.Adjuster(min_density=..., max_density=...)`` (with a sparse ``compression``)
    re-tunes the density of the cross-cluster exchange from the measured bandwidth, on every
    rank at the same step (stella_mpi/adjust/). With ``allow_accumulation=True`` it may
    raise ``backward_passes_per_step`` when even ``min_density`` cannot be hidden: run
    ``opt.backward_passes_per_step`` backward passes before each ``step()``. Learning rate:
    gradients of the passes are summed (Horovod's semantics), so with an unscaled loss SGD
    already follows the linear scaling rule (lr x passes on the mean gradient of the larger
    batch); if your loss is divided by the number of passes, multiply lr by it yourself.
    With ``batch_split=True`` read ``opt.local_batch_size()`` each step and weight this rank's
    loss by ``local_batch_size * size() / global_batch`` so the average stays a sample mean.

    ``local_steps=hvd.LocalSteps(every=H, outer="average" | "nesterov")``: gradients are averaged
    inside each cluster at every step and the clusters exchange the pseudo-gradient (parameters at
    the last exchange minus now) every H steps, through ``compression``, applied by the outer
    optimizer (optim/local_steps.py). With ``adjuster=hvd.Adjuster(objective="step_time",
    target=...)`` H is chosen from ``Adjuster.local_steps`` by the measured compute and exchange
    times, on every rank at the same exchange (adjust/local_steps_rule.py).

    ``adjuster=hvd.Adjuster(modes=("sync", "local"))`` with a sparse ``compression`` and
    ``local_steps=hvd.LocalSteps(every=H, compression=...)``: the adjuster moves between the
    synchronous route (at its density) and local steps (at its H, the pseudo-gradient through
    ``LocalSteps.compression``), on every rank at the same step, by the time-to-loss objective
    (optim/mode_switch.py, adjust/mode_rule.py); ``opt.mode`` says which runs."""
    state.current("hvd.DistributedOptimizer")
    if adjuster is not None and not isinstance(adjuster, AdjusterSettings):
        raise ValueError("adjuster must be an hvd.Adjuster(...), not %r" % type(adjuster).__name__)
    if adjuster is not None and local_steps is None and not getattr(compression, "sparse", False):
        raise ValueError("adjuster= tunes the density of a sparse compressor; pass compression="
                         "hvd.Compression.cacheaware(density=...) (or topk, threshold, randomk)")
    if engine not in (None, "cpu"):
        raise ValueError("engine must be None or 'cpu', not %r" % (engine,))
    if momentum_correction not in (False, True, "masking"):
        raise ValueError("momentum_correction must be False, True or 'masking', not %r" % (momentum_correction,))
    if getattr(compression, "homomorphic", False):
        what = "DistributedOptimizer(compression=%r)" % compression
        if adjuster is not None and local_steps is None:
            raise ValueError("%s: the adjuster moves along a ladder of sparse densities; to let it choose thc's "
                             "bits, pass a sparse compression and hvd.Adjuster(thc_bits=(2, 4, 8))" % what)
        _check_homomorphic(what, engine, momentum_correction, density_warmup, dense_below)
    if adjuster is not None and adjuster.thc_bits:
        _check_homomorphic("hvd.Adjuster(thc_bits=%r)" % (adjuster.thc_bits,), engine, momentum_correction)
    if (density_warmup or dense_below) and (engine is not None or op == Adasum):
        raise ValueError("density_warmup and dense_below apply to the synchronous optimizer's sparse route "
                         "(engine=None, op Average or Sum)")
    if local_clip is not None and (engine is not None or op == Adasum or local_steps is not None):
        raise ValueError("local_clip applies to the synchronous optimizer's reduction (engine=None, op Average or "
                         "Sum, no local_steps)")
    if momentum_correction and op == Adasum:
        raise ValueError("momentum_correction applies to the sparse route (op Average or Sum)")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed.", DeprecationWarning)
        if groups is None:
            groups = num_groups
    if adjuster is not None and adjuster.modes:
        return _mode_switch_optimizer(optimizer, named_parameters, compression, backward_passes_per_step, op,
                                      gradient_predivide_factor, groups, sparse_as_dense, process_set, engine,
                                      adjuster, momentum_correction, density_warmup, dense_below, local_steps)
    if local_steps is not None:
        return _local_steps_optimizer(optimizer, named_parameters, compression, backward_passes_per_step, op,
                                      gradient_predivide_factor, groups, sparse_as_dense, process_set, engine,
                                      adjuster, momentum_correction, density_warmup, dense_below, local_steps)
    if engine == "cpu":
        if op != Average or backward_passes_per_step != 1 or gradient_predivide_factor != 1.0:
            raise ValueError("engine='cpu' averages one backward pass per step: op=Average, "
                             "backward_passes_per_step=1, gradient_predivide_factor=1.0")
        if adjuster is not None and adjuster.allow_accumulation:
            raise ValueError("engine='cpu' runs one backward pass per step: use an Adjuster with "
                             "allow_accumulation=False")
        return make_cpu_engine_optimizer(optimizer, named_parameters, compression, staleness, cpu_semantics,
                                         process_set, model, adjuster, staleness_warmup, stale_prediction,
                                         momentum_correction)
    if op == Adasum:
        if adjuster is not None:
            raise ValueError("op=hvd.Adasum combines whole deltas: it takes no adjuster")
        cls = type(optimizer.__class__.__name__, (_DistributedAdasumOptimizer, optimizer.__class__), {})
        cls._stella_base_class = optimizer.__class__
        return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, process_set)
    cls = type(optimizer.__class__.__name__, (_DistributedOptimizer, optimizer.__class__), {})
    cls._stella_base_class = optimizer.__class__
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, groups, sparse_as_dense, process_set, adjuster, momentum_correction,
               density_warmup, dense_below, local_clip)


def _check_homomorphic(what, engine, momentum_correction, density_warmup=0, dense_below=0):
    """Compression.thc sends every entry, quantized, summed on the wire: what tunes or relies
    on a sparse selection has no meaning for it (say so rather than ignore the argument). ``what``
    names where thc comes from: the compression itself, or an adjuster's THC rungs (refused up
    front rather than at the switch)."""
    if density_warmup or dense_below:
        raise ValueError("%s: density_warmup and dense_below tune a sparse density; thc sends every entry" % what)
    if momentum_correction:
        raise ValueError("%s: momentum_correction corrects for entries a sparse selection holds back; thc holds "
                         "none back (its rounding error is fed back as it is)" % what)
    if engine is not None:
        raise ValueError("%s: the CPU engine updates its master shards from the sparse selection; thc's sum is "
                         "dense, use engine=None" % what)


def _local_steps_optimizer(optimizer, named_parameters, compression, backward_passes_per_step, op,
                           gradient_predivide_factor, groups, sparse_as_dense, process_set, engine, adjuster,
                           momentum_correction, density_warmup, dense_below, local_steps):
    what = "DistributedOptimizer(local_steps=...)"
    if not isinstance(local_steps, LocalSteps):
        raise ValueError("%s: pass an hvd.LocalSteps(every=...), not %r" % (what, type(local_steps).__name__))
    if engine is not None:
        raise ValueError("%s: the CPU engine keeps its master copy in shards over the ranks of every cluster, "
                         "which a step inside one cluster cannot update; use engine=None" % what)
    if op != Average:
        raise ValueError("%s averages pseudo-gradients: op must be hvd.Average" % what)
    if process_set is not global_process_set:
        raise ValueError("%s runs over the global process set (its clusters are the local groups)" % what)
    for name, value in (("momentum_correction", momentum_correction),
                        ("density_warmup", density_warmup), ("dense_below", dense_below)):
        if value:
            raise ValueError("%s: %s applies to the gradient route, not to local steps" % (what, name))
    if adjuster is not None:   # it chooses H (adjust/local_steps_rule.py)
        if adjuster.objective != "step_time":
            raise ValueError("%s: the adjuster chooses H with the step-time objective only, pass hvd.Adjuster("
                             "objective='step_time', target=...): time to loss would need the loss, which local "
                             "steps do not see" % what)
        if adjuster.allow_accumulation or adjuster.batch_split:   # (thc_bits needs the time-to-loss objective)
            raise ValueError("%s: the adjuster's allow_accumulation and batch_split apply to the gradient route; "
                             "with local steps it chooses H from Adjuster(local_steps=...)" % what)
    if local_steps.compression is not None and compression is not Compression.none:
        raise ValueError("%s: the pseudo-gradient's compression is given twice (compression=%r and LocalSteps("
                         "compression=%r)); pass one" % (what, compression, local_steps.compression))
    pseudo = local_steps.compression if local_steps.compression is not None else compression
    _check_pseudo_gradient(what, pseudo, local_steps, optimizer)
    cluster = cluster_process_set()
    cls = type(optimizer.__class__.__name__, (LocalStepsMixin, _DistributedOptimizer, optimizer.__class__), {})
    cls._stella_base_class = optimizer.__class__
    opt = cls(optimizer.param_groups, named_parameters, Compression.none, backward_passes_per_step, op,
              gradient_predivide_factor, groups, sparse_as_dense, cluster)
    opt._init_local_steps(local_steps, pseudo, adjuster)
    return opt


def _check_pseudo_gradient(what, pseudo, local_steps, optimizer):
    if local_steps.overlap and pseudo is not Compression.none:
        raise ValueError("%s: overlap=True sends the pseudo-gradient over its own communicator, outside the "
                         "collective thread, uncompressed; pass compression=hvd.Compression.none (or overlap=False "
                         "to exchange it through %r)" % (what, pseudo))
    if getattr(pseudo, "sparse", False):
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and p.dtype != torch.float32:
                    raise ValueError("%s: a sparse compression takes float32 parameters, got %s" % (what, p.dtype))


def _mode_switch_optimizer(optimizer, named_parameters, compression, backward_passes_per_step, op,
                           gradient_predivide_factor, groups, sparse_as_dense, process_set, engine, adjuster,
                           momentum_correction, density_warmup, dense_below, local_steps):
    """The optimizer that moves between the synchronous route and local steps (optim/mode_switch.py)."""
    if local_steps is not None and not isinstance(local_steps, LocalSteps):
        raise ValueError("DistributedOptimizer(local_steps=...): pass an hvd.LocalSteps(every=...), not %r"
                         % type(local_steps).__name__)
    check_mode_switch(compression, engine, op, process_set, momentum_correction, density_warmup, dense_below,
                      adjuster, local_steps)
    pseudo = local_steps.compression if local_steps.compression is not None else compression
    _check_pseudo_gradient("DistributedOptimizer(local_steps=...)", pseudo, local_steps, optimizer)
    cls = type(optimizer.__class__.__name__, (ModeSwitchMixin, _DistributedOptimizer, optimizer.__class__), {})
    cls._stella_base_class = optimizer.__class__
    opt = cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
              gradient_predivide_factor, groups, sparse_as_dense, process_set, adjuster)
    opt._init_modes(local_steps, adjuster)
    return opt
