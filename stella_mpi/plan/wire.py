"""The wire model: per world rank and per step, the counters ``hvd.stats()["last_step"]`` shows
for a ``DistributedOptimizer`` step, without MPI and without running a model.

Every fact comes from the runtime's own functions (one source of truth): the bucket plan
(``optim/buckets.py`` ``plan_gradient_buckets``, the fusion threshold of ``base/config.py``),
the shards (``comm/buffers.py`` ``split_counts``, as ``Hierarchy.cluster_shard`` cuts them),
the dense step's bytes (``comm/hierarchy.py`` ``cross_reduce_bytes``), the sparse exchange's
(``comm/sparse_exchange.py`` ``choose_algorithm``, ``allgather_bytes``, ``swap_bytes``,
``tree_messages``), THC's (``comm/thc_exchange.py`` ``thc_bytes``), the compressors' ``k_for``,
``is_small`` and the codec's sizes (``_native/compress.py`` ``choose_scheme``,
``payload_size``), DGC's density warm-up (``optim/routes/sync.py`` ``density_warmup``).

API (units: bytes, messages, elements are counts of float entries):

* ``Route(kind, compressor="topk", density=0.01, bits=None, algorithm="auto", every=1,
  pseudo=None, warmup=None, overlap=False, chunk=None, feedback_decay=None, fragments=1,
  delay=0, inner="cluster")``: what crosses the WAN. ``kind``: "dense" (Horovod's allreduce,
  ``STELLA_WAN_ROUTE=dense``), "fp16" (``Compression.fp16``), "sparse"
  (``Compression.<compressor>(density=..., warmup=..., bits=..., chunk=...,
  feedback_decay=...)``; each None: the compressor's default; ``bits``, ``chunk`` and
  ``feedback_decay`` only for a compressor that takes them: sparseloco, dct), "thc"
  (``Compression.thc(bits=...)``), "local" (``LocalSteps(every=..., compression=<pseudo>,
  overlap=..., fragments=..., delay=..., inner=...)``; ``pseudo`` None: dense float32; ``inner``
  "rank", each rank a replica, changes no WAN counter: the exchange's collectives are the same). A field left None
  reads as the compressor's own value once the Route is made (``Route("thc").bits == 4``).
  ``algorithm``: ``STELLA_SPARSE_ALGO`` (auto, allgather, tree).
* ``step_traffic(route, cluster_sizes, param_numels, *, fusion_bytes=None, step=0,
  payload=None) -> list[dict]``: one dict per world rank (ranks laid out cluster by cluster,
  as ``STELLA_CLUSTERS`` and ``stellarun --clusters`` do) with :data:`COUNTED`, for the
  optimizer's step ``step`` (0-based: the record ``hvd.stats()["last_step"]`` holds after the
  (step+1)-th ``optimizer.step()``). ``param_numels``: the trainable float32 parameters'
  sizes in registration order (``[p.numel() for p in model.parameters()]``).
* ``fragment_members(param_numels, fragments) -> list[list[int]]``: the parameters' sizes of
  each of Streaming DiLoCo's fragments (``optim/fragments.py`` ``plan_fragments``).
* ``layout(np, clusters) -> list[int]``: the cluster sizes ``stellarun -np NP --clusters C``
  makes.
* ``buckets(param_numels, fusion_bytes=None) -> list[int]``: the buckets' sizes (elements), in
  launch order.
* ``bottleneck(rows, cluster_sizes) -> dict``: what the adjuster's cost model takes from one
  step (``adjust/controller.py`` ``sample_from_rows``): per shard channel (cluster rank) the
  largest of bytes sent/received, messages and elements over its ranks; ``bytes``,
  ``messages``, ``elements`` and ``channel`` of the busiest channel.
* ``sized_payload(comp, n, round=1) -> Payload`` and ``measured_payload(comp, tensor, ...)
  -> Payload``: a sparse payload's bytes and entries from sizes alone, or by running the real
  select and encode on a tensor (a virtual participant).

Exact from sizes alone: dense, fp16, THC (every bits), local steps (their pseudo-gradient as
its route; with fragments, fragment f's after the update of every step s with ``s % every ==
f * every / fragments``, in the record of the step after it; with a delay the exchange runs
once every rank has launched it, beside the next inner steps, and that record or the next one
holds it, as the clusters' timing has it: exact per period, not per step), and the sparse
compressors whose selection always has k entries (``payload_from_sizes``: ``topk``,
``randomk``, and ``sparseloco`` and ``dct``, whose quantised payloads their own
``payload_size`` sizes; any other compressor on a shard of fewer than 16/density elements,
which is selected by the exact top-k). One caveat for explicit indices:
the codec's ``auto`` scheme sends whole aligned blocks of 16 entries as block ids (``mixed``,
30 bytes less per block); :func:`sized_payload` assumes the selection holds no whole block
(data that can: pass ``payload``). Data-dependent (``payload`` needed): ``cacheaware`` (blocks
and singles: the codec's block/mixed size depends on which blocks), ``threshold`` (k varies
with the data), and a user's registered compressor. ``payload(query: PayloadQuery) ->
Payload`` is then asked for each cluster's payload of each shard, bucket and tree round.

Not modelled: the adjuster (``hvd.Adjuster``, the automatic route and its link probe), the CPU
engine, Adasum, ``groups``, ``fragment_groups`` (fragments are the balanced cut),
``dense_below``, a non-finite step (THC then sends its scale round only), 16-bit or float64
parameters, and the collective thread's fusion of consecutive bucket allreduces submitted in
one cycle (it never fuses float32 buckets of the default plan: two consecutive ones exceed the
threshold; fp16 buckets may fuse when half their float32 bytes fit it, which depends on
timing).
"""
import inspect
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch

