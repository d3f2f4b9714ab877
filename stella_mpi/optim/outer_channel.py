"""The overlapped outer exchange of local steps (``hvd.LocalSteps(overlap=True)``): its own
communicator and the one exchange in flight (optim/outer_sync.py applies it one period late)."""
import time

import torch
from mpi4py import MPI

from ..api.allgather import allgather
from ..api.broadcast import broadcast
from ..api.handles import synchronize
from ..base.errors import StellaTimeoutError
from ..comm.buffers import mpi_view, split_counts
from ..comm.deadline import end_on_timeout
from ..comm.hierarchy import allreduce_bytes
from ..core import state
from ..core.collective_thread import Op
from ..core.process_sets import global_process_set
from .clusters import cluster_process_set


class OuterChannel:
    """The overlapped exchange's own communicator and the one exchange in flight.

    Uniform clusters: rank i of every cluster owns shard i of the flat pseudo-gradient and
    allreduces it (weighted by cluster size) with the owners of shard i in the other clusters;
    the mean is then all-gathered inside the cluster. Clusters of unequal size: the cluster
    leaders allreduce the whole buffer and broadcast it inside their cluster."""

    def __init__(self, name):
        self.name = name
        self.pset = global_process_set
        topo = self.pset.topology
        self.uniform = topo.uniform_clusters
        self.weight = topo.cluster_size / self.pset.size()
        self.pending = None
        self.launched = self.arrived = self.last = None   # perf_counter times, for the adjuster
        self.closed = False
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise ValueError("hvd.LocalSteps(overlap=True) waits on MPI from the training thread while the collective "
                             "thread runs: it needs MPI_THREAD_MULTIPLE (MPI was initialized with less)")

        def dup(pset, desc, inputs, joined):   # on the collective thread: no other collective runs
            comms = pset.comms
            base = comms.shard if self.uniform else comms.leaders
            if base is None or base == MPI.COMM_NULL:
                return None
            with pset.deadline.guard("duplicating the communicator of %s" % name):
                return base.Dup()

        rt = state.current("hvd.LocalSteps(overlap=True)")
        self.comm = synchronize(rt.collective_thread.submit(
            Op("local_steps_channel", name + ".channel", {"kind": "local_steps_channel", "name": name + ".channel"},
               (), dup, self.pset)))
        rt.closers.append(self.close)

    def close(self):
        """At hvd.shutdown(): complete the exchange in flight and free the communicator."""
        self.closed = True
        try:
            self.drop()
        finally:
            if self.comm is not None:
                self.comm.Free()
                self.comm = None

    def launch(self, delta):
        """Start the exchange of the flat pseudo-gradient ``delta`` (kept until :meth:`wait`).

        Each rank's part travels with one more entry, its flag: 1 where the part is not finite
        (the part itself is then sent as zeros, so no NaN or Inf crosses), else 0. The flags are
        summed with the values; after the gather every rank holds every part's flag, so every
        rank refuses, or takes, the same exchange (no extra round trip)."""
        if self.closed:
            raise RuntimeError("hvd.LocalSteps(overlap=True): the runtime this optimizer was built on has shut down")
        topo = self.pset.topology
        if self.uniform:
            counts = split_counts(delta.numel(), topo.cluster_size)
            start = sum(counts[:topo.cluster_rank])
            part = delta[start:start + counts[topo.cluster_rank]]
        else:
            counts = None
            part = delta
        send = torch.empty(part.numel() + 1, dtype=part.dtype)
        bad = self.pset.nonfinite_policy != "off" and not bool(torch.isfinite(part).all())
        if bad:
            send[:-1].zero_()
        else:
            torch.mul(part, self.weight, out=send[:-1])
        send[-1] = 1.0 if bad else 0.0
        recv = torch.empty_like(send)
        req = None
        if self.comm is not None:
            req = self.comm.Iallreduce(mpi_view(send), mpi_view(recv), op=MPI.SUM)
        pacer = self.pset.hierarchy.pacer
        nclusters = topo.num_clusters
        moved = allreduce_bytes(send.numel() * send.element_size(), nclusters)
        # with user-space WAN emulation the result counts as arrived once the link could carry it
        ready_at = time.monotonic() + (moved * 8 / pacer.bps + pacer.delay_s if pacer.bps > 0 else 0.0)
        if self.comm is not None:
            self.pset.hierarchy.stats.add(wan_bytes_sent=moved, wan_bytes_received=moved, wan_messages=1)
        self.pending = (req, send, recv, counts, delta, ready_at)
        self.launched, self.arrived = time.perf_counter(), None

    def poll(self):
        """Note when the exchange in flight has arrived (checked once per local step: the
        adjuster's measure of its wire time). Touches no other rank."""
        if self.pending is not None and self.arrived is None:
            req, ready_at = self.pending[0], self.pending[5]
            if (req is None or req.Test()) and time.monotonic() >= ready_at:
                self.arrived = time.perf_counter()

    def _complete(self, req):
        """Wait for ``req`` under the deadline. A timeout ends the job, as the collective thread's
        do: the request is still live (its buffers must stay), and the other ranks wait on it."""
        if req is not None:
            try:
                self.pset.deadline.wait(req, "overlapped outer exchange of local steps (%s)" % self.name)
            except StellaTimeoutError as e:
                end_on_timeout(e)

    def wait(self):
        """(the mean pseudo-gradient of the exchange in flight, flat, on every rank; the delta
        this rank sent; None, or why the exchange is refused on every rank: some rank's part was
        not finite). Collective inside each cluster (the gather or broadcast)."""
        req, send, recv, counts, delta, ready_at = self.pending
        self._complete(req)
        self.pending = None
        left = ready_at - time.monotonic()
        if left > 0:
            time.sleep(left)
        if self.arrived is None:
            self.arrived = time.perf_counter()
        self.last = (self.launched, self.arrived)   # the exchange now applied: (launched, arrived)
        topo = self.pset.topology
        cluster = cluster_process_set()
        if topo.cluster_size == 1:
            whole = recv
        elif self.uniform:
            whole = allgather(recv, name=self.name + ".gather", process_set=cluster)
        else:
            leader = global_process_set.ranks[topo.cluster_members[topo.cluster_id][0]]
            whole = broadcast(recv, root_rank=leader, name=self.name + ".bcast", process_set=cluster)
        parts = [whole] if counts is None or topo.cluster_size == 1 else \
            list(torch.split(whole, [c + 1 for c in counts]))
        flagged = [i for i, part in enumerate(parts) if float(part[-1]) != 0.0]
        avg = torch.cat([part[:-1] for part in parts]) if len(parts) > 1 else parts[0][:-1]
        if flagged:
            why = ("a pseudo-gradient that is not finite on some rank (found in part%s %s of the overlapped exchange "
                   "%s)" % ("s" if len(flagged) > 1 else "", ", ".join(map(str, flagged)), self.name))
            return avg, delta, why
        return avg, delta, None

    def drop(self):
        """Complete the exchange in flight and forget it (its period's progress goes into the
        next exchange). Touches no other rank: the exchange was launched everywhere."""
        if self.pending is not None:
            self._complete(self.pending[0])
            self.pending = None
