"""The adjuster's session with one optimizer: per-step telemetry of the training thread and of
the WAN exchange, its agreement over MPI, and the application of decisions at the same step on
every rank.

Timeline (K = ``Adjuster.interval``, D = 1 step for the synchronous path, 2 with staleness)::

    steps [e, e+K)   one setting, timed step by step (a window)
    end of e+K-1     this rank's row (per-step means) is all-gathered by the collective thread,
                     FIFO behind the step's own collectives: the training thread does not wait
    end of e+K-1+D   every rank reads the same rows, runs its Controller (same input, same
                     output) and applies the decision from the next step on: e' = e+K+D

The step between the gather and its reading is not timed into any window, so every window
holds one setting only. The gather also times itself: a few bytes across the WAN, so the
rank that arrived last measures the per-message latency of the link.
"""
import collections
import logging
import time

import numpy as np

from .._native import thc as thc_kernels
from ..api.handles import synchronize
from ..base import timeline
from ..base.errors import HorovodInternalError
from ..comm.hierarchy import allreduce_bytes
from ..compression import THCCompressor
from ..core import state
from ..core.collective_thread import Op
from .controller import F, ROW_FIELDS, Controller, split_batch

log = logging.getLogger("stella_mpi")


def execute_gather(pset, desc, inputs, joined):
    """Collective thread: all-gather one float64 row per rank; returns (rows, seconds)."""
    (row,) = inputs
    comm = pset.comms.comm
    out = np.empty((comm.Get_size(), len(ROW_FIELDS)), dtype=np.float64)
    t0 = time.perf_counter()
    pset.deadline.wait(comm.Iallgather(row, out), "adjuster telemetry")
    seconds = time.perf_counter() - t0
    bad = np.argwhere(~np.isfinite(out) | (out < 0))
    if len(bad):
        raise HorovodInternalError("adjuster telemetry: rank %d sent an invalid %s (%r)"
                                   % (pset.ranks[int(bad[0][0])], ROW_FIELDS[int(bad[0][1])], out[tuple(bad[0])]))
    return out, seconds


KEEP_WINDOWS = 4096


def thc_wire_bytes(bits, nclusters, block_log2, n=1 << 20):
    """Bytes one rank sends per exchanged entry on a THC rung of ``bits`` bits among
    ``nclusters`` clusters, as the route counts them (thc_exchange): the summed words and the
    block scales with their flag, each an allreduce; over ``n`` entries (large: the per-bucket
    rounding of words and scales is left out)."""
    words = thc_kernels.words_for(n, thc_kernels.lane_bits(bits, nclusters))
    scales = thc_kernels.scale_count(n, block_log2) + 1
    return (allreduce_bytes(8 * words, nclusters) + allreduce_bytes(4 * scales, nclusters)) / n


def adjust_session(adjuster, compression, process_set, overlap, passes):
    """The AdjustSession of an optimizer, or None where there is nothing to adjust: no adjuster,
    a rank outside the process set, or a single cluster (no cross-cluster exchange)."""
    if adjuster is None or not process_set.included() or process_set.topology.num_clusters < 2:
        return None
    return AdjustSession(adjuster, compression, process_set, overlap, passes)


