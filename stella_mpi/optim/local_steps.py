"""Local steps across clusters (``hvd.LocalSteps``): gradients are averaged inside each cluster
at every step, and the clusters meet only every ``every`` steps, as in post-local SGD and
Cloudless-Training (model averaging) or DiLoCo (an outer Nesterov optimizer).

Every step: the synchronous optimizer on the cluster's own process set (dense, fast link), then
the user's optimizer. Every H-th step (after the user's update):

    delta   = anchor - params                     the pseudo-gradient (identical inside a cluster)
    avg     = allreduce(delta, Average, compression)  over all ranks (so: the mean over clusters,
                                                      weighted by cluster size), through the
                                                      optimizer's ``compression``: none, fp16/bf16,
                                                      or sparse with error feedback
    "average":  params = anchor - avg             (model averaging)
    "nesterov": m = mu * m + avg
                params = anchor - outer_lr * (avg + mu * m)   (DiLoCo's outer Nesterov SGD)
    anchor  = params

``anchor`` is taken at the first ``step()`` (after the user's ``broadcast_parameters``), so every
rank starts from the same parameters and, after each outer step, holds the same parameters
again (the all-reduce's result is the same everywhere). With ``every=1``, ``outer="average"`` and
no compression this is synchronous dense training for any optimizer whose update is linear in
the gradient and its own state (SGD with momentum and weight decay): the mean over clusters of
the clusters' velocities follows the same recursion as the velocity of the mean gradient.
Optimizers with a non-linear update (Adam) keep a per-cluster state and are not equivalent, as in
DiLoCo (there, the inner optimizer is AdamW by design).

``overlap=True`` hides the exchange behind the next period's local steps and applies it one
period late. At the end of period k each rank launches the exchange of its pseudo-gradient
``delta_k = anchor - params`` and trains on; at the end of period k+1 it waits for the mean
``avg_k``, and then, the same on every rank:

    anchor' = outer(anchor, avg_k)                (the formulas above)
    params  = anchor' + (params - (anchor - delta_k))   its cluster's progress since the launch kept
    anchor  = anchor'

and launches ``delta_{k+1} = anchor - params`` (that progress). Every rank computes the same
anchor; a rank's parameters are the anchor plus its own cluster's last period, so the clusters
never hold quite the same parameters: ``opt.sync_clusters()`` completes the exchange in flight
and runs one more, blocking, after which every rank holds the anchor (call it before evaluating
or saving a model that must be the same everywhere). A checkpoint leaves the exchange in flight
out: a rank that restores its own checkpoint puts that period's progress into the next exchange,
so nothing is lost; restoring rank 0's checkpoint everywhere (Horovod's pattern) replaces the
other clusters' last one to two periods by cluster 0's: call ``sync_clusters()`` before such a
checkpoint. The exchange runs on
its own communicator (a duplicate of the shard or leader communicator, made on the collective
thread) with MPI's non-blocking allreduce, outside the collective thread, so the next period's
intra-cluster reductions do not queue behind it: each cluster's ranks send one shard each (the
pseudo-gradient is the same inside a cluster), weighted by cluster size, and all-gather the mean
inside the cluster. It takes compression none (float32; float64 parameters go as float64).

The CPU engine is refused: it keeps its master copy and optimizer state in shards spread over
the ranks of all clusters, which a cluster-local step cannot update alone.

With ``adjuster=hvd.Adjuster(objective="step_time")`` H is chosen at each exchange from the
period's compute and exchange times (with ``overlap``, also the exchange's wire time, its
arrival polled once per local step) gathered from all ranks
(adjust/local_steps_rule.py) and applies from the next period, on every rank alike.
"""
import itertools
import logging
import time
from dataclasses import dataclass

import torch
from mpi4py import MPI

from ..adjust.local_steps_rule import LocalStepsRule, period_times
from ..api.allgather import allgather
from ..api.allreduce import compressed_allreduce_async, grouped_allreduce_async
from ..api.broadcast import broadcast
from ..api.functions import broadcast_object
from ..api.handles import synchronize
from ..api.queries import rank
from ..api.reduce_ops import Average
from ..base import timeline
from ..base.errors import StellaTimeoutError
from ..comm.buffers import mpi_view, split_counts
from ..comm.deadline import end_on_timeout
from ..comm.hierarchy import allreduce_bytes
from ..core import state
from ..core.collective_thread import Op
from ..core.process_sets import ProcessSet, global_process_set

