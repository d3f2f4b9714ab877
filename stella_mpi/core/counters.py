"""Per-step counters of the cross-cluster (WAN) traffic and of the sparse pipeline.

The collective thread adds to the current step (``engine_s``: seconds it spent executing the
step's sparse collectives and CPU-engine updates); ``DistributedOptimizer.synchronize`` (or
``hvd.stats(end_step=True)``) closes it. ``hvd.stats()`` returns the last closed step and the
totals since ``init()``.
"""
import threading

COUNTERS = ("wan_bytes_sent", "wan_bytes_received", "wan_messages", "select_s", "encode_s", "exchange_s",
            "decode_s", "merge_s", "elements", "entries_sent", "engine_s",
            "skipped_nonfinite",   # steps (or CPU-engine bucket updates) skipped for a NaN/Inf gradient
            "intra_s")   # the reductions inside the cluster, estimated (Hierarchy._intra_stage)


class WanStats:
    def __init__(self):
        self._lock = threading.Lock()
        self._current = dict.fromkeys(COUNTERS, 0)
        self._last = dict.fromkeys(COUNTERS, 0)
        self._total = dict.fromkeys(COUNTERS, 0)
        self._residual_sq = 0.0
        self._grad_sq = 0.0
        self._last_ratio = None
        self._last_norms = (0.0, 0.0)   # (residual, gradient) squared norms of the last closed step
        self._info = {}   # values that are set, not summed (the adjuster's timings and decision)
        self.steps = 0

    def add(self, **values):
        with self._lock:
            for k, v in values.items():
                self._current[k] += v

    def add_norms(self, residual_sq, grad_sq):
        with self._lock:
            self._residual_sq += residual_sq
            self._grad_sq += grad_sq

    def annotate(self, **values):
        """Set values shown in ``last_step`` from now on (until set again)."""
        with self._lock:
            self._info.update(values)

    def info(self):
        with self._lock:
            return dict(self._info)

    def end_step(self):
        with self._lock:
            for k, v in self._current.items():
                self._total[k] += v
            self._last = self._current
            self._current = dict.fromkeys(COUNTERS, 0)
            self._last_ratio = (self._residual_sq / self._grad_sq) ** 0.5 if self._grad_sq > 0 else None
            self._last_norms = (self._residual_sq, self._grad_sq)
            self._residual_sq = self._grad_sq = 0.0
            self.steps += 1

    def snapshot(self):
        with self._lock:
            last = dict(self._last)
            last["density"] = last["entries_sent"] / last["elements"] if last["elements"] else None
            last["residual_norm_ratio"] = self._last_ratio
            last["residual_sq"], last["grad_sq"] = self._last_norms
            last.update(self._info)
            out = {"steps": self.steps, "last_step": last, "total": dict(self._total)}
            return out
