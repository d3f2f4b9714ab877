"""Bytes one rank holds for a cross-cluster route beyond the model and the user's optimizer,
from the runtime's own allocation rules (no tensor is allocated here):

* buckets: the runtime's own plan (:func:`.wire.bucket_members`: the parameters in reverse order
  cut at ``STELLA_FUSION_THRESHOLD``); a bucket of several tensors is copied into
  the reused ``fusion`` scratch (:func:`stella_mpi.core.fusion.fuse`, the largest bucket);
* shards: uniform clusters of g ranks reduce-scatter each bucket inside the cluster
  (``split_counts``, rank 0's shard the largest) into the ``shard`` scratch; unequal clusters
  send the whole bucket to the leader (the leader is priced: the worst rank);
* sparse (topk, cacheaware): one float32 error-feedback residual per bucket shard
  (:class:`stella_mpi.compression.memory.Memory`, ``<name>#shard<i>``), kept across steps; the
  exchange's transient buffers for the largest bucket (the C payloads in one uint8 buffer, the
  C-1 decoded selections, the merge); with ``momentum_correction`` (DGC, on by default for SGD
  with momentum) a float32 velocity per parameter (``optim/momentum_correction.py``);
* thc: the residual as above, the ``thc.rotated`` scratch (float32, the largest shard) and the
  summed words (``shard * lane_bits / 64`` uint64, the lane widening with the clusters);
* dense fp32: the 2-cluster exchange's ``peer`` scratch (one shard); fp16: the 16-bit ``wire``
  copy and, from 3 clusters on, the ``gather`` scratch that holds every cluster's 16-bit shard
  (C times a shard: comm/hierarchy.py ``_cross_reduce_host``);
* local steps (``hvd.LocalSteps``): the anchor (a copy of every parameter, in the parameters'
  dtype), the outer optimizer's state (Nesterov: one momentum buffer per parameter; "average"
  and "sum": none), the pseudo-gradients (a new tensor per parameter at each exchange) and the pseudo
  route's own buffers for the buckets its exchange uses (optim/tuning.py
  pseudo_gradient_exchange cuts it by the fusion threshold in parameter order;
  ``pseudo_bucket_bytes=0`` prices the single fused buffer of the whole model it used before);
* ``device="gpu"``: the route's tensors live on the GPU, and what crosses to MPI is staged in
  page-locked host buffers per slot (:class:`stella_mpi.base.devices.DeviceRoute`): the
  ``cross`` slot of the dense route (one shard), the selection for the sparse route; these are
  reported as ``host_*`` entries. MPI's own internal buffers are not counted.
"""
from .._native import thc as thc_kernels
from ..comm.buffers import split_counts
from .wire import bucket_members

__all__ = ["route_memory"]

SPARSE = ("topk", "cacheaware", "threshold", "randomk")


def _field(route, name, default=None):
    return getattr(route, name, route.get(name, default) if isinstance(route, dict) else default)


def _cross_buffers(kind, compressor, density, bits, nclusters, g, uniform, bucket_list, prefix, device, out,
                   bytes_per_entry=8.0):
    """Add the cross-cluster route's buffers for ``bucket_list`` (numels per bucket) to ``out``."""
    sizes = [sum(b) for b in bucket_list]
    if not sizes:
        return
    shards = [split_counts(n, g)[0] if uniform else n for n in sizes]
    big_shard = max(shards)
    add = lambda k, v: out.__setitem__(prefix + k, out.get(prefix + k, 0) + int(v))
    if any(len(b) > 1 for b in bucket_list):
        add("fusion", 4 * max(n for n, b in zip(sizes, bucket_list) if len(b) > 1))
    if uniform and g > 1:
        add("shard", 4 * big_shard)
    c = nclusters
    if kind == "dense":
        if c == 2:
            add("peer", 4 * big_shard)
        if device == "gpu":
            add("host_cross", 4 * big_shard)
    elif kind == "fp16":
        add("wire", 2 * big_shard)
        add("peer" if c == 2 else "gather", 2 * big_shard * (1 if c == 2 else c))
        if device == "gpu":
            add("host_cross", 4 * big_shard)
    elif kind == "sparse":
        add("residual", 4 * sum(shards))
        k = max(1, int(round(density * big_shard)))
        add("exchange", c * k * bytes_per_entry + 8 * (c - 1) * k + 8 * min(c * k, big_shard))
        if device == "gpu":
            add("host_selection", 8 * k)
    elif kind == "thc":
        lane = thc_kernels.lane_bits(int(bits), max(c, 1))
        add("residual", 4 * sum(shards))
        add("thc_rotated", 4 * big_shard)
        add("thc_words", 8 * thc_kernels.words_for(big_shard, lane))
    else:
        raise ValueError("unknown route kind %r (dense, fp16, sparse, thc, local)" % (kind,))