from ..base.config import Config
from ..comm.buffers import split_counts
from ..comm.hierarchy import allreduce_bytes, cross_reduce_bytes
from ..comm.sparse_exchange import (ALLGATHER_MESSAGES, allgather_bytes, choose_algorithm, swap_bytes,
                                    tree_messages)
from ..comm.thc_exchange import THC_MESSAGES, thc_bytes
from ..compression import TensorContext
from ..compression.registry import get_compressor, get_factory
from ..compression.thc import THCCompressor
from .._native import compress as codec
from ..optim.buckets import plan_gradient_buckets, plan_pseudo_gradient_buckets
from ..optim.fragments import plan_fragments
from ..optim.outer_sync import LocalSteps
from ..optim.routes.sync import density_warmup

__all__ = ["COUNTED", "ROUTE_KINDS", "Route", "Payload", "PayloadQuery", "step_traffic", "layout", "buckets",
           "pseudo_buckets", "bucket_members", "fragment_members", "bottleneck", "sized_payload", "measured_payload"]

COUNTED = ("wan_bytes_sent", "wan_bytes_received", "wan_messages", "elements", "entries_sent")
ROUTE_KINDS = ("dense", "fp16", "sparse", "thc", "local")
ALGORITHMS = ("auto", "allgather", "tree")
# a sparse compressor's own settings a Route passes on when given (None: the compressor's default)
COMPRESSOR_FIELDS = ("bits", "chunk", "feedback_decay")