log = logging.getLogger("stella_mpi")
OUTERS = ("average", "nesterov")
_instances = itertools.count()   # names each optimizer's exchange (ranks build optimizers in the same order)


@dataclass(frozen=True)
class LocalSteps:
    """What the user asks for (public name ``hvd.LocalSteps``), passed as
    ``DistributedOptimizer(..., local_steps=hvd.LocalSteps(every=H))``.

    every: local steps between two cross-cluster exchanges (H >= 1).
    outer: "average" (model averaging: ``outer_lr`` and ``outer_momentum`` are not used) or
        "nesterov" (DiLoCo: Nesterov SGD on the averaged pseudo-gradient).
    outer_lr, outer_momentum: the outer optimizer's (DiLoCo uses 0.7 and 0.9).
    overlap: hide each exchange behind the next period's local steps and apply it one period
        late (see the module's documentation; compression none only).
    compression: the pseudo-gradient's (an ``hvd.Compression``); None: the optimizer's
        ``compression``. Set it when the adjuster switches modes
        (``hvd.Adjuster(modes=("sync", "local"))``): the optimizer's compression is then the
        synchronous route's.
    """
    every: int
    outer: str = "average"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    overlap: bool = False
    compression: object = None

    def __post_init__(self):
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError("LocalSteps: every must be an int >= 1 (local steps per exchange), got %r"
                             % (self.every,))
        if self.outer not in OUTERS:
            raise ValueError("LocalSteps: outer must be one of %s, got %r" % (", ".join(OUTERS), self.outer))
        if not (isinstance(self.outer_lr, (int, float)) and self.outer_lr > 0):
            raise ValueError("LocalSteps: outer_lr must be > 0, got %r" % (self.outer_lr,))
        if not (isinstance(self.outer_momentum, (int, float)) and 0 <= self.outer_momentum < 1):
            raise ValueError("LocalSteps: outer_momentum must be in [0, 1), got %r" % (self.outer_momentum,))
        if not isinstance(self.overlap, bool):
            raise ValueError("LocalSteps: overlap must be True or False, got %r" % (self.overlap,))
        if self.compression is not None and not callable(getattr(self.compression, "compress", None)):
            raise ValueError("LocalSteps: compression must be an hvd.Compression, got %r" % (self.compression,))


class LocalStepsState:
    """The outer algorithm's state, one per optimizer: the settings, the anchor (parameters at
    the last exchange) and the outer momentum, keyed by parameter name; ``state_dict`` and
    ``load_state_dict`` for checkpoints."""

    def __init__(self, settings):
        self.settings = settings
        # progress
        self.every = settings.every   # H now (the adjuster may change it at an exchange)
        self.local_steps = 0      # steps since the last exchange
        self.exchanges = 0        # exchanges done
        # per parameter (by name)
        self.anchor = {}
        self.momentum = {}

    def capture(self, named):
        self.anchor = {n: p.detach().clone() for n, p in named}

    def state_dict(self):
        return {"every": self.every, "local_steps": self.local_steps, "exchanges": self.exchanges,
                "anchor": {n: t.clone() for n, t in self.anchor.items()},
                "momentum": {n: t.clone() for n, t in self.momentum.items()}}

    @staticmethod
    def check(sd, named):
        """Raise ValueError, naming what is wrong, unless ``sd`` fits the parameters ``named``."""
        params = dict(named)
        for what in ("anchor", "momentum"):
            unknown = sorted(set(sd[what]) - set(params))
            if unknown or (what == "anchor" and sd[what] and set(sd[what]) != set(params)):
                raise ValueError("LocalSteps state: %s names %s, the optimizer's parameters are %s"
                                 % (what, unknown or sorted(sd[what]), sorted(params)))

    def state_dict_on_host(self):
        """The state with its tensors on the CPU (to send to ranks whose devices differ)."""
        sd = self.state_dict()
        for what in ("anchor", "momentum"):
            sd[what] = {n: t.cpu() for n, t in sd[what].items()}
        return sd

    def load_state_dict(self, sd, named):
        """Load ``sd`` for the parameters ``named`` [(name, parameter)]: tensors moved to each
        parameter's device and dtype (as torch's optimizers do), names checked."""
        self.check(sd, named)
        params = dict(named)
        self.every = int(sd.get("every", self.settings.every))
        self.local_steps = int(sd["local_steps"])
        self.exchanges = int(sd["exchanges"])
        self.anchor = {n: t.detach().to(params[n].device, params[n].dtype).clone() for n, t in sd["anchor"].items()}
        self.momentum = {n: t.detach().to(params[n].device, params[n].dtype).clone()
                         for n, t in sd["momentum"].items()}


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
        """Start the exchange of the flat pseudo-gradient ``delta`` (kept until :meth:`wait`)."""
        if self.closed:
            raise RuntimeError("hvd.LocalSteps(overlap=True): the runtime this optimizer was built on has shut down")
        topo = self.pset.topology
        if self.uniform:
            counts = split_counts(delta.numel(), topo.cluster_size)
            start = sum(counts[:topo.cluster_rank])
            send = delta[start:start + counts[topo.cluster_rank]] * self.weight
        else:
            counts = None
            send = delta * self.weight
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
        """The mean pseudo-gradient of the exchange in flight (flat, on every rank), and the
        delta this rank sent. Collective inside each cluster (the gather or broadcast)."""
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
            return recv, delta
        if self.uniform:
            return allgather(recv, name=self.name + ".gather", process_set=cluster), delta
        leader = global_process_set.ranks[topo.cluster_members[topo.cluster_id][0]]
        return broadcast(recv, root_rank=leader, name=self.name + ".bcast", process_set=cluster), delta

    def drop(self):
        """Complete the exchange in flight and forget it (its period's progress goes into the
        next exchange). Touches no other rank: the exchange was launched everywhere."""
        if self.pending is not None:
            self._complete(self.pending[0])
            self.pending = None