def route_memory(route, cluster_sizes, param_numels, fusion_bytes=None, device="gpu", momentum_correction=False,
                 outer="nesterov", param_bytes=4, pseudo_bucket_bytes=None, bytes_per_entry=8.0):
    """{name: bytes} one rank holds for ``route`` beyond the model and the user's optimizer.

    route: a :class:`stella_mpi.plan.wire.Route` (or any object or dict with ``kind`` in dense,
    fp16, sparse, thc, local, and ``density``, ``bits``, ``pseudo`` as that kind needs; a local
    route's ``pseudo`` is the Route of its pseudo-gradient exchange, THC 4-bit by default).
    cluster_sizes: GPUs (ranks) per cluster. param_numels: elements of each parameter in
    registration order. bytes_per_entry: payload bytes per sparse entry (8: 32-bit index and
    value; the real encoder writes 5-6 at 1 %, KernelCosts.payload_bytes_per_entry)."""
    sizes = [int(s) for s in cluster_sizes]
    if not sizes or min(sizes) < 1:
        raise ValueError("cluster_sizes must list one or more clusters of >= 1 rank each, got %r" % (cluster_sizes,))
    if device not in ("gpu", "cpu"):
        raise ValueError("device must be 'gpu' or 'cpu', got %r" % (device,))
    numels = [int(n) for n in param_numels]
    if not numels or min(numels) < 0:
        raise ValueError("param_numels must be a non-empty list of element counts >= 0")
    kind = _field(route, "kind")
    c, g, uniform = len(sizes), sizes[0], len(set(sizes)) == 1
    total = sum(numels)
    out = {}
    if kind == "local":
        out["anchor"] = param_bytes * total
        if outer == "nesterov":
            out["outer_momentum"] = param_bytes * total
        elif outer not in ("average", "sum"):   # plain SGD steps: no state
            raise ValueError("outer must be 'nesterov', 'average' or 'sum', got %r" % (outer,))
        out["pseudo_gradient"] = 4 * total
        pseudo = _field(route, "pseudo") or {"kind": "thc", "bits": 4}
        pk = _field(pseudo, "kind")
        if pk == "local":
            raise ValueError("a local route's pseudo-gradient route cannot itself be local")
        plan = ([numels] if pseudo_bucket_bytes == 0 else
                bucket_members(numels, fusion_bytes if pseudo_bucket_bytes is None else pseudo_bucket_bytes,
                               pseudo=True))
        if c > 1:
            _cross_buffers(pk, _field(pseudo, "compressor"), _field(pseudo, "density", 0.01), _field(pseudo, "bits", 4),
                           c, g, uniform, plan, "pseudo_", device, out, bytes_per_entry)
        return out
    if c == 1:
        return out
    _cross_buffers(kind, _field(route, "compressor"), _field(route, "density", 0.01), _field(route, "bits", 4), c, g,
                   uniform, bucket_members(numels, fusion_bytes), "", device, out, bytes_per_entry)
    if kind == "sparse" and momentum_correction:
        out["momentum_velocity"] = 4 * total
    return out


def total_bytes(mem):
    return sum(mem.values())


def gib(nbytes):
    return nbytes / float(1 << 30)