def _keywords(factory):
    """The keyword arguments ``factory`` takes: a class's ``__init__``, following ``**kwargs``
    up its bases (None: it passes ``**kwargs`` on to something unknown, which takes any)."""
    inits = [k.__dict__["__init__"] for k in factory.__mro__ if "__init__" in k.__dict__] \
        if isinstance(factory, type) else [factory]
    names = set()
    for init in inits:
        params = inspect.signature(init).parameters.values()
        names |= {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            return names
    return None


@dataclass(frozen=True)
class Route:
    """What crosses the WAN (see the module's documentation). Checked when made: a bad value
    raises ValueError naming it."""
    kind: str
    compressor: str = "topk"
    density: float = 0.01
    bits: Optional[int] = None
    algorithm: str = "auto"
    every: int = 1
    pseudo: Optional["Route"] = None
    warmup: Optional[int] = None
    overlap: bool = False
    chunk: Optional[int] = None
    feedback_decay: Optional[float] = None
    fragments: int = 1
    delay: int = 0
    inner: str = "cluster"

    def __post_init__(self):
        if self.kind not in ROUTE_KINDS:
            raise ValueError("Route: kind must be one of %s, got %r" % (", ".join(ROUTE_KINDS), self.kind))
        if self.algorithm not in ALGORITHMS:
            raise ValueError("Route: algorithm (STELLA_SPARSE_ALGO) must be one of %s, got %r"
                             % (", ".join(ALGORITHMS), self.algorithm))
        if self.kind == "local":   # its own refusals: H, fragments, delay, the replicas, and overlap with them
            LocalSteps(every=self.every, overlap=self.overlap, fragments=self.fragments, delay=self.delay,
                       inner=self.inner)
            if self.pseudo is not None:
                if not isinstance(self.pseudo, Route) or self.pseudo.kind == "local":
                    raise ValueError("Route: the pseudo-gradient's route must be a Route of kind dense, fp16, "
                                     "sparse or thc (None: dense float32), got %r" % (self.pseudo,))
                if self.overlap and self.pseudo.kind != "dense":
                    raise ValueError("Route: local steps with overlap take compression none (pseudo None or "
                                     "Route('dense')), got pseudo kind %r" % self.pseudo.kind)
        elif self.fragments != 1 or self.delay != 0 or self.inner != "cluster":
            raise ValueError("Route(kind=%r): fragments, delay and inner are local steps' (kind 'local'), got "
                             "fragments=%r, delay=%r, inner=%r; leave them 1, 0 and 'cluster'"
                             % (self.kind, self.fragments, self.delay, self.inner))
        if self.kind != "sparse" and (self.chunk is not None or self.feedback_decay is not None):
            raise ValueError("Route(kind=%r): chunk and feedback_decay are a sparse compressor's (kind 'sparse', "
                             "compressor 'sparseloco' or 'dct'), got chunk=%r, feedback_decay=%r"
                             % (self.kind, self.chunk, self.feedback_decay))
        # the compressors' own checks (density in (0, 1], bits, chunk, the name); a field left
        # None reads as the compressor's own value
        comp = self.make_compressor()
        for key in COMPRESSOR_FIELDS:
            if getattr(self, key) is None and hasattr(comp, key):
                object.__setattr__(self, key, getattr(comp, key))

    def make_compressor(self):
        """The compressor this route's gradients cross with (None: dense float32; ``"fp16"``:
        16-bit floats; else a SparseCompressor or THCCompressor instance, checked)."""
        if self.kind in ("dense", "local"):
            return None
        if self.kind == "fp16":
            return "fp16"
        if self.kind == "thc":
            return THCCompressor() if self.bits is None else THCCompressor(bits=self.bits)
        kwargs = {"density": self.density}
        if self.warmup is not None:
            kwargs["warmup"] = self.warmup
        factory = get_factory(self.compressor)   # (an unknown name: the registry's refusal)
        if not getattr(factory, "sparse", False) or getattr(factory, "homomorphic", False):
            raise ValueError("Route('sparse'): compressor %r is not a sparse selection (use kind 'dense', 'fp16' "
                             "or 'thc')" % self.compressor)
        options = {k: getattr(self, k) for k in COMPRESSOR_FIELDS if getattr(self, k) is not None}
        taken = _keywords(factory)
        refused = [k for k in options if taken is not None and k not in taken]
        if refused:
            raise ValueError("Route('sparse'): compressor %r takes no %s (sparseloco and dct do); leave %s None"
                             % (self.compressor, ", ".join("%s=%r" % (k, options[k]) for k in refused),
                                " and ".join(refused)))
        return get_compressor(self.compressor, **kwargs, **options)


@dataclass(frozen=True)
class Payload:
    """One sparse payload: its bytes on the wire and the entries it holds."""
    bytes: int
    entries: int


@dataclass(frozen=True)
class PayloadQuery:
    """Which payload a ``payload`` callable is asked for: optimizer ``step``; ``bucket`` (its
    index in launch order, None: local steps' pseudo-gradient); the sending ``cluster``;
    ``shard`` (the cluster rank owning it; 0 on the leader route); ``n`` elements of the
    shard; the compressor of that step (``compressor``, its density warmed up); ``round`` (1:
    the selection; 2, 3, ...: the tree's round of that number, which sends the merge of the round
    before, re-selected to k entries)."""
    step: int
    bucket: Optional[int]
    cluster: int
    shard: int
    n: int
    compressor: object
    round: int = 1


PayloadFn = Callable[[PayloadQuery], Payload]


def sized_payload(comp, n, round=1):
    """The payload of ``comp``'s selection of a shard of ``n`` elements from sizes alone:
    ``k_for(n)`` entries, values only for random-k's first round, else explicit indices in the
    codec's smallest scheme (no whole aligned 16-block among them assumed). Raises for a
    compressor whose selections vary in length with the data (unless the shard is small: the
    exact top-k)."""
    k = comp.k_for(n)
    own = getattr(comp, "payload_size", None)
    if own is not None:   # a payload format of its own (sparseloco's, dct's quantised one) sized by its compressor
        return Payload(int(own(n, k)), k)
    small = n == 0 or comp.is_small(n)
    if not (small or getattr(comp, "payload_from_sizes", False)):
        raise ValueError("compressor %r: its payload depends on the data (selections of varying length or "
                         "block layout), not only on (n=%d, k=%d); pass payload=<callable> to step_traffic "
                         "(measured_payload runs the real select and encode on a tensor)" % (comp.name, n, k))
    if round == 1 and not small and getattr(comp, "implicit_indices", False):
        return Payload(codec.payload_size(n, k, 0, "implicit", comp.value_dtype), k)
    scheme = codec.choose_scheme(n, k)
    return Payload(codec.payload_size(n, k, 0, scheme, comp.value_dtype), k)


def measured_payload(comp, tensor, name="plan", step=0, seed=0, memory=None):
    """A virtual participant: the real select (error feedback in ``memory`` when given) and
    encode of ``comp`` on ``tensor`` (a shard's cluster sum, flat float32) -> its Payload."""
    flat = tensor.detach().reshape(-1).to(torch.float32).contiguous()
    ctx = TensorContext(name=name, step=step, shape=(flat.numel(),), seed=seed)
    sel = comp.select(flat.clone(), ctx, memory=memory)
    return Payload(int(comp.encode(sel, ctx).numel()), len(sel))


def layout(np_, clusters):
    """The cluster sizes of ``stellarun -np np_ --clusters clusters`` (``STELLA_CLUSTERS``: the
    first clusters larger by one)."""
    return split_counts(int(np_), int(clusters))


def _check_sizes(cluster_sizes):
    sizes = list(cluster_sizes)
    if not sizes:
        raise ValueError("cluster_sizes is empty: give the ranks of each cluster, e.g. [2, 2]")
    for i, s in enumerate(sizes):
        if isinstance(s, bool) or not isinstance(s, int) or s < 1:
            raise ValueError("cluster_sizes[%d] is %r: every cluster needs an int >= 1 ranks (e.g. [2, 2, 1])"
                             % (i, s))
    return sizes


def _metas(param_numels):
    for i, n in enumerate(param_numels):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError("param_numels[%d] is %r: give each parameter's element count (an int >= 0)" % (i, n))
    return [torch.empty(n, dtype=torch.float32, device="meta") for n in param_numels]


def _cap(fusion_bytes):
    return Config.from_env().fusion_threshold if fusion_bytes is None else int(fusion_bytes)


def bucket_members(param_numels, fusion_bytes=None, pseudo=False):
    """[[elements of each parameter] per bucket], in launch order: the synchronous routes'
    buckets (``optim/buckets.py`` ``plan_gradient_buckets``), or with ``pseudo`` local steps'
    sparse or THC pseudo-gradient exchange's (``plan_pseudo_gradient_buckets``, parameter
    order), for float32 parameters of ``param_numels`` (registration order) and
    ``fusion_bytes`` (None: ``STELLA_FUSION_THRESHOLD``/``HOROVOD_FUSION_THRESHOLD`` or its
    default)."""
    plan = plan_pseudo_gradient_buckets if pseudo else plan_gradient_buckets
    return [[p.numel() for p in b] for b in plan(_metas(param_numels), _cap(fusion_bytes))]


def fragment_members(param_numels, fragments):
    """[[elements of each parameter] per fragment] of ``LocalSteps(fragments=...)``: the runtime's
    balanced cut of the parameters (registration order) into contiguous runs
    (``optim/fragments.py`` ``plan_fragments``; its refusal of more fragments than parameters)."""
    named = [(str(i), t) for i, t in enumerate(_metas(param_numels))]
    return [[p.numel() for _, p in part] for part in plan_fragments(named, int(fragments))]


def pseudo_buckets(param_numels, fusion_bytes=None):
    """Elements of each bucket of local steps' sparse or THC pseudo-gradient exchange."""
    return [sum(b) for b in bucket_members(param_numels, fusion_bytes, pseudo=True)]


def buckets(param_numels, fusion_bytes=None):
    """Elements of each bucket of the synchronous routes, in launch order."""
    return [sum(b) for b in bucket_members(param_numels, fusion_bytes)]


class _Layout:
    """Ranks laid out cluster by cluster: members, and the channels of a cross-cluster step."""

    def __init__(self, sizes):
        self.sizes = sizes
        self.members, start = [], 0
        for s in sizes:
            self.members.append(list(range(start, start + s)))
            start += s
        self.size = start
        self.nclusters = len(sizes)
        self.uniform = len(set(sizes)) == 1

    def channels(self, numel):
        """[(shard index, elements, [world rank of each cluster's owner])] of a buffer reduced
        by ``Hierarchy.reduce_across_clusters``: the shards of equal clusters, or the leaders."""
        if self.uniform:
            counts = split_counts(numel, self.sizes[0])
            return [(i, counts[i], [m[i] for m in self.members]) for i in range(self.sizes[0])]
        return [(0, numel, [m[0] for m in self.members])]


def _add(row, sent, received, messages, elements=0, entries=0):
    row["wan_bytes_sent"] += sent
    row["wan_bytes_received"] += received
    row["wan_messages"] += messages
    row["elements"] += elements
    row["entries_sent"] += entries


def _dense_piece(rows, ranks, n, item, small_float):
    """``Hierarchy.cross_reduce`` of ``n`` elements (nothing moves for n == 0)."""
    if n == 0:
        return
    moved = cross_reduce_bytes(n, item, len(ranks), small_float)
    for r in ranks:
        _add(rows[r], moved, moved, 1, n, n)


def _thc_piece(rows, ranks, n, comp):
    scale_bytes, word_bytes = thc_bytes(comp, n, len(ranks))
    for r in ranks:
        _add(rows[r], scale_bytes + word_bytes, scale_bytes + word_bytes, THC_MESSAGES, n, n)


def _sparse_piece(rows, ranks, n, comp, setting, ask):
    """``sparse_cross_step`` over the clusters' owners ``ranks`` of a shard of ``n`` elements;
    ``ask(cluster, round)`` -> that cluster's Payload."""
    nclusters = len(ranks)
    if comp.density >= 1.0:   # dense_rung: the sum crosses as in the dense route, values as the wire's
        item = torch.empty((), dtype=getattr(torch, comp.value_dtype)).element_size()
        _dense_piece(rows, ranks, n, item, comp.value_dtype != "float32")
        return
    first = [ask(c, 1) for c in range(nclusters)]
    for r, p in zip(ranks, first):
        _add(rows[r], 0, 0, 0, n, p.entries)
    if choose_algorithm(setting, nclusters, 8 * comp.k_for(n)) == "tree":
        current, rnd, dist = first, 1, 1
        while dist < nclusters:   # recursive doubling: partner me ^ dist
            for me, r in enumerate(ranks):
                sent, received = swap_bytes(current[me].bytes, current[me ^ dist].bytes)
                _add(rows[r], sent, received, 0)
            dist, rnd = dist << 1, rnd + 1
            if dist < nclusters:
                current = [ask(c, rnd) for c in range(nclusters)]
        for r in ranks:
            _add(rows[r], 0, 0, tree_messages(nclusters))
        return
    sizes = [p.bytes for p in first]
    for me, r in enumerate(ranks):
        sent, received = allgather_bytes(sizes, me)
        _add(rows[r], sent, received, ALLGATHER_MESSAGES)


def _reduce(rows, lay, numel, comp, setting, payload, step, bucket):
    """One buffer of ``numel`` float32 elements through ``comp`` across the clusters."""
    if lay.nclusters == 1 or lay.size == 1:
        return
    for shard, n, ranks in lay.channels(numel):
        if comp is None:
            _dense_piece(rows, ranks, n, 4, False)
        elif comp == "fp16":
            _dense_piece(rows, ranks, n, 2, True)
        elif getattr(comp, "homomorphic", False):
            _thc_piece(rows, ranks, n, comp)
        else:
            def ask(cluster, rnd, shard=shard, n=n):
                q = PayloadQuery(step, bucket, cluster, shard, n, comp, rnd)
                return payload(q) if payload is not None else sized_payload(comp, n, rnd)
            _sparse_piece(rows, ranks, n, comp, setting, ask)


def step_traffic(route, cluster_sizes: Sequence[int], param_numels: Sequence[int], *, fusion_bytes=None, step=0,
                 payload: Optional[PayloadFn] = None) -> List[dict]:
    """Per world rank, the counters (:data:`COUNTED`) of the optimizer's step ``step`` on
    ``route`` (see the module's documentation)."""
    if not isinstance(route, Route):
        raise TypeError("step_traffic: route must be a wire.Route, got %r" % (route,))
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError("step_traffic: step is the optimizer's step count (an int >= 0), got %r" % (step,))
    lay = _Layout(_check_sizes(cluster_sizes))
    rows = [dict.fromkeys(COUNTED, 0) for _ in range(lay.size)]
    numels = list(param_numels)
    sizes = buckets(numels, fusion_bytes)
    if route.kind == "local":
        # the exchange after step s-1's update (when it ended a period; with fragments, a slot of
        # every/fragments steps: that slot's fragment) is counted in step s's record
        slot = route.every // route.fragments
        if step == 0 or step % slot:
            return rows
        if route.fragments > 1:
            numels = fragment_members(numels, route.fragments)[step % route.every // slot]
        total = sum(numels)
        if route.overlap:   # OuterChannel.launch: each cluster's part and its flag, allreduced
            if lay.nclusters > 1:
                for _, n, ranks in lay.channels(total):
                    moved = allreduce_bytes((n + 1) * 4, lay.nclusters)
                    for r in ranks:
                        _add(rows[r], moved, moved, 1)
            return rows
        pseudo = route.pseudo or Route("dense")
        comp = pseudo.make_compressor()
        if comp is None or comp == "fp16":
            _reduce(rows, lay, total, comp, pseudo.algorithm, payload, step, None)
            return rows
        # a sparse or THC pseudo-gradient crosses in buckets (optim/tuning.py pseudo_gradient_exchange)
        for b, n in enumerate(pseudo_buckets(numels, fusion_bytes)):
            _reduce(rows, lay, n, comp, pseudo.algorithm, payload, step, b)
        return rows
    comp = route.make_compressor()
    if comp is not None and comp != "fp16" and not getattr(comp, "homomorphic", False):
        comp = density_warmup(comp, step, int(getattr(comp, "warmup", 0) or 0))
    for b, numel in enumerate(sizes):
        _reduce(rows, lay, numel, comp, route.algorithm, payload, step, b)
    return rows


def bottleneck(rows, cluster_sizes):
    """What the adjuster's cost model learns from one step's ``rows`` (``sample_from_rows``):
    ranks with WAN traffic grouped by shard channel (cluster rank); per channel the largest
    max(sent, received) bytes, messages and elements of its ranks. Returns ``bytes``,
    ``messages``, ``elements`` and ``channel`` of the channel with the most bytes (None where
    nothing crossed) and ``channels`` {channel: {bytes, messages, elements}}."""
    lay = _Layout(_check_sizes(cluster_sizes))
    if len(rows) != lay.size:
        raise ValueError("bottleneck: %d rows for a layout of %d ranks %s" % (len(rows), lay.size, lay.sizes))
    channels = {}
    for c, members in enumerate(lay.members):
        for cr, r in enumerate(members):
            row = rows[r]
            nbytes = max(row["wan_bytes_sent"], row["wan_bytes_received"])
            if nbytes <= 0:
                continue
            ch = channels.setdefault(cr, {"bytes": 0, "messages": 0, "elements": 0})
            ch["bytes"] = max(ch["bytes"], nbytes)
            ch["messages"] = max(ch["messages"], row["wan_messages"])
            ch["elements"] = max(ch["elements"], row["elements"])
    if not channels:
        return {"bytes": 0, "messages": 0, "elements": 0, "channel": None, "channels": {}}
    busiest = max(sorted(channels), key=lambda g: channels[g]["bytes"])
    return dict(channels[busiest], channel=busiest, channels=channels)
