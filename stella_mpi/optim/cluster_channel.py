"""The inner steps of local steps, averaged inside a cluster without asking the other clusters.

A collective submitted to the collective thread runs once a negotiation round with every rank
of the job has matched it (core/negotiation.py). For the gradients of an inner step, which only
the cluster's own ranks reduce, that round crosses the WAN: with 25 ms of one-way delay it cost
a 2x2 job 78 ms per inner step (41 -> 119 ms/step, docs/guides/local-steps.md). The channel
reduces those gradients on a duplicate of the cluster's communicator instead, from the training
thread, so an inner step waits for no rank outside its cluster.

What the negotiation gave each collective, the channel gives too:

- **Matching.** The buckets launch in bucket order on every rank (optim/buckets.py), so the
  channel's collectives pair up by order. Each rank's parameters (names, shapes, dtypes) are
  compared once, when the channel is built; ranks that differ get a :class:`TensorMismatchError`
  naming them, on every rank of the cluster.
- **Non-finite inputs.** Each buffer carries one more entry, this rank's flag (1 when its part
  holds NaN or Inf), summed with the values: every rank sees the same count and refuses alike.
  Only then is one more exchange made, to name the ranks in the error.
- **Deadlines.** Every wait is under ``STELLA_TIMEOUT``; past it the job ends, naming the ranks
  that never came (the request is still live, so its buffers must stay: nothing is returned).

Where it does not apply, a bucket takes the negotiated path as before: CUDA tensors (NCCL's
communicator belongs to the collective thread), dtypes other than floats, a bucket that holds a
torch sparse gradient, MPI without ``MPI_THREAD_MULTIPLE``, and ``STELLA_CLUSTER_CHANNEL=0``.
``hvd.join()`` cannot take part in it: a rank that joins while the other ranks of its cluster
still take inner steps would leave them waiting for its gradients. They end the job as soon as
the negotiation tells them it joined, naming it (no deadline to wait out).
"""
import hashlib
import time
import weakref

import torch
from mpi4py import MPI

from ..api.handles import synchronize
from ..base import timeline
from ..base.errors import HorovodInternalError, NonFiniteGradientError, StellaTimeoutError, TensorMismatchError
from ..comm.abort import end_job
from ..comm.buffers import mpi_view
from ..comm.deadline import end_on_timeout
from ..comm.hierarchy import compute_dtype
from ..comm.messages import allgather_json
from ..core import state
from ..core.collective_thread import Op
from ..core.fusion import scale, unfuse
from ..core.nonfinite import has_nonfinite

JOINED = ("hvd.join() is not supported with hvd.LocalSteps on clusters of several ranks: their inner steps "
          "average gradients on the cluster's own channel, which a joined rank cannot take part in. Give every rank "
          "the same number of batches (hvd.elastic.ElasticSampler, or drop_last with equal shards), or set "
          "STELLA_CLUSTER_CHANNEL=0 to reduce inner steps through the negotiation")


def layout_of(named):
    """[[name, shape, dtype, device type]] of ``named`` ([(name, parameter)]): what must be equal
    on every rank of the cluster for the buckets' collectives to pair up."""
    return [[n, list(p.shape), str(p.dtype).replace("torch.", ""), p.device.type] for n, p in named]


def _digest(layout):
    return hashlib.sha1(repr(layout).encode()).hexdigest()


def mismatch_lines(layouts, ranks):
    """The lines naming where the ranks' layouts first differ (``layouts[i]`` of world rank
    ``ranks[i]``)."""
    lines = []
    ref = layouts[0]
    for r, lay in zip(ranks[1:], layouts[1:]):
        if lay == ref:
            continue
        if len(lay) != len(ref):
            lines.append("  rank %d has %d parameters, rank %d has %d" % (ranks[0], len(ref), r, len(lay)))
            continue
        for a, b in zip(ref, lay):
            if a != b:
                lines.append("  rank %d: %s %s %s on %s; rank %d: %s %s %s on %s"
                             % (ranks[0], a[0], tuple(a[1]), a[2], a[3], r, b[0], tuple(b[1]), b[2], b[3]))
                break
    return lines


