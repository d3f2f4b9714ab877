"""The two-level route of every dense collective, on flat CPU buffers.

Inside a cluster the ``intra`` backend (MPI or gloo) moves the data; across
clusters MPI does, on the communicators of ``topology.Communicators``:

* allreduce, clusters of equal size: reduce-scatter inside the cluster, each
  rank reduces its shard with the ranks owning the same shard in the other
  clusters, all-gather inside the cluster. Every rank's link to the WAN works.
* allreduce, clusters of unequal size: reduce to the cluster leader, reduce
  among leaders, broadcast inside the cluster.
* across two clusters, each rank swaps its shard with its peer and reduces
  (a OP b equals b OP a bit for bit, so both agree); with more clusters,
  16-bit floats are all-gathered and reduced in cluster order in C (16-bit
  data crosses the WAN at 16 bits, results bit-identical everywhere), other
  dtypes use MPI's allreduce.
* allgather and broadcast go leader to leader across clusters; alltoall is
  point to point by nature and goes straight over the world communicator.
"""
import time

import numpy as np
import torch
from mpi4py import MPI

from . import _native
from .intra import MPI_OPS, displacements
from .topology import split_counts
from .transport import byte_view, mpi_view, wan_pace

_C_OPS = {"sum": _native.lib.STELLA_OP_SUM, "min": _native.lib.STELLA_OP_MIN,
          "max": _native.lib.STELLA_OP_MAX, "product": _native.lib.STELLA_OP_PROD}


def compute_dtype(dtype):
    """The dtype reductions run in: 16-bit floats in float32, bool as uint8."""
    if dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    if dtype == torch.bool:
        return torch.uint8
    return dtype


def _ptr(t, ctype):
    return _native.ffi.cast(ctype, t.data_ptr())


def accumulate(acc, src, op):
    """acc = acc OP src, element-wise, in place. ``acc`` is in the compute dtype."""
    n = acc.numel()
    if n == 0:
        return
    if acc.dtype == torch.float32 and src.dtype in (torch.float32, torch.float16, torch.bfloat16):
        kernel = {torch.float32: (_native.lib.stella_accumulate_f32, "const float *"),
                  torch.float16: (_native.lib.stella_accumulate_f16, "const uint16_t *"),
                  torch.bfloat16: (_native.lib.stella_accumulate_bf16, "const uint16_t *")}[src.dtype]
        _native.check(kernel[0](_ptr(acc, "float *"), _ptr(src, kernel[1]), n, _C_OPS[op]), "accumulate")
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


class Hierarchy:
    """Dense collectives of one process set over its two levels."""

    def __init__(self, comms, intra, deadline):
        self.comms = comms
        self.topo = comms.topo
        self.intra = intra
        self.deadline = deadline
        self._scratch = {}
        self.stats = None  # WanStats, set by the runtime

    def scratch(self, slot, n, dtype):
        """A reusable buffer of ``n`` elements (fresh allocations of large buffers cost page
        faults on every call). Only the engine thread uses it, one op at a time; callers
        never hand it out to users."""
        buf = self._scratch.get((slot, dtype))
        if buf is None or buf.numel() < n:
            buf = torch.empty(max(n, 1), dtype=dtype)
            self._scratch[(slot, dtype)] = buf
        return buf[:n]

    # ---------------- allreduce ----------------

    def allreduce(self, buf, op, wire_dtype=None):
        """Reduce ``buf`` (flat, compute dtype) over all ranks, in place.

        ``wire_dtype`` (float16/bfloat16) is the dtype that crosses the WAN."""
        topo = self.topo
        if topo.size == 1:
            return
        if topo.num_clusters == 1:
            self.intra.allreduce(buf, op)
            return
        if topo.cluster_size == 1:
            self._cross_reduce(buf, op, self.comms.shard or self.comms.leaders, wire_dtype)
            return
        if topo.uniform_clusters:
            counts = split_counts(buf.numel(), topo.cluster_size)
            shard = self.intra.reduce_scatter(buf, counts, op, self.scratch("shard", counts[topo.cluster_rank],
                                                                           buf.dtype))
            self._cross_reduce(shard, op, self.comms.shard, wire_dtype)
            self.intra.allgather_into(shard, counts, buf)
        else:
            self.intra.reduce(buf, op, root=0)
            if topo.cluster_rank == 0:
                self._cross_reduce(buf, op, self.comms.leaders, wire_dtype)
            self.intra.bcast(buf, root=0)

    def _cross_reduce(self, buf, op, comm, wire_dtype):
        nclusters = comm.Get_size()
        n = buf.numel()
        if nclusters == 1 or n == 0:
            return
        small_float = wire_dtype in (torch.float16, torch.bfloat16)
        if small_float:
            wire = self.scratch("wire", n, wire_dtype)
            wire.copy_(buf)
        else:
            wire = buf
        item = wire.element_size()
        if nclusters == 2 or small_float:
            moved = n * item * (nclusters - 1)
        else:
            moved = 2 * n * item * (nclusters - 1) // nclusters  # ring allreduce volume
        if self.stats is not None:
            self.stats.add(wan_bytes_sent=moved, wan_bytes_received=moved, wan_messages=1, elements=n, entries_sent=n)
        started = time.monotonic()
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
        wan_pace(moved, started)

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
            self.deadline.wait(comms.comm.Iallgatherv(byte_view(data), [out.numpy(), counts, displacements(counts), MPI.BYTE]),
                               "allgather")
            return out
        # 1. gather the cluster's pieces at its leader (in cluster-member order)
        members = topo.cluster_members
        my_counts = [counts[r] for r in members[topo.cluster_id]]
        block = torch.empty(sum(my_counts), dtype=torch.uint8)
        self.deadline.wait(comms.cluster.Igatherv(byte_view(data), [block.numpy(), my_counts, displacements(my_counts), MPI.BYTE]
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
        """Broadcast the bytes of ``buf`` (uint8, same length everywhere) from world rank ``root``."""
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

    def alltoallv(self, data, send_counts):
        """Send ``send_counts[r]`` bytes of ``data`` (uint8, in rank order) to each rank r.
        Returns (received bytes, receive counts)."""
        comm = self.comms.comm
        sc = np.asarray(send_counts, dtype=np.int64)
        rc = np.empty_like(sc)
        self.deadline.wait(comm.Ialltoall(sc, rc), "alltoall (splits)")
        out = torch.empty(int(rc.sum()), dtype=torch.uint8)
        self.deadline.wait(comm.Ialltoallv([byte_view(data), sc.tolist(), displacements(sc.tolist()), MPI.BYTE],
                                           [out.numpy(), rc.tolist(), displacements(rc.tolist()), MPI.BYTE]),
                           "alltoall")
        return out, rc.tolist()

    def barrier(self):
        self.deadline.wait(self.comms.comm.Ibarrier(), "barrier")
