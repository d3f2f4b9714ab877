"""The two-level route of every collective of one process set, on flat CPU buffers.

Inside a cluster the ``intra`` backend (MPI or gloo) moves the data; across
clusters MPI does, on the communicators of :class:`.topology.Communicators`:

* reduction across clusters (:meth:`Hierarchy.reduce_across_clusters`), the one sequence
  that dense allreduce and the sparse route share: with clusters of equal size,
  reduce-scatter inside the cluster (:meth:`~Hierarchy.cluster_shard`), a cross-cluster step
  on this rank's shard among the ranks owning the same shard in the other clusters, and
  all-gather inside the cluster (:meth:`~Hierarchy.gather_shards`); every rank's link to the
  WAN works. With clusters of unequal size: reduce to the cluster leader, the cross-cluster
  step among the leaders on the whole buffer, broadcast inside the cluster. The CPU engine
  uses the two halves around its optimizer step (it gathers the updated weights, not the sum).
* the dense cross-cluster step (:meth:`Hierarchy.cross_reduce`): across two clusters each
  rank swaps its shard with its peer and reduces (a OP b equals b OP a bit for bit, so both
  agree); with more clusters, 16-bit floats are all-gathered and reduced in cluster order in C
  (16-bit data crosses the WAN at 16 bits, results bit-identical everywhere), other dtypes use
  MPI's allreduce. The sparse step is :func:`.sparse_exchange.sparse_cross_step`.
* allgather and broadcast go leader to leader across clusters; alltoall is point to point
  by nature and goes straight over the process set's communicator.

Every byte that crosses clusters is counted in ``stats`` and paced by ``pacer``.
"""
import contextlib
import logging
import socket
import time

import numpy as np
import torch
from mpi4py import MPI

from .._native.dense import accumulate as _accumulate_f32
from ..base import timeline
from ..base.devices import route_for
from .adasum import adasum_allreduce
from .buffers import byte_view, displacements, mpi_view, split_counts
from .intra import MPI_OPS, NCCL_DTYPES, NcclIntra, StagedIntra, nccl_usable
from .messages import allgather_json
from .pacing import Pacer

log = logging.getLogger("stella_mpi")


def compute_dtype(dtype):
    """The dtype reductions run in: 16-bit floats in float32, bool as uint8."""
    if dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    if dtype == torch.bool:
        return torch.uint8
    return dtype


def accumulate(acc, src, op):
    """acc = acc OP src, element-wise, in place. ``acc`` is in the compute dtype."""
    if acc.numel() == 0:
        return
    if acc.dtype == torch.float32 and src.dtype in (torch.float32, torch.float16, torch.bfloat16):
        _accumulate_f32(acc, src, op)
        return
    src = src.to(acc.dtype)
    if op == "sum":
        acc.add_(src)
    elif op == "product":
        acc.mul_(src)
    elif op == "min":
        torch.minimum(acc, src, out=acc)
    else:
        torch.maximum(acc, src, out=acc)


def allreduce_bytes(nbytes, nclusters):
    """Bytes one rank sends (and receives) to allreduce ``nbytes`` over ``nclusters`` ranks, as
    the WAN counters count it: one swap between two clusters, the ring's 2 (C-1)/C beyond."""
    return nbytes * (nclusters - 1) if nclusters == 2 else 2 * nbytes * (nclusters - 1) // nclusters


def cross_reduce_bytes(n, item, nclusters, small_float):
    """Bytes one rank sends (and receives) in :meth:`Hierarchy.cross_reduce` of ``n`` elements of
    ``item`` bytes each on the wire over ``nclusters`` clusters: 16-bit floats are all-gathered
    (every other cluster's copy arrives), other dtypes allreduced (:func:`allreduce_bytes`)."""
    return n * item * (nclusters - 1) if small_float else allreduce_bytes(n * item, nclusters)