class ClusterChannel:
    """The communicator of the inner steps' reductions on this rank's cluster (``pset``: the
    cluster's process set, of more than one rank): one per runtime and cluster, duplicated the
    first time an optimizer asks (:meth:`shared`), freed at ``hvd.shutdown()``. Each optimizer
    reduces through its own :class:`ClusterLane` (:meth:`lane`)."""

    def __init__(self, pset):
        self.pset = pset
        self.size = pset.size()
        self.members = list(pset.ranks)   # world ranks, in the cluster communicator's order
        self.deadline = pset.deadline
        self.lanes = 0                    # lanes opened so far: the next one's number (the same on every rank)
        self.closed = False
        name = "cluster_channel"

        def dup(ps, desc, inputs, joined):   # on the collective thread: no other collective of ps runs
            with ps.deadline.guard("duplicating the communicator of the cluster's channel"):
                return ps.comms.comm.Dup()

        rt = state.current("hvd.LocalSteps")
        self.comm = synchronize(rt.collective_thread.submit(
            Op("cluster_channel", name, {"kind": "cluster_channel", "name": name}, (), dup, pset)))
        rt.closers.append(self.close)
        self.thread = rt.collective_thread
        self.rank = rt.rank

    @classmethod
    def shared(cls, pset):
        """This runtime's channel of ``pset`` (built collectively by the cluster's ranks the first
        time, at the same point of their programs: an optimizer's construction)."""
        rt = state.current("hvd.LocalSteps")
        channel = _SHARED.get(rt)
        if channel is None or channel.closed or channel.pset is not pset:
            channel = _SHARED[rt] = cls(pset)
        return channel

    def lane(self, named, buckets):
        """A new :class:`ClusterLane` for an optimizer's parameters ``named`` ([(name,
        parameter)]) cut into ``buckets`` (lists of parameters). Collective over the cluster:
        the ranks compare their parameters and buckets once, and ranks that differ raise
        :class:`TensorMismatchError` on every rank of the cluster, naming them."""
        if self.closed:
            raise HorovodInternalError("hvd.LocalSteps: the runtime this optimizer was built on has shut down")
        names = {id(p): n for n, p in named}
        layout = layout_of(named)
        plan = [[names.get(id(p), "?") for p in b] for b in buckets]
        mine = _digest([layout, plan])
        what = "the parameter check of the cluster's channel"
        try:
            digests = allgather_json(self.comm, mine, self.deadline, what)
            if len(set(digests)) > 1:
                both = allgather_json(self.comm, [layout, plan], self.deadline, what)
        except StellaTimeoutError as e:
            end_on_timeout(e)
        if len(set(digests)) > 1:
            lines = mismatch_lines([b[0] for b in both], self.members) or \
                ["  the same parameters, cut into different buckets (STELLA_FUSION_THRESHOLD, num_groups or groups "
                 "differ): rank %d %s; %s" % (self.members[0], [len(b) for b in both[0][1]], "; ".join(
                     "rank %d %s" % (r, [len(b) for b in x[1]]) for r, x in zip(self.members[1:], both[1:])))]
            raise TensorMismatchError(
                "hvd.DistributedOptimizer (local steps): the ranks of cluster %s hold different parameters or "
                "buckets, so their inner steps' gradients would not pair up:\n%s\nBuild the same model and "
                "optimizer on every rank." % (self.pset.topology.cluster_id if self.pset.topology else "?",
                                              "\n".join(lines)))
        self.lanes += 1
        return ClusterLane(self, self.lanes)

    def close(self):
        """At hvd.shutdown(): free the communicator (nothing is in flight: every bucket's
        reduction is waited for by the step that launched it)."""
        self.closed = True
        if self.comm is not None:
            self.comm.Free()
            self.comm = None

    def wait(self, req, what):
        """Wait for ``req`` under the deadline, watching for a rank of the cluster that joined.
        A timeout ends the job: the request is still live (its buffers must stay)."""
        try:
            self.deadline.wait(req, what, watch=lambda: self._watch(what))
        except StellaTimeoutError as e:
            end_on_timeout(e)

    def _watch(self, what):
        """While a reduction waits: a rank of this cluster that has joined (``hvd.join()``, as
        the negotiation agreed) will never come, so the job ends now, naming it."""
        negotiator = self.thread.negotiator
        if negotiator is None:
            return
        gone = [r for r in negotiator.joined if r in self.members and r != self.rank]
        if gone:
            end_job("stella_mpi: rank %d: %s: rank%s %s of this cluster called hvd.join(). %s"
                    % (self.rank, what, "s" if len(gone) > 1 else "", ", ".join(map(str, gone)), JOINED))

    @staticmethod
    def usable(pset):
        """Whether a channel can serve ``pset`` (this rank's cluster): more than one rank, MPI
        with THREAD_MULTIPLE, not turned off. The same answer on every rank of the cluster."""
        rt = state.current("hvd.LocalSteps")
        return (pset.size() > 1 and rt.config.cluster_channel
                and MPI.Query_thread() >= MPI.THREAD_MULTIPLE)

    @staticmethod
    def takes(tensors):
        """Whether the channel reduces these tensors (dense, on the CPU, one float dtype): the
        same answer on every rank whose parameters agree."""
        if not tensors:
            return False
        t0 = tensors[0]
        return (t0.device.type == "cpu" and compute_dtype(t0.dtype) in (torch.float32, torch.float64)
                and all(t.device.type == "cpu" and t.dtype == t0.dtype and not t.is_sparse for t in tensors))


