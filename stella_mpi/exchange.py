"""The sparse cross-cluster step: per-shard selection with error feedback, MPI exchange
among the ranks owning the same shard in every cluster, k-way merge, and the return to a
dense shard.

Route of one fused float32 buffer (clusters of equal size)::

    reduce-scatter inside the cluster (dense, fast link)      -> this rank's shard (cluster sum)
    select from shard + residual, encode                      -> payload (compact indices/values)
    exchange payloads with the same shard's owners (MPI, WAN) -> one payload per cluster
    decode (validated: a peer is untrusted) and merge          -> sum over clusters, ascending
    shard = merged / size; all-gather inside the cluster      -> every rank holds the result

Clusters of unequal size: reduce to the cluster leader, the leaders run the steps above on
the whole buffer, and broadcast inside their cluster. With one cluster there is no WAN and
no selection: the dense route runs.
"""
import time

import numpy as np
import torch

from .compression.base import TensorContext
from .compression.sparse import merge_selections, scatter_add
from .errors import HorovodInternalError
from .ops import EXECUTORS, fuse, unfuse
from .topology import split_counts
from .transport import wan_pace


class PeerPayloadError(HorovodInternalError):
    """A payload from another rank failed validation: the job ends, naming the sender."""


def _exchange_payloads(pset, comm, payload, what):
    """Every rank of ``comm`` sends its uint8 payload to all others; returns the list of
    payloads in ``comm`` rank order (ours included) and the bytes moved."""
    nranks, me = comm.Get_size(), comm.Get_rank()
    dl = pset.deadline
    started = time.monotonic()
    mine = np.array([payload.numel()], dtype=np.int64)
    sizes = np.zeros(nranks, dtype=np.int64)
    dl.wait(comm.Iallgather(mine, sizes), what + " (sizes)")
    total = int(sizes.sum())
    if total > (1 << 40):
        raise PeerPayloadError("%s: peers announced %d bytes of payload; refusing" % (what, total))
    out = torch.empty(total, dtype=torch.uint8)
    displs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    from mpi4py import MPI
    dl.wait(comm.Iallgatherv(payload.numpy(), [out.numpy(), sizes.tolist(), displs.tolist(), MPI.BYTE]), what)
    pieces = [out[int(d):int(d) + int(s)] for d, s in zip(displs, sizes)]
    sent = int(sizes[me]) * (nranks - 1) + 8 * (nranks - 1)
    received = total - int(sizes[me]) + 8 * (nranks - 1)
    wan_pace(max(sent, received), started, rounds=2)
    return pieces, sent, received


def _swap_payload(pset, comm, partner, payload, what):
    """Exchange one payload with one partner (sizes first); returns (theirs, bytes moved)."""
    dl = pset.deadline
    started = time.monotonic()
    mine = np.array([payload.numel()], dtype=np.int64)
    size = np.zeros(1, dtype=np.int64)
    dl.wait_all([comm.Isend(mine, dest=partner, tag=91), comm.Irecv(size, source=partner, tag=91)], what + " (size)")
    if int(size[0]) > (1 << 40) or int(size[0]) < 0:
        raise PeerPayloadError("%s: a peer announced %d bytes of payload; refusing" % (what, int(size[0])))
    theirs = torch.empty(int(size[0]), dtype=torch.uint8)
    dl.wait_all([comm.Isend(payload.numpy(), dest=partner, tag=92),
                 comm.Irecv(theirs.numpy(), source=partner, tag=92)], what)
    wan_pace(max(payload.numel(), theirs.numel()) + 8, started, rounds=2)
    return theirs, payload.numel() + 8, theirs.numel() + 8