class AdjustSession:
    """One optimizer's telemetry and decisions. The optimizer calls :meth:`enter` when its
    step machinery starts (synchronize), :meth:`idle` for every wait on communication,
    :meth:`optimizer_time` for its own update, and :meth:`end_step` when the step is done."""

    def __init__(self, settings, compression, process_set, overlap, passes):
        # settings and compression were checked by DistributedOptimizer
        self.settings = settings
        self.pset = process_set
        # its gathers' names, apart from another optimizer's (the set's members count alike)
        self._name = state.current().auto_name("adjuster", process_set)
        topo = process_set.topology
        self._me = process_set.rank()
        self._where = (topo.cluster_id, topo.cluster_rank)
        self.delay = 2 if overlap else 1
        levels = settings.densities()
        start = min(levels, key=lambda d: abs(np.log(d / compression.density)))
        self.base_compression = compression   # the sparse compressor whose density the rungs set
        self.compression = compression.with_density(start)
        self.start_density = start
        # the THC rungs' compressors: thc's defaults, error feedback as the base compressor has it
        self.thc = {b: THCCompressor(bits=b, error_feedback=getattr(compression, "error_feedback", True))
                    for b in settings.thc_bits}
        thc_bytes = {b: thc_wire_bytes(b, topo.num_clusters, c.block_log2) for b, c in self.thc.items()}
        self.controller = Controller(settings, overlap=overlap, density=start, passes=passes, thc_bytes=thc_bytes)
        self.batch = None
        if settings.batch_split:
            self.controller.batch = split_batch(settings.global_batch, [1.0] * process_set.size(), None)
            self.batch = self.controller.batch[self._me]
        # (step, Decision) in order, the same on every rank; and the gathered rows with what they
        # decided (for replay in tests): the latest KEEP_WINDOWS of each, so a long run does not grow
        self.decisions = collections.deque(maxlen=KEEP_WINDOWS)
        self.trace = collections.deque(maxlen=KEEP_WINDOWS)
        self._stats = state.current().wan_stats
        self._stats.annotate(adjust_density=start, adjust_passes=passes, adjust_bits=0, adjust_reason="start",
                             adjust_step=0)
        self._sums = np.zeros(len(ROW_FIELDS))
        self._timed = 0
        self._collecting = True
        self._pending = None         # (handle of the gather, step at which to read it)
        self._latency = 0.0
        self._t_end = None
        self._t_enter = None
        self._idle = self._idle_inside = self._opt = 0.0
        self._densities = {}   # step -> density actually sent in this window (a warm-up raises it)

    # ---------------- timing, called by the optimizer ----------------

    def note_density(self, step, density):
        """The density the route sent at ``step`` when it was not the controller's (the density
        warm-up's floor; noted once per bucket): the window's row carries the mean, so the
        payload per unit density is measured right."""
        if self._collecting:
            self._densities[step] = float(density)

    def enter(self):
        self._t_enter = time.perf_counter()

    def idle(self, seconds):
        self._idle += seconds
        if self._t_enter is not None:
            self._idle_inside += seconds

    def exclude(self, seconds):
        """Leave ``seconds`` spent outside training (an evaluation) out of the next step's time."""
        if self._t_end is not None:
            self._t_end += seconds

    def resume(self):
        """The optimizer comes back from a pause (local steps: optim/tuning.py's ModeSwitch): the next
        step starts a new window, untimed (its start is unknown). A gather still in flight (a
        mode taken from a checkpoint mid-window: every rank submitted it) is completed and dropped."""
        if self._pending is not None:
            synchronize(self._pending[0])
            self._pending = None
        self._t_end = self._t_enter = None
        self._idle = self._idle_inside = self._opt = 0.0
        self._sums[:] = 0.0
        self._timed = 0
        self._densities = {}
        self._collecting = True

    def optimizer_time(self, seconds):
        self._opt += seconds

    def end_step(self, step, passes):
        """Step ``step - 1`` is done (``step`` steps completed). Returns the Decision that
        takes effect from the next step, or None."""
        now = time.perf_counter()
        c = self.controller
        self._stats.annotate(adjust_density=c.density, adjust_passes=c.passes, adjust_bits=c.bits)   # this step's
        if self._t_end is not None and self._collecting:
            step_s = max(now - self._t_end, 0.0)   # (a caller may exclude more than the step took)
            inside = now - self._t_enter if self._t_enter is not None else 0.0
            idle_outside = self._idle - self._idle_inside
            compute = max(step_s - inside - idle_outside, 0.0)
            self._add(step_s, compute, passes)
        self._t_end, self._t_enter = now, None
        self._idle = self._idle_inside = self._opt = 0.0
        if self._collecting and self._timed >= self.settings.interval:
            self._submit(step)
        if self._pending is not None and step >= self._pending[1]:
            return self._read(step)
        return None

    def _add(self, step_s, compute, passes):
        last = self._stats.snapshot()["last_step"]
        row = dict.fromkeys(ROW_FIELDS, 0.0)
        row.update(step_s=step_s, compute_s=compute, idle_s=self._idle, optimizer_s=self._opt,
                   cpu_s=last["select_s"] + last["encode_s"] + last["decode_s"] + last["merge_s"],
                   exchange_s=last["exchange_s"], engine_s=last.get("engine_s", 0.0),
                   wan_bytes=max(last["wan_bytes_sent"], last["wan_bytes_received"]),
                   wan_messages=last["wan_messages"], residual_sq=last["residual_sq"], grad_sq=last["grad_sq"],
                   elements=last["elements"], intra_s=last["intra_s"])
        values = np.array([row[k] for k in ROW_FIELDS], dtype=np.float64)
        values[~np.isfinite(values)] = 0.0   # a NaN gradient's norm must not end the job at the gather
        self._sums += values
        self._timed += 1
        self._stats.annotate(step_s=step_s, compute_s=compute, idle_s=self._idle, optimizer_s=self._opt,
                             backward_passes=passes)

    def _submit(self, step):
        row = self._sums / self._timed
        c = self.controller
        sent = list(self._densities.values()) + [c.density] * max(0, self._timed - len(self._densities))
        fixed = {"steps": self._timed, "latency_s": self._latency, "batch": self.batch or 0,
                 "density": sum(sent) / len(sent) if self._densities else c.density,
                 "passes": c.passes, "cluster": self._where[0], "group": self._where[1], "bits": c.bits}
        for k, v in fixed.items():
            row[F[k]] = v
        name = "%s.telemetry.%d" % (self._name, step)
        desc = {"kind": "adjust_telemetry", "name": name, "fields": len(ROW_FIELDS), "step": int(step)}
        handle = state.current().collective_thread.submit(Op("adjust_telemetry", name, desc, (row,),
                                                             execute_gather, self.pset))
        self._pending = (handle, step + self.delay)
        self._collecting = False
        self._sums[:] = 0.0
        self._timed = 0
        self._densities = {}

    def _read(self, step):
        t0 = time.perf_counter()
        rows, seconds = synchronize(self._pending[0])
        self.idle(time.perf_counter() - t0)
        self._pending = None
        self._latency = seconds
        old = (self.controller.density, self.controller.passes, self.controller.batch, self.controller.bits)
        d = self.controller.observe(rows.tolist())
        if (d.density, d.bits) != (old[0], old[3]):
            # the residuals stay: both routes keep them per tensor and shard under the same key,
            # as what is yet to be sent
            self.compression = self.thc[d.bits] if d.bits else \
                self.base_compression.with_density(d.density)
        if d.batch is not None:
            self.batch = d.batch[self._me]
        self.decisions.append((step, d))
        self.trace.append({"step": step, "rows": rows.tolist(), "decided_density": d.density,
                           "decided_passes": d.passes, "decided_bits": d.bits})
        est = d.estimate
        self._stats.annotate(adjust_reason=d.reason, adjust_next_density=d.density, adjust_next_bits=d.bits,
                             adjust_step=step if d.changed else self._stats.info().get("adjust_step", 0),
                             wan_bandwidth_bps=est.wan_bandwidth_bps if est else None,
                             wan_latency_s=est.latency_s if est else None,
                             local_batch=self.batch)
        timeline.instant("ADJUSTER", step=step, density=d.density, previous_density=old[0], bits=d.bits,
                         passes=d.passes, changed=bool(d.changed), reason=d.reason,
                         wan_bandwidth_bps=est.wan_bandwidth_bps if est else None)
        if d.changed:
            log.log(logging.INFO if self._me == 0 else logging.DEBUG,
                    "adjuster: from step %d %s -> %s, backward passes %d -> %d%s: %s", step,
                    _rung_name(old[0], old[3]), _rung_name(d.density, d.bits), old[1], d.passes,
                    (", batch %s" % list(d.batch)) if d.batch != old[2] else "", d.reason)
        self._collecting = True
        return d


def _rung_name(density, bits):
    return "thc %d bits" % bits if bits else "density %g" % density


class AdjustedOptimizer:
    """What both DistributedOptimizers show of their session (``self._adjust``: an
    :class:`AdjustSession` or None)."""
    _adjust = None

    def local_batch_size(self):
        """Samples per backward pass for this rank: the adjuster's batch split
        (``hvd.Adjuster(batch_split=True, global_batch=N)``), or None without one."""
        return self._adjust.batch if self._adjust is not None else None

    def exclude_time(self, seconds):
        """Leave ``seconds`` the training loop spent outside training (an evaluation, a
        checkpoint) out of the adjuster's timing of the next step (no-op without an adjuster)."""
        if self._adjust is not None:
            self._adjust.exclude(seconds)

    @property
    def adjust_decisions(self):
        """[(step, Decision)] taken by the adjuster so far (the same list on every rank)."""
        return list(self._adjust.decisions) if self._adjust is not None else []
