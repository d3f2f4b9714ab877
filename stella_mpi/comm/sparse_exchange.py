"""The sparse cross-cluster step: selection with error feedback, MPI exchange among one rank
per cluster, validation and k-way merge.

Route of one fused float32 buffer, clusters of equal size (the sequence itself is
:meth:`.hierarchy.Hierarchy.reduce_across_clusters`)::

    reduce-scatter inside the cluster (dense, fast link)      -> this rank's shard (cluster sum)
    select from shard + residual, encode                      -> payload (compact indices/values)
    exchange payloads with the same shard's owners (MPI, WAN) -> one payload per cluster
    decode (validated: a peer is untrusted) and merge          -> sum over clusters, ascending
    shard = merged * scale; all-gather inside the cluster     -> every rank holds the result

Clusters of unequal size: reduce to the cluster leader, the leaders run the steps above on
the whole buffer, and broadcast inside their cluster. :func:`sparse_reduce` is the step
itself (it returns the merged selection: the CPU engine feeds it to its optimizer);
:func:`sparse_cross_step` wraps it as the ``cross`` of ``reduce_across_clusters``.
"""
import time

import numpy as np
import torch
from mpi4py import MPI

from .._native import compress as kernels
from ..base import timeline
from ..base.devices import route_for
from ..base.errors import HorovodInternalError
from ..compression import Selection, TensorContext, merge_selections, scatter_add
from .buffers import displacements

MAX_MPI_COUNT = (1 << 31) - 1   # an int count: the most bytes one all-gather of payloads takes
TREE_MIN_PAYLOAD = 64 * 1024


class PeerPayloadError(HorovodInternalError):
    """A payload from another rank failed validation: the job ends, naming the sender."""


def residual_key(name, kind, topo):
    """The error-feedback key of ``name`` on this rank: one residual per shard ("shard": the
    cluster's ranks each select from their own shard) or per buffer ("leader")."""
    return "%s#shard%d" % (name, topo.cluster_rank) if kind == "shard" else name