def tree_reduce(pset, comm, sel, comp, ctx, memory, name, n, comm_kind, stats):
    """Sum selections over a power-of-two number of clusters by recursive doubling: in round r
    each rank swaps its current selection with rank ``me ^ 2**r``, merges the two (lower rank
    first, so both sides get the same bits) and keeps the k largest entries. Each rank sends
    log2(C) payloads of at most k entries instead of the C-1 of an all-gather. What a round
    drops goes into the residual of one rank (the lowest of the ranks that computed the same
    merge), so error feedback sends it later."""
    from .compression.sparse import Selection
    from .compression import kernels
    me, nranks = comm.Get_rank(), comm.Get_size()
    k = max(len(sel), 1)
    current = sel
    sent = received = 0
    t_exchange = t_decode = t_merge = 0.0
    r = 1
    while r < nranks:
        partner = me ^ r
        t0 = time.perf_counter()
        payload = comp.encode(current, ctx)
        theirs, s_bytes, r_bytes = _swap_payload(pset, comm, partner, payload, "sparse tree exchange of %r" % name)
        t1 = time.perf_counter()
        try:
            other = comp.decode(theirs, ctx, n)
        except ValueError as e:
            raise PeerPayloadError("rank %d sent a malformed payload for %r (step %d): %s"
                                   % (_sender_rank(pset, comm_kind, partner), name, ctx.step, e)) from None
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
                res = memory.residual(name, n)
                res.index_add_(0, merged.indices[~keep].long(), merged.values[~keep])
            merged = Selection(merged.indices[keep].contiguous(), merged.values[keep].contiguous(), n)
        current = merged
        t3 = time.perf_counter()
        sent += s_bytes
        received += r_bytes
        t_exchange += t1 - t0
        t_decode += t2 - t1
        t_merge += t3 - t2
        r <<= 1
    stats.add(wan_bytes_sent=sent, wan_bytes_received=received, wan_messages=2 * (nranks.bit_length() - 1),
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


TREE_MIN_PAYLOAD = 64 * 1024


def _sender_rank(pset, comm_kind, index):
    """World rank behind position ``index`` of the shard (or leader) communicator."""
    topo = pset.topology
    members = topo.cluster_members[index]
    world = members[topo.cluster_rank] if comm_kind == "shard" else members[0]
    return pset.ranks[world]


def sparse_reduce(pset, buf, comp, memory, name, step, seed, comm, comm_kind, stats):
    """Sum ``buf`` (this rank's shard of the cluster sum, float32) over the clusters on ``comm``
    through the compressor; returns the merged Selection (not yet scaled)."""
    ctx = TensorContext(name=name, step=step, shape=(buf.numel(),), seed=seed)
    grad_sq = float(torch.dot(buf, buf))
    t0 = time.perf_counter()
    sel = comp.select(buf, ctx, memory=memory)
    t1 = time.perf_counter()
    stats.add(select_s=t1 - t0, elements=buf.numel(), entries_sent=len(sel))
    if choose_algorithm(pset.sparse_algorithm, comm.Get_size(), 8 * len(sel)) == "tree":
        merged = tree_reduce(pset, comm, sel, comp, ctx, memory, name, buf.numel(), comm_kind, stats)
    else:
        merged = _allgather_reduce(pset, comm, sel, comp, ctx, name, buf.numel(), comm_kind, stats)
    # after the exchange: the tree may have put dropped entries into the residual
    res = memory.get(name) if memory is not None else None
    stats.add_norms(float(torch.dot(res, res)) if res is not None else 0.0, grad_sq)
    return merged


def _allgather_reduce(pset, comm, sel, comp, ctx, name, n, comm_kind, stats):
    """Every rank's payload to every other, decoded (validated) and merged in rank order."""
    t1 = time.perf_counter()
    payload = comp.encode(sel, ctx)
    if pset.tamper is not None:
        payload = pset.tamper(payload)
    t2 = time.perf_counter()
    pieces, sent, received = _exchange_payloads(pset, comm, payload, "sparse exchange of %r" % name)
    t3 = time.perf_counter()
    me = comm.Get_rank()
    sels = []
    for i, piece in enumerate(pieces):
        if i == me:
            sels.append(sel)
            continue
        try:
            sels.append(comp.decode(piece, ctx, n))
        except ValueError as e:
            raise PeerPayloadError("rank %d sent a malformed payload for %r (step %d): %s"
                                   % (_sender_rank(pset, comm_kind, i), name, ctx.step, e)) from None
    t4 = time.perf_counter()
    merged = merge_selections(sels)
    t5 = time.perf_counter()
    stats.add(wan_bytes_sent=sent, wan_bytes_received=received, wan_messages=2, encode_s=t2 - t1,
              exchange_s=t3 - t2, decode_s=t4 - t3, merge_s=t5 - t4)
    return merged


def execute_sparse_allreduce(pset, desc, inputs, joined):
    """inputs: (tensors, outputs, compressor, memory, stats). float32, op sum or average."""
    tensors, outputs, comp, memory, stats = inputs
    started = time.perf_counter()
    topo = pset.topology
    hier = pset.hierarchy
    buf, direct = fuse(tensors, outputs, torch.float32)
    n = buf.numel()
    if desc["prescale"] != 1.0:
        buf.mul_(desc["prescale"])
    scale = desc["postscale"] / (pset.nranks if desc["op"] == "average" else 1)
    name, step, seed = desc["name"], desc["step"], desc["seed"]
    mem = memory if comp.error_feedback else None
    if topo.num_clusters == 1 or pset.nranks == 1:
        hier.allreduce(buf, "sum")          # no WAN: nothing to compress
        buf.mul_(scale)
    elif topo.uniform_clusters:
        cs = topo.cluster_size
        counts = split_counts(n, cs)
        shard = hier.intra.reduce_scatter(buf, counts, "sum", hier.scratch("shard", counts[topo.cluster_rank],
                                                                          torch.float32)) if cs > 1 else buf
        merged = sparse_reduce(pset, shard, comp, mem, "%s#shard%d" % (name, topo.cluster_rank), step, seed,
                               pset.comms.shard, "shard", stats)
        shard.zero_()
        scatter_add(shard, merged, scale)
        if cs > 1:
            hier.intra.allgather_into(shard, counts, buf)
    else:
        if topo.cluster_size > 1:
            hier.intra.reduce(buf, "sum", root=0)
        if topo.cluster_rank == 0:
            merged = sparse_reduce(pset, buf, comp, mem, name, step, seed, pset.comms.leaders, "leader", stats)
            buf.zero_()
            scatter_add(buf, merged, scale)
        if topo.cluster_size > 1:
            hier.intra.bcast(buf, root=0)
    if not direct:
        unfuse(buf, outputs)
    stats.add(engine_s=time.perf_counter() - started)
    return outputs


def _not_joinable(desc):
    raise ValueError("sparse allreduce cannot run with joined ranks")


EXECUTORS["sparse_allreduce"] = (execute_sparse_allreduce, _not_joinable)