_SHARED = weakref.WeakKeyDictionary()   # runtime -> its ClusterChannel


class ClusterLane:
    """One optimizer's reductions on the cluster's channel: its send buffers (one per bucket,
    reused from step to step) and the identity each buffer carries. Besides the non-finite flag,
    every buffer carries this lane's number and the bucket's index, summed with the values: a
    rank whose buffer pairs with another optimizer's or another bucket's (a gradient sparse on
    one rank and dense on another sends the bucket elsewhere) is caught there, not summed."""

    def __init__(self, channel, number):
        self.channel = channel
        self.number = number
        self.buffers = {}     # bucket index -> the reused send buffer
        self.reductions = 0   # collectives this lane ran (what the tests count)

    def _buffer(self, key, n, dtype):
        buf = self.buffers.get(key)
        if buf is None or buf.numel() != n + _EXTRA or buf.dtype != dtype:
            buf = self.buffers[key] = torch.empty(n + _EXTRA, dtype=dtype)
        return buf

    def allreduce(self, tensors, name, average, prescale, postscale, index):
        """Start the sum (or mean, ``average``) of ``tensors`` over the cluster, written back into
        them, with the executor's scaling (prescale, sum, postscale / size). Returns the handle:
        a function that ``synchronize`` calls, which waits and returns ``tensors``. ``index``:
        the bucket's."""
        ch = self.channel
        if ch.closed:
            raise HorovodInternalError("hvd.LocalSteps: the runtime this optimizer was built on has shut down")
        cdt = compute_dtype(tensors[0].dtype)
        n = sum(t.numel() for t in tensors)
        buf = self._buffer(index, n, cdt)
        pos = 0
        for t in tensors:
            buf[pos:pos + t.numel()].copy_(t.reshape(-1))
            pos += t.numel()
        body = buf[:n]
        bad = state.current().config.nonfinite != "off" and has_nonfinite([body])
        buf[n] = 1.0 if bad else 0.0
        buf[n + 1] = float(self.number)
        buf[n + 2] = float(index + 1)
        if prescale != 1.0:
            scale(body, prescale)
        start = time.perf_counter()
        req = ch.comm.Iallreduce(MPI.IN_PLACE, mpi_view(buf), op=MPI.SUM)
        self.reductions += 1

        def reduced():
            what = "the cluster's allreduce %r (local steps' inner step)" % name
            ch.wait(req, what)
            with timeline.op_scope(name):
                timeline.record("CLUSTER_ALLREDUCE", start, time.perf_counter(), ranks=ch.size)
            if float(buf[n + 1]) != ch.size * self.number or float(buf[n + 2]) != ch.size * (index + 1):
                end_job("stella_mpi: rank %d: %s paired with another collective on a rank of its cluster (this "
                        "rank: optimizer %d, bucket %d, %d entries): its ranks' gradients differ in which "
                        "parameters are sparse or which optimizers step. Pass sparse_as_dense=True, or set "
                        "STELLA_CLUSTER_CHANNEL=0 to reduce inner steps through the negotiation, which matches "
                        "them by name" % (ch.rank, what, self.number, index, n))
            if float(buf[n]) != 0.0:
                raise NonFiniteGradientError(
                    "a non-finite gradient (NaN or Inf) on rank %s in the cluster's allreduce %r; refused on every "
                    "rank of the cluster" % (self._flagged(bad, what), name))
            factor = postscale / ch.size if average else postscale
            if factor != 1.0:
                scale(body, factor)
            unfuse(body, tensors)
            return tensors
        return reduced

    def _flagged(self, bad, what):
        """The world ranks whose part was not finite (every rank of the cluster asks, having seen
        the same count)."""
        ch = self.channel
        try:
            flags = allgather_json(ch.comm, bool(bad), ch.deadline, what + ": naming the non-finite ranks")
        except StellaTimeoutError as e:
            end_on_timeout(e)
        return ", ".join(str(r) for r, f in zip(ch.members, flags) if f)

    def any(self, flag):
        """Whether any rank of the cluster passed True (every rank calls it at the same point)."""
        ch = self.channel
        if ch.closed:
            raise HorovodInternalError("hvd.LocalSteps: the runtime this optimizer was built on has shut down")
        send = torch.tensor([1 if flag else 0], dtype=torch.int32)
        out = torch.zeros(1, dtype=torch.int32)
        what = "the end of a period agreed in the cluster"
        ch.wait(ch.comm.Iallreduce(mpi_view(send), mpi_view(out), op=MPI.MAX), what)
        self.reductions += 1
        return bool(out[0])


_EXTRA = 3   # entries after a buffer's values: the non-finite flag, the lane's number, the bucket's index + 1