def cluster_process_set():
    """This rank's cluster as a process set (registered once: every rank registers every
    cluster's set, in cluster order, the first time; later calls find them)."""
    rt = state.current("hvd.LocalSteps")
    topo = global_process_set.topology
    mine = None
    for c, members in enumerate(topo.cluster_members):
        ranks = sorted(global_process_set.ranks[r] for r in members)
        found = [p for p in rt.process_sets.values() if p.ranks == ranks]
        ps = found[0] if found else rt.add_process_set(ProcessSet(ranks))
        if c == topo.cluster_id:
            mine = ps
    return mine


class LocalStepsMixin:
    """What the synchronous optimizer (built on the cluster's process set) gains: the outer
    exchange every ``every`` steps. Mixed in before :class:`.synchronous._DistributedOptimizer`."""

    def _init_local_steps(self, settings, outer_compression, adjuster=None):
        self._ls = LocalStepsState(settings)
        # the adjuster's choice of H (adjust/local_steps_rule.py): the rule, the start of the
        # current period (perf_counter), the last decision's reason
        self._ls_rule = LocalStepsRule(adjuster, settings.every) if adjuster is not None else None
        self._ls_period_start = None
        self._ls_timed = False       # the current period was timed from its start (not the first one)
        self._ls_gather_s = 0.0      # the last decision's gather: part of the next exchange's cost
        self.local_steps_reason = None
        self._ls_compression = outer_compression
        self._ls_named = [(self._names[p], p) for p in self._params]
        self._ls_name = "local_steps.%d.delta" % next(_instances)
        self._ls_channel = OuterChannel(self._ls_name) if settings.overlap else None
        self._ls_in_sync = False   # overlap: every rank holds the anchor and nothing was trained since
        self._ls_measured = None

    @property
    def local_steps_every(self):
        """H now: local steps between two exchanges across clusters."""
        return self._ls.every

    def step(self, closure=None):
        if not self._ls.anchor:
            self._ls.capture(self._ls_named)    # the broadcast parameters, before the first update
        if self._ls_period_start is None:   # the first period (after a load): timed from here, not whole
            self._ls_period_start, self._ls_timed = time.perf_counter(), False
        loss = super().step(closure)
        self._ls_in_sync = False
        self._ls.local_steps += 1
        if self._ls_channel is not None:   # (also drives MPI's progress on the exchange in flight)
            self._ls_channel.poll()
        if self._ls.local_steps >= self._ls.every:
            started = time.perf_counter()
            compute_s = (started - self._ls_period_start) / self._ls.local_steps
            if self._ls_channel is not None:
                self._ls_channel.last = None
                self._overlapped_outer_step()
                if self._ls_rule is not None:
                    last = self._ls_channel.last   # None at the first boundary: nothing was in flight
                    exposed = max(0.0, last[1] - started) if last else 0.0   # the wait for the wire
                    self._choose_every(compute_s, time.perf_counter() - started - exposed,
                                       last[1] - last[0] if last else None)
            else:
                self._outer_step()
                if self._ls_rule is not None:
                    self._choose_every(compute_s, time.perf_counter() - started)
        return loss

    def exclude_time(self, seconds):
        """Leave ``seconds`` the training loop spent outside training (an evaluation, a
        checkpoint) out of this period's compute time, which the adjuster's H is chosen from
        (and out of the density adjuster's step time, where one runs)."""
        if self._ls_period_start is not None:
            self._ls_period_start += seconds
        super().exclude_time(seconds)

    def _choose_every(self, compute_s, exchange_s, wire_s=None):
        """The adjuster's H for the next period, from this period's times (seconds per local
        step; seconds the exchange blocked the step; with overlap, the seconds from the launch
        of the exchange just applied to its arrival), gathered from every rank as integer
        microseconds with its cluster (one all-gather: every rank decides from the same values),
        combined by :func:`..adjust.local_steps_rule.period_times`; the exchange includes the last
        gather's time. A period not timed from its
        start on some rank (the first one, or after a load), or with nothing in flight, decides
        nothing."""
        t0 = time.perf_counter()
        measured = self._ls_timed and (wire_s is not None or self._ls_channel is None)
        mine = torch.tensor([[round(1e6 * compute_s), round(1e6 * (exchange_s + self._ls_gather_s)),
                              round(1e6 * (wire_s or 0.0)), global_process_set.topology.cluster_id, int(measured)]],
                            dtype=torch.int64)
        rows = allgather(mine, name=self._ls_name + ".times")
        self._ls_gather_s = time.perf_counter() - t0
        self._ls_measured = None   # (compute_s, exchange_s, wire_s) the decision was taken from
        if bool((rows[:, 4] == 1).all()):
            self._ls_rule.every = self._ls.every   # (a loaded checkpoint may have set it)
            compute, exchange, wire = period_times([[1e-6 * int(r[0]), 1e-6 * int(r[1]), 1e-6 * int(r[2]), int(r[3])]
                                                    for r in rows.tolist()])
            every, reason = self._ls_rule.observe(compute, exchange, wire if self._ls_channel else None)
            self._ls_measured = (compute, exchange, wire if self._ls_channel else None)
            if every != self._ls.every:
                log.info("stella_mpi: local steps H %d -> %d (%s)", self._ls.every, every, reason)
                timeline.instant("ADJUST_LOCAL_STEPS", every=every, previous_every=self._ls.every, reason=reason)
            self._ls.every, self.local_steps_reason = every, reason
        self._ls_period_start, self._ls_timed = time.perf_counter(), True

    def _outer_update(self, name, anchor, avg):
        """The outer optimizer: the new anchor from the old one and the mean pseudo-gradient."""
        s = self._ls.settings
        if s.outer == "average":
            return anchor - avg
        m = self._ls.momentum.get(name)
        if m is None:
            m = self._ls.momentum[name] = torch.zeros_like(avg)
        m.mul_(s.outer_momentum).add_(avg)
        return anchor - s.outer_lr * (avg + s.outer_momentum * m)

    def _flat_delta(self):
        wide = any(p.dtype == torch.float64 for _, p in self._ls_named)
        dtype = torch.float64 if wide else torch.float32
        return torch.cat([(self._ls.anchor[n] - p.detach()).reshape(-1).to("cpu", dtype) for n, p in self._ls_named])

    def _apply_pending(self, no_progress=False):
        """Wait for the exchange in flight and apply it one period late (module documentation).
        ``no_progress``: nothing was trained since the launch, so the parameters become the new
        anchor exactly (the same bits on every rank)."""
        avg, sent = self._ls_channel.wait()
        offset = 0
        with torch.no_grad():
            for name, p in self._ls_named:
                n = p.numel()
                anchor = self._ls.anchor[name]
                a = avg[offset:offset + n].view_as(p).to(p.device, anchor.dtype)
                d = sent[offset:offset + n].view_as(p).to(p.device, anchor.dtype)
                offset += n
                new = self._outer_update(name, anchor, a)
                if no_progress:
                    p.copy_(new)
                else:
                    p.add_(new - anchor + d)          # = new + (p - (anchor - d))
                anchor.copy_(new)
        self._ls.exchanges += 1

    def _overlapped_outer_step(self):
        if self._ls_channel.pending is not None:
            self._apply_pending()
        self._ls_channel.launch(self._flat_delta())
        self._ls.local_steps = 0

    def sync_clusters(self):
        """Make every rank hold the same parameters now: with ``overlap``, complete the exchange
        in flight and run one more, blocking; without, run the exchange of the steps since the
        last one (if any). Collective: every rank calls it at the same step."""
        if self._ls_channel is None:
            if self._ls.local_steps:
                self._outer_step()
            return
        if not self._ls.anchor or self._ls_in_sync:
            return
        if self._ls_channel.pending is not None:
            if self._ls.local_steps == 0:   # launched at this very step: nothing trained since
                self._apply_pending(no_progress=True)
                self._ls_in_sync = True
                return
            self._apply_pending()
        self._ls_channel.launch(self._flat_delta())
        self._apply_pending(no_progress=True)
        self._ls.local_steps = 0
        self._ls_in_sync = True
        self._ls_period_start = None   # the next period starts at the next step (its first untimed)

    def consensus_parameters(self):
        """{name: tensor}: the anchor, the parameters the clusters last agreed on (the same on
        every rank; for evaluating one model without an exchange)."""
        return {n: t.clone() for n, t in self._ls.anchor.items()}

    def _outer_step(self):
        comp = self._ls_compression
        deltas = [(self._ls.anchor[name] - p.detach()).contiguous() for name, p in self._ls_named]
        if getattr(comp, "sparse", False):   # one fused buffer, one error-feedback residual per shard
            avgs = synchronize(compressed_allreduce_async(deltas, comp, self._ls_name, Average, inplace=True))
        else:
            pairs = [comp.compress(d) for d in deltas]
            out = synchronize(grouped_allreduce_async([c for c, _ in pairs], op=Average, name=self._ls_name))
            avgs = [comp.decompress(o, ctx) for o, (_, ctx) in zip(out, pairs)]
        with torch.no_grad():
            for (name, p), avg in zip(self._ls_named, avgs):
                anchor = self._ls.anchor[name]
                p.copy_(self._outer_update(name, anchor, avg.to(anchor.dtype)))
                anchor.copy_(p)
        self._ls.local_steps = 0
        self._ls.exchanges += 1
        self._ls_period_start = time.perf_counter()

    def state_dict(self):
        out = super().state_dict()
        out["stella_local_steps"] = self._ls.state_dict()
        return out

    def load_state_dict(self, state_dict):
        """Load a checkpoint: checked first (the user's optimizer's part by torch), so a refused
        one leaves this optimizer as it was, exchange in flight included."""
        state_dict = dict(state_dict)
        saved = state_dict.pop("stella_local_steps", None)
        if saved is not None:
            LocalStepsState.check(saved, self._ls_named)
        out = super().load_state_dict(state_dict)
        if self._ls_channel is not None:
            self._ls_channel.drop()   # its period's progress goes into the next exchange
        if saved is not None:
            self._ls.load_state_dict(saved, self._ls_named)
        else:   # a checkpoint without local steps: a new period starts from the loaded parameters
            self._ls = LocalStepsState(self._ls.settings)
        self._ls_after_load()
        return out

    def _ls_after_load(self):
        """After a load: without the adjuster the user's ``every`` holds (not the checkpoint's);
        the period in progress is not timed from its start."""
        if self._ls_rule is None:
            self._ls.every = self._ls.settings.every
        self._ls_period_start = None
        self._ls_in_sync = False

    def _stella_sync_state(self, root_rank):
        """broadcast_optimizer_state: ``root_rank``'s local-steps state on every rank (the
        counters decide when the clusters meet, so they must agree)."""
        if self._ls_channel is not None:
            self._ls_channel.drop()
        mine = self._ls.state_dict_on_host() if rank() == root_rank else None
        self._ls.load_state_dict(broadcast_object(mine, root_rank, name="local_steps.state"), self._ls_named)
        self._ls_after_load()