def payload_bound(n):
    """The most bytes a valid payload for a tensor of n elements can hold (every entry with a
    32-bit index and a 32-bit value; the 16-bit segment scheme's table besides)."""
    return kernels.HEADER_BYTES + 8 * n + 4 * (n // kernels.SEGMENT + 1)


def allgather_bytes(sizes, me):
    """(bytes sent, bytes received) by position ``me`` of the all-gather of payloads of
    ``sizes`` bytes (one per cluster, in comm order), as the WAN counters count them: its own
    payload to each of the C - 1 others, theirs from them, and an 8-byte size each way in the
    first round. Two messages (the sizes, then the payloads): :data:`ALLGATHER_MESSAGES`."""
    others = len(sizes) - 1
    return int(sizes[me]) * others + 8 * others, int(sum(sizes)) - int(sizes[me]) + 8 * others


ALLGATHER_MESSAGES = 2


def swap_bytes(mine, theirs):
    """(bytes sent, bytes received) of one round of the tree: a payload each way, after its
    8-byte size."""
    return mine + 8, theirs + 8


def tree_messages(nranks):
    """Messages the tree counts over ``nranks`` (a power of two) clusters: two per round (size,
    payload), log2(nranks) rounds."""
    return 2 * (nranks.bit_length() - 1)


def _check_announced(hier, kind, index, size, n, what):
    """A peer's announced payload size, before anything is allocated for it."""
    if not kernels.HEADER_BYTES <= size <= payload_bound(n):
        raise PeerPayloadError("%s: rank %d announced a payload of %d bytes for a tensor of %d elements (a valid "
                               "one has %d to %d); refusing it unread" % (
                                   what, sender_rank(hier, kind, index), size, n, kernels.HEADER_BYTES,
                                   payload_bound(n)))


def _exchange_payloads(hier, comm, payload, n, kind, what):
    """Every rank of ``comm`` sends its uint8 payload to all others; returns the list of
    payloads in ``comm`` rank order (ours included) and the bytes moved."""
    nranks, me = comm.Get_size(), comm.Get_rank()
    dl = hier.deadline
    started = time.monotonic()
    mine = np.array([payload.numel()], dtype=np.int64)
    sizes = np.zeros(nranks, dtype=np.int64)
    dl.wait(comm.Iallgather(mine, sizes), what + " (sizes)")
    for i, size in enumerate(sizes.tolist()):
        _check_announced(hier, kind, i, size, n, what)
    total = int(sizes.sum())
    if total > MAX_MPI_COUNT:   # (every rank sees the same sizes, so every rank refuses alike)
        raise ValueError("%s: the clusters' payloads total %d bytes, more than one MPI all-gather takes (2^31 - 1); "
                         "use a lower density or smaller fusion buckets (HOROVOD_FUSION_THRESHOLD)" % (what, total))
    out = torch.empty(total, dtype=torch.uint8)
    displs = displacements(sizes.tolist())
    dl.wait(comm.Iallgatherv(payload.numpy(), [out.numpy(), sizes.tolist(), displs, MPI.BYTE]), what)
    pieces = [out[d:d + int(s)] for d, s in zip(displs, sizes)]
    sent, received = allgather_bytes(sizes.tolist(), me)
    hier.pacer.pace(max(sent, received), started, rounds=2)
    return pieces, sent, received


def _swap_payload(hier, comm, partner, payload, n, kind, what):
    """Exchange one payload with one partner (sizes first); returns (theirs, bytes moved)."""
    dl = hier.deadline
    started = time.monotonic()
    mine = np.array([payload.numel()], dtype=np.int64)
    size = np.zeros(1, dtype=np.int64)
    dl.wait_all([comm.Isend(mine, dest=partner, tag=91), comm.Irecv(size, source=partner, tag=91)], what + " (size)")
    _check_announced(hier, kind, partner, int(size[0]), n, what)
    theirs = torch.empty(int(size[0]), dtype=torch.uint8)
    dl.wait_all([comm.Isend(payload.numpy(), dest=partner, tag=92),
                 comm.Irecv(theirs.numpy(), source=partner, tag=92)], what)
    hier.pacer.pace(max(payload.numel(), theirs.numel()) + 8, started, rounds=2)
    return (theirs,) + swap_bytes(payload.numel(), theirs.numel())


def _decode_from(hier, comp, piece, ctx, n, kind, index, name):
    """Decode a peer's payload; a malformed one ends the job naming the sender."""
    try:
        return comp.decode(piece, ctx, n)
    except ValueError as e:
        raise PeerPayloadError("rank %d sent a malformed payload for %r (step %d): %s"
                               % (sender_rank(hier, kind, index), name, ctx.step, e)) from None


def tree_reduce(hier, comm, sel, comp, ctx, memory, key, n, kind, device="cpu"):
    """Sum selections over a power-of-two number of clusters by recursive doubling: in round r
    each rank swaps its current selection with rank ``me ^ 2**r``, merges the two (lower rank
    first, so both sides get the same bits) and keeps the k largest entries. Each rank sends
    log2(C) payloads of at most k entries instead of the C-1 of an all-gather. What a round
    drops goes into the residual of one rank (the lowest of the ranks that computed the same
    merge), so error feedback sends it later (the residual lives on ``device``). Every rank
    keeps the same k (the compressor's for n: a selection's own length differs by rank for
    threshold, or cache-aware's short tail block), and from the second round on rounds its merge
    to the wire's value dtype before sending it, so that both partners merge the same values."""
    me, nranks = comm.Get_rank(), comm.Get_size()
    k = max(comp.k_for(n), 1)
    current = sel
    sent = received = 0
    t_exchange = t_decode = t_merge = 0.0
    r = 1
    while r < nranks:
        partner = me ^ r
        t0 = time.perf_counter()
        if r > 1:   # the r ranks that computed this merge round alike; the lowest keeps the error
            keeps = memory is not None and me & (r - 1) == 0
            current = comp.to_wire(current, memory.residual(key, n, device) if keeps else None)
        payload = comp.encode(current, ctx)
        theirs, s_bytes, r_bytes = _swap_payload(hier, comm, partner, payload, n, kind,
                                                 "sparse tree exchange of %r" % ctx.name)
        t1 = time.perf_counter()
        other = _decode_from(hier, comp, theirs, ctx, n, kind, partner, ctx.name)
        t2 = time.perf_counter()
        pair = [current, other] if me < partner else [other, current]
        merged = merge_selections(pair)
        if len(merged) > k:
            pos, _ = kernels.topk(merged.values, k)
            keep = torch.zeros(len(merged), dtype=torch.bool)
            keep[pos.long()] = True
            # after this round the 2r ranks sharing me's higher bits all hold the same merge:
            # only the lowest of them keeps what was dropped, so it is counted once
            if memory is not None and me & (2 * r - 1) == 0:
                res = memory.residual(key, n, device)
                res.index_add_(0, merged.indices[~keep].long().to(device), merged.values[~keep].to(device))
            merged = Selection(merged.indices[keep].contiguous(), merged.values[keep].contiguous(), n)
        current = merged
        t3 = time.perf_counter()
        timeline.record("WAN_EXCHANGE", t0, t1, bytes_sent=s_bytes, bytes_received=r_bytes, round=r, partner=partner)
        timeline.record("DECODE", t1, t2)
        timeline.record("MERGE", t2, t3, entries=len(current))
        sent += s_bytes
        received += r_bytes
        t_exchange += t1 - t0
        t_decode += t2 - t1
        t_merge += t3 - t2
        r <<= 1
    hier.stats.add(wan_bytes_sent=sent, wan_bytes_received=received, wan_messages=tree_messages(nranks),
                   exchange_s=t_exchange, decode_s=t_decode, merge_s=t_merge)
    return current


def choose_algorithm(setting, nclusters, payload_bytes):
    """allgather or tree for the cross-cluster sum of selections.

    The tree sends log2(C) payloads instead of C-1, but each round re-selects on the CPU and
    the re-selected indices lose the block structure that keeps cache-aware payloads small.
    Measured with bench/bench_sparse_exchange.py at 4 clusters (26M parameters, 1 %): the
    tree sent 2.7 instead of 3.35 MB per rank and step (54 ms less at 100 Mbit/s) but spent
    122 ms more merging and re-selecting, so the all-gather wins at 4 clusters; the tree is
    chosen from 8 clusters on (3 payloads instead of 7) for payloads of 64 KiB or more.
    ``STELLA_SPARSE_ALGO`` overrides the choice."""
    if setting in ("allgather", "tree"):
        if setting == "tree" and nclusters & (nclusters - 1):
            return "allgather"  # recursive doubling needs a power of two
        return setting
    if nclusters >= 8 and not nclusters & (nclusters - 1) and payload_bytes >= TREE_MIN_PAYLOAD:
        return "tree"
    return "allgather"


def sender_rank(hier, kind, index):
    """World rank behind position ``index`` of the shard (or leader) communicator."""
    topo = hier.topo
    members = topo.cluster_members[index]
    member = members[topo.cluster_rank] if kind == "shard" else members[0]
    return hier.ranks[member]


def _to_host(sel):
    """A selection made on a GPU, copied device-to-host into pinned buffers on the side stream:
    only the selected entries cross PCIe. The buffers belong to the collective thread's current
    op (the codec and the merge read them; the merged result is new memory)."""
    if sel.indices.device.type == "cpu":
        return sel
    route = route_for(sel.indices.device)
    idx = route.to_host(sel.indices, "selection.indices", wait=False)
    scales = None if sel.scales is None else route.to_host(sel.scales, "selection.scales", wait=False)
    val = route.to_host(sel.values, "selection.values")
    return Selection(idx, val, sel.numel, sel.key, scales)


def sparse_reduce(hier, buf, comp, memory, name, step, seed, comm, kind):
    """Sum ``buf`` (this rank's shard of the cluster sum, float32, on the CPU or a GPU) over the
    clusters on ``comm`` through the compressor (error feedback in ``memory`` unless it is
    None); returns the merged Selection (on the host, not yet scaled)."""
    key = residual_key(name, kind, hier.topo)
    ctx = TensorContext(name=key, step=step, shape=(buf.numel(),), seed=seed)
    grad_sq = float(torch.dot(buf, buf))
    t0 = time.perf_counter()
    sel = _to_host(comp.select(buf, ctx, memory=memory))
    t1 = time.perf_counter()
    timeline.record("SELECT", t0, t1, compressor=comp.name, density=comp.density, elements=buf.numel(),
                    entries=len(sel))
    hier.stats.add(select_s=t1 - t0, elements=buf.numel(), entries_sent=len(sel))
    # (from the compressor's k, the same on every rank: a selection's own length may differ)
    if choose_algorithm(hier.sparse_algorithm, comm.Get_size(), 8 * comp.k_for(buf.numel())) == "tree":
        merged = tree_reduce(hier, comm, sel, comp, ctx, memory, key, buf.numel(), kind, buf.device)
    else:
        merged = _allgather_reduce(hier, comm, sel, comp, ctx, buf.numel(), kind)
    # after the exchange: the tree may have put dropped entries into the residual
    res = memory.get(key) if memory is not None else None
    hier.stats.add_norms(float(torch.dot(res, res)) if res is not None else 0.0, grad_sq)
    return merged


def _allgather_reduce(hier, comm, sel, comp, ctx, n, kind):
    """Every rank's payload to every other, decoded (validated) and merged in rank order."""
    t1 = time.perf_counter()
    payload = comp.encode(sel, ctx)
    if hier.tamper is not None:
        payload = hier.tamper(payload)
    t2 = time.perf_counter()
    pieces, sent, received = _exchange_payloads(hier, comm, payload, n, kind, "sparse exchange of %r" % ctx.name)
    t3 = time.perf_counter()
    me = comm.Get_rank()
    sels = [sel if i == me else _decode_from(hier, comp, piece, ctx, n, kind, i, ctx.name)
            for i, piece in enumerate(pieces)]
    t4 = time.perf_counter()
    merged = merge_selections(sels)
    t5 = time.perf_counter()
    timeline.record("ENCODE", t1, t2, bytes=payload.numel())
    timeline.record("WAN_EXCHANGE", t2, t3, bytes_sent=sent, bytes_received=received, clusters=len(pieces))
    timeline.record("DECODE", t3, t4)
    timeline.record("MERGE", t4, t5, entries=len(merged))
    hier.stats.add(wan_bytes_sent=sent, wan_bytes_received=received, wan_messages=ALLGATHER_MESSAGES,
                   encode_s=t2 - t1,
                   exchange_s=t3 - t2, decode_s=t4 - t3, merge_s=t5 - t4)
    return merged


def dense_rung(hier, piece, comp, memory, key, comm):
    """Density 1 (the adjuster's top rung, or a user's ``density=1.0``): every entry would be
    sent, so indices only add bytes. The residual joins the piece and is cleared, and the sum
    crosses as in the dense route (16-bit values stay 16-bit). Counted like the sparse exchange,
    so the adjuster keeps learning the link from it."""
    res = memory.get(key) if memory is not None else None
    if res is not None:
        if res.numel() == piece.numel():   # (a name reused with another size starts afresh)
            back = getattr(comp, "from_coefficients", None)   # a residual kept in a transformed domain
            piece.add_((back(res.clone()) if back is not None else res).to(piece.device))
        memory.reset(key)
    grad_sq = float(torch.dot(piece, piece))
    wire = None if comp.value_dtype == "float32" else getattr(torch, comp.value_dtype)
    if wire is not None:   # 16-bit values: clamped to the wire's range, the rounding error kept (as select does)
        rounded, err = comp.wire_rounding(piece)
        if memory is not None:
            memory.residual(key, piece.numel(), piece.device).copy_(err)
        piece.copy_(rounded)
    t0 = time.perf_counter()
    hier.cross_reduce(piece, "sum", comm, wire)
    hier.stats.add(exchange_s=time.perf_counter() - t0)
    hier.stats.add_norms(0.0, grad_sq)


def sparse_cross_step(hier, comp, memory, name, step, seed, scale):
    """The ``cross`` of :meth:`.hierarchy.Hierarchy.reduce_across_clusters` for a sparse
    compressor: the piece becomes the merged selection times ``scale`` (zero elsewhere); at
    density 1, the dense sum times ``scale`` (:func:`dense_rung`)."""
    def cross(piece, comm, kind):
        if comp.density >= 1.0:
            dense_rung(hier, piece, comp, memory, residual_key(name, kind, hier.topo), comm)
            if scale != 1.0:
                piece.mul_(scale)
            return
        merged = sparse_reduce(hier, piece, comp, memory, name, step, seed, comm, kind)
        with timeline.span("SCATTER", entries=len(merged)):
            piece.zero_()
            scatter_add(piece, merged, scale)
        back = getattr(comp, "from_coefficients", None)   # a compressor that selects in a transformed domain
        if back is not None:
            with timeline.span("INVERSE_TRANSFORM", elements=piece.numel()):
                back(piece)
    return cross