class Hierarchy:
    """Collectives of one process set over its two levels.

    ``ranks`` are the world ranks of the set (to name a peer in messages); ``stats`` counts the
    cross-cluster traffic (``add(**counters)``, ``add_norms``); ``pacer`` emulates a slow link in
    user space. ``sparse_algorithm`` ("auto", "allgather", "tree") picks how selections are
    summed over 3+ clusters; ``tamper`` (tests only) is applied to this rank's outgoing sparse
    payloads (uint8 tensors) and THC scales (float32 arrays: the block maxima, then the NaN flag)."""

    def __init__(self, comms, intra, deadline, ranks, stats, pacer=None, sparse_algorithm="auto", nccl="auto",
                 ifname=""):
        self.comms = comms
        self.ifname = ifname        # the interface NCCL's rendezvous listens on (STELLA_GLOO_IFNAME), as gloo's
        self.nccl = nccl            # "auto": NCCL inside a cluster whose ranks have their own GPUs; "off"
        self.device_intras = {}     # CUDA device -> NcclIntra, or None (staged through the host)
        self.staged_reasons = {}    # CUDA device -> why it is staged (the warning's text)
        self.topo = comms.topo
        self.intra = intra
        self.deadline = deadline
        self.ranks = list(ranks)
        self.stats = stats
        self.pacer = pacer or Pacer()
        self.sparse_algorithm = sparse_algorithm
        self.tamper = None
        self._scratch = {}

    def scratch(self, slot, n, dtype, device=None):
        """A reusable buffer of ``n`` elements (fresh allocations of large buffers cost page
        faults on every call) on ``device`` (default: the CPU). Only the collective thread uses
        it, one op at a time; callers never hand it out to users."""
        device = torch.device("cpu") if device is None else torch.device(device)
        buf = self._scratch.get((slot, dtype, device))
        if buf is None or buf.numel() < n:
            buf = torch.empty(max(n, 1), dtype=dtype, device=device)
            self._scratch[(slot, dtype, device)] = buf
        return buf[:n]

    # ---------------- CUDA tensors inside the cluster ----------------

    def prepare_device(self, device):
        """Set up the intra-cluster route of CUDA ``device`` (once; a collective of this cluster,
        run by every member at the same op): NCCL when every rank of the cluster has a GPU of its
        own and NCCL works everywhere, else the host backend through pinned staging, with a
        warning that names the ranks sharing a GPU."""
        device = torch.device(device)
        if device.type != "cuda" or device in self.device_intras:
            return
        topo = self.topo
        if topo.cluster_size == 1:
            self.device_intras[device] = None
            return
        props = torch.cuda.get_device_properties(device)
        gpu = "%s/%s" % (socket.gethostname(), getattr(props, "uuid", device.index))
        mine = {"gpu": gpu, "nccl": self.nccl != "off" and nccl_usable()}
        everyone = allgather_json(self.comms.cluster, mine, self.deadline, "GPU layout of the cluster")
        gpus = [e["gpu"] for e in everyone]
        members = topo.cluster_members[topo.cluster_id]
        shared = sorted({g for g in gpus if gpus.count(g) > 1})
        if not shared and all(e["nccl"] for e in everyone):
            self.device_intras[device] = NcclIntra(self.comms.cluster, self.deadline,
                                                   len({g.split("/")[0] for g in gpus}) == 1, self.ifname)
            return
        self.device_intras[device] = None
        if shared:
            detail = "; ".join("ranks %s share GPU %s" % ([self.ranks[m] for m, g in zip(members, gpus) if g == s], s)
                               for s in shared) + " (NCCL refuses two ranks on one GPU)"
        else:
            detail = "NCCL is not usable (or STELLA_NCCL=off) on ranks %s" % [
                self.ranks[m] for m, e in zip(members, everyone) if not e["nccl"]]
        self.staged_reasons[device] = detail
        if topo.cluster_rank == 0:
            log.warning("stella_mpi: cluster %d: %s; its CUDA tensors go through pinned host memory and %s inside "
                        "the cluster", topo.cluster_id, detail, self.intra.name)

    def intra_for(self, buf):
        """The intra-cluster backend for ``buf``: the host one for CPU tensors; NCCL, or the host
        one through pinned staging, for CUDA tensors (:meth:`prepare_device` decided which)."""
        if buf.device.type != "cuda":
            return self.intra
        nccl = self.device_intras.get(buf.device)
        if nccl is not None and buf.dtype in NCCL_DTYPES:
            return nccl
        return StagedIntra(self.intra, route_for(buf.device))

    def free_devices(self):
        for intra in self.device_intras.values():
            if intra is not None:
                intra.free()
        self.device_intras = {}
        self.staged_reasons = {}

    @contextlib.contextmanager
    def _intra_stage(self, name, counted=1.0, **attrs):
        """A stage of the reduction inside the cluster: its timeline span, and ``counted`` times
        its seconds in the step's ``intra_s`` counter (the automatic route predicts from it
        whether each rank should be a replica of local steps: optim/tuning.py). The stage that
        hands the reduced buffer back (the all-gather, the broadcast) also waits for the
        exchange across clusters (the other shards', the leader's), so it is not counted: the
        stage before it, which moves as many bytes, counts twice (once where the backend's
        reduce-scatter is a whole allreduce: gloo's)."""
        t0 = time.perf_counter()
        try:
            with timeline.span(name, **attrs):
                yield
        finally:
            if counted:
                self.stats.add(intra_s=counted * (time.perf_counter() - t0))

    # ---------------- reduction across clusters ----------------

    def cluster_shard(self, buf, op, counts=None):
        """Reduce-scatter ``buf`` inside the cluster: (this rank's shard, the shard sizes).
        With one rank in the cluster the shard is ``buf`` itself."""
        topo = self.topo
        counts = split_counts(buf.numel(), topo.cluster_size) if counts is None else counts
        if topo.cluster_size == 1:
            return buf, counts
        me = topo.cluster_rank
        intra = self.intra_for(buf)
        with self._intra_stage("INTRA_REDUCE_SCATTER", 1.0 if intra.reduce_scatter_is_allreduce else 2.0,
                               backend=intra.name, bytes=buf.numel() * buf.element_size()):
            shard = intra.reduce_scatter(buf, counts, op, self.scratch("shard", counts[me], buf.dtype, buf.device))
        return shard, counts

    def gather_shards(self, shard, counts, out):
        """All-gather the cluster's shards (this rank's is ``shard``) into ``out``."""
        if self.topo.cluster_size > 1:
            intra = self.intra_for(shard)
            with self._intra_stage("INTRA_ALLGATHER", 0.0, backend=intra.name, bytes=out.numel() * out.element_size()):
                intra.allgather_into(shard, counts, out)
        elif shard is not out:
            out.copy_(shard)

    def reduce_across_clusters(self, buf, op, cross):
        """Reduce ``buf`` (flat) over every rank, in place: ``op`` inside each cluster, and
        ``cross(piece, comm, kind)`` across clusters, which reduces ``piece`` in place over
        ``comm`` (``kind`` "shard": the owners of this shard in every cluster; "leader": the
        cluster leaders, unequal clusters)."""
        topo = self.topo
        if topo.uniform_clusters:
            shard, counts = self.cluster_shard(buf, op)
            cross(shard, self.comms.shard, "shard")
            self.gather_shards(shard, counts, buf)
            return
        if topo.cluster_size > 1:
            with self._intra_stage("INTRA_REDUCE", 2.0):
                self.intra_for(buf).reduce(buf, op, root=0)
        if topo.cluster_rank == 0:
            cross(buf, self.comms.leaders, "leader")
        if topo.cluster_size > 1:
            with self._intra_stage("INTRA_BROADCAST", 0.0):
                self.intra_for(buf).bcast(buf, root=0)

    def allreduce(self, buf, op, wire_dtype=None):
        """Reduce ``buf`` (flat, compute dtype) over all ranks, in place.

        ``wire_dtype`` (float16/bfloat16) is the dtype that crosses the WAN."""
        topo = self.topo
        if topo.size == 1:
            return
        if topo.num_clusters == 1:
            intra = self.intra_for(buf)
            with self._intra_stage("INTRA_ALLREDUCE", backend=intra.name, bytes=buf.numel() * buf.element_size()):
                intra.allreduce(buf, op)
            return
        self.reduce_across_clusters(buf, op, lambda piece, comm, kind: self.cross_reduce(piece, op, comm, wire_dtype))

    def reduce_scatter(self, buf, counts, op):
        """Reduce ``buf`` (flat, compute dtype) over all ranks and return this rank's piece:
        ``counts[r]`` elements for set rank r, in rank order. One cluster: the intra-cluster
        reduce-scatter. Several: the buffer is laid out cluster by cluster, reduced to each
        cluster's leader, reduce-scattered among the leaders (each cluster receives only its own
        ranks' pieces across the WAN), and scattered inside the cluster."""
        topo = self.topo
        me = topo.rank
        if topo.size == 1:
            return buf
        if topo.num_clusters == 1:
            return self.intra.reduce_scatter(buf, counts, op, torch.empty(counts[me], dtype=buf.dtype))
        starts = displacements(counts)
        order = [r for members in topo.cluster_members for r in members]
        if order != list(range(topo.size)):
            buf = torch.cat([buf[starts[r]:starts[r] + counts[r]] for r in order])
        segments = [sum(counts[r] for r in members) for members in topo.cluster_members]
        if topo.cluster_size > 1:
            self.intra.reduce(buf, op, root=0)
        mine = torch.empty(segments[topo.cluster_id], dtype=buf.dtype)
        if topo.cluster_rank == 0:
            item = buf.element_size()
            sent = (buf.numel() - mine.numel()) * item
            self.stats.add(wan_bytes_sent=sent, wan_bytes_received=mine.numel() * item * (topo.num_clusters - 1),
                           wan_messages=1, elements=buf.numel(), entries_sent=buf.numel() - mine.numel())
            started = time.monotonic()
            self.deadline.wait(self.comms.leaders.Ireduce_scatter(mpi_view(buf), mpi_view(mine), segments,
                                                                  op=MPI_OPS[op]), "cross-cluster reduce-scatter")
            self.pacer.pace(sent, started)
        if topo.cluster_size == 1:
            return mine
        members = topo.cluster_members[topo.cluster_id]
        member_counts = [counts[r] for r in members]
        out = torch.empty(counts[me], dtype=buf.dtype)
        send = [mpi_view(mine), (member_counts, displacements(member_counts))] if topo.cluster_rank == 0 else None
        self.deadline.wait(self.comms.cluster.Iscatterv(send, mpi_view(out), root=0), "intra-cluster scatter")
        return out

    def adasum(self, buf, spans):
        """Adasum of ``buf`` (flat float64) over all ranks, in place, each span on its own. One
        cluster: Adasum over its ranks. Several: the sum inside each cluster, then Adasum across
        the clusters' sums (as Horovod's hierarchical Adasum sums inside a node)."""
        topo = self.topo
        if topo.size == 1:
            return
        if topo.num_clusters == 1:
            adasum_allreduce(buf, spans, self.comms.comm, self.deadline)
            return
        if topo.cluster_size > 1:
            self.intra.reduce(buf, "sum", root=0)
        if topo.cluster_rank == 0:
            levels = max(1, (topo.num_clusters - 1).bit_length())
            moved = buf.numel() * buf.element_size() * levels
            self.stats.add(wan_bytes_sent=moved, wan_bytes_received=moved, wan_messages=levels, elements=buf.numel(),
                           entries_sent=buf.numel())
            started = time.monotonic()
            adasum_allreduce(buf, spans, self.comms.leaders, self.deadline)
            self.pacer.pace(moved, started)
        if topo.cluster_size > 1:
            self.intra.bcast(buf, root=0)

    def cross_reduce(self, buf, op, comm, wire_dtype=None):
        """The dense cross-cluster step: reduce ``buf`` in place over ``comm`` (one rank per
        cluster), with ``wire_dtype`` on the wire when given. A CUDA ``buf`` crosses to pinned
        host memory and back (the WAN is MPI's)."""
        nclusters = comm.Get_size()
        n = buf.numel()
        if nclusters == 1 or n == 0:
            return
        if buf.device.type == "cuda":
            route = route_for(buf.device)
            host = route.to_host(buf, "cross")
            self.cross_reduce(host, op, comm, wire_dtype)
            route.to_device(host, out=buf)
            route.finish()
            return
        small_float = wire_dtype in (torch.float16, torch.bfloat16)
        if small_float:
            wire = self.scratch("wire", n, wire_dtype)
            wire.copy_(buf)
        else:
            wire = buf
        item = wire.element_size()
        moved = cross_reduce_bytes(n, item, nclusters, small_float)
        self.stats.add(wan_bytes_sent=moved, wan_bytes_received=moved, wan_messages=1, elements=n, entries_sent=n)
        started = time.monotonic()
        with timeline.span("WAN_EXCHANGE", bytes_sent=moved, bytes_received=moved, clusters=nclusters):
            self._cross_reduce_host(buf, op, comm, wire, small_float, n, nclusters)
            self.pacer.pace(moved, started)

    def _cross_reduce_host(self, buf, op, comm, wire, small_float, n, nclusters):
        if nclusters == 2:
            # exchange with the one peer; a OP b == b OP a bit for bit, so both sides agree
            other = self.scratch("peer", n, wire.dtype)
            peer = 1 - comm.Get_rank()
            self.deadline.wait_all([comm.Isend(mpi_view(wire), dest=peer, tag=77),
                                    comm.Irecv(mpi_view(other), source=peer, tag=77)], "cross-cluster exchange")
            if small_float:
                # round our own part the same way as the peer's, so that both sums match
                buf.copy_(wire)
            accumulate(buf, other, op)
        elif small_float:
            gathered = self.scratch("gather", nclusters * n, wire.dtype).view(nclusters, n)
            self.deadline.wait(comm.Iallgather(mpi_view(wire), mpi_view(gathered)), "cross-cluster allgather")
            buf.copy_(gathered[0])
            for c in range(1, nclusters):
                accumulate(buf, gathered[c], op)
        else:
            self.deadline.wait(comm.Iallreduce(MPI.IN_PLACE, mpi_view(buf), op=MPI_OPS[op]),
                               "cross-cluster allreduce")

    # ---------------- allgather ----------------

    def allgatherv(self, data, counts):
        """Concatenate each rank's bytes (``data`` is a uint8 tensor, ``counts[r]`` its length
        on rank r) in rank order."""
        topo, comms = self.topo, self.comms
        total = int(sum(counts))
        out = torch.empty(total, dtype=torch.uint8)
        if topo.size == 1:
            out.copy_(data)
            return out
        if topo.num_clusters == 1:
            self.deadline.wait(comms.comm.Iallgatherv(byte_view(data), [out.numpy(), counts, displacements(counts),
                                                                        MPI.BYTE]), "allgather")
            return out
        # 1. gather the cluster's pieces at its leader (in cluster-member order)
        members = topo.cluster_members
        my_counts = [counts[r] for r in members[topo.cluster_id]]
        block = torch.empty(sum(my_counts), dtype=torch.uint8)
        self.deadline.wait(comms.cluster.Igatherv(byte_view(data), [block.numpy(), my_counts, displacements(my_counts),
                                                                    MPI.BYTE]
                                                  if topo.cluster_rank == 0 else None, root=0), "intra-cluster gather")
        # 2. leaders exchange cluster blocks
        order = [r for m in members for r in m]
        stacked = torch.empty(total, dtype=torch.uint8)
        if topo.cluster_rank == 0:
            block_counts = [sum(counts[r] for r in m) for m in members]
            self.deadline.wait(comms.leaders.Iallgatherv(block.numpy(), [stacked.numpy(), block_counts,
                                                                         displacements(block_counts), MPI.BYTE]),
                               "cross-cluster allgather")
        # 3. leader hands the whole result to its cluster
        if topo.cluster_size > 1 and total:
            self.deadline.wait(comms.cluster.Ibcast(stacked.numpy(), root=0), "intra-cluster broadcast")
        # 4. cluster order -> rank order
        offsets, pos = {}, 0
        for r in order:
            offsets[r] = pos
            pos += counts[r]
        start = 0
        for r in range(topo.size):
            out[start:start + counts[r]] = stacked[offsets[r]:offsets[r] + counts[r]]
            start += counts[r]
        return out

    # ---------------- broadcast ----------------

    def broadcast(self, buf, root):
        """Broadcast the bytes of ``buf`` (uint8, same length everywhere) from set rank ``root``."""
        topo, comms = self.topo, self.comms
        if topo.size == 1 or buf.numel() == 0:
            return
        data = buf.numpy()
        root_cluster = topo.cluster_of_rank[root]
        if topo.num_clusters == 1:
            self.deadline.wait(comms.comm.Ibcast(data, root=root), "broadcast")
            return
        members = topo.cluster_members[root_cluster]
        if topo.cluster_id == root_cluster and len(members) > 1:
            self.deadline.wait(comms.cluster.Ibcast(data, root=members.index(root)), "intra-cluster broadcast")
        if topo.cluster_rank == 0:
            self.deadline.wait(comms.leaders.Ibcast(data, root=root_cluster), "cross-cluster broadcast")
        if topo.cluster_id != root_cluster and topo.cluster_size > 1:
            self.deadline.wait(comms.cluster.Ibcast(data, root=0), "intra-cluster broadcast")

    # ---------------- alltoall ----------------

    def alltoallv(self, data, send_rows, row_bytes):
        """Send ``send_rows[r]`` rows of ``row_bytes`` bytes each of ``data`` (uint8, in rank
        order) to each rank r. Returns (received bytes, rows received from each rank). The row
        counts cross, not the byte counts, so rows of zero bytes (a zero-size trailing
        dimension) are still counted."""
        comm = self.comms.comm
        sr = np.asarray(send_rows, dtype=np.int64)
        rr = np.empty_like(sr)
        self.deadline.wait(comm.Ialltoall(sr, rr), "alltoall (splits)")
        sc, rc = (sr * int(row_bytes)).tolist(), (rr * int(row_bytes)).tolist()
        out = torch.empty(int(sum(rc)), dtype=torch.uint8)
        self.deadline.wait(comm.Ialltoallv([byte_view(data), sc, displacements(sc), MPI.BYTE],
                                           [out.numpy(), rc, displacements(rc), MPI.BYTE]),
                           "alltoall")
        return out, rr.tolist()

    def barrier(self):
        self.deadline.wait(self.comms.comm.Ibarrier(), "barrier")
