"""Horovod's timeline: a Chrome trace (chrome://tracing, https://ui.perfetto.dev) of where each
collective's time goes, written while the job runs.

One "process" per tensor name (a ``process_name`` metadata event names it, as in Horovod), and
per op, complete events ("X", start and duration in microseconds) for its phases:

* ``QUEUE``: from the call to the collective thread taking the op;
* ``NEGOTIATE``: until every rank of its process set had submitted it (the negotiation by name);
* the op itself (``ALLREDUCE``, ``SPARSE_ALLREDUCE``, ``CPU_UPDATE``, ...), and inside it the
  phases of the two-level route: ``INTRA_REDUCE_SCATTER``, ``INTRA_ALLGATHER``,
  ``INTRA_ALLREDUCE``, ``WAN_EXCHANGE`` (dense, with its bytes); on the sparse route ``SELECT``,
  ``ENCODE``, ``WAN_EXCHANGE`` (bytes sent and received), ``DECODE``, ``MERGE``, ``SCATTER``; the
  CPU engine's ``CPU_OPTIMIZER``;
* with local steps' fragments (one row per fragment's exchange, ``<name>.f<i>.outer``), what the
  training thread spends on them at a step's end: ``OUTER_LAUNCH`` (the pseudo-gradient taken
  and submitted), ``OUTER_WAIT`` (waiting for it and its post step at the landing) and
  ``OUTER_STEP`` (the outer optimizer's step and the merge into the parameters);
* instant events ("i"): the adjuster's decisions, and with ``mark_cycles`` each negotiation cycle.

Events stream to the file through a 1 MiB buffer, so memory stays bounded however long the job;
when the file reaches its cap (``STELLA_TIMELINE_MAX_MB``, default 1024; Horovod's timelines
reached gigabytes) a last instant event says so and nothing more is written. The file is a JSON
array, closed by ``stop()``; a file cut short (the job ended) still loads in both viewers.
Rank 0 writes it, as in Horovod.

Emitters call :func:`span` and :func:`instant`, which cost one attribute read when no timeline is
on. The op a phase belongs to is the collective thread's current op (:func:`op_scope`).
"""
import json
import threading
import time
from contextlib import contextmanager

_ACTIVE = None            # the Timeline being written, or None
_LOCAL = threading.local()


class Timeline:
    """One trace file (see the module docstring)."""

    def __init__(self, path, mark_cycles=False, max_bytes=1 << 30, rank=0):
        self.path = path
        self.mark_cycles = bool(mark_cycles)
        self.max_bytes = int(max_bytes)
        self.rank = rank
        self._file = open(path, "w", buffering=1 << 20)
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        self._pids = {}
        self._written = 0
        self._first = True
        self.dropped = 0
        self.full = False
        self._write_raw("[\n")

    def _us(self, t):
        return round((t - self._t0) * 1e6, 3)

    def _write_raw(self, text):
        self._file.write(text)
        self._written += len(text)

    def _emit(self, event):
        """Append one event (the caller holds the lock)."""
        if self._file is None:
            return
        if self.full:
            self.dropped += 1
            return
        text = ("" if self._first else ",\n") + json.dumps(event, separators=(",", ":"))
        if self._written + len(text) > self.max_bytes:
            self.full = True
            self.dropped += 1
            note = {"name": "timeline cap reached (STELLA_TIMELINE_MAX_MB): later events not written",
                    "ph": "i", "s": "g", "pid": 0, "tid": 0, "ts": self._us(time.perf_counter())}
            self._write_raw(("" if self._first else ",\n") + json.dumps(note))
            self._first = False
            return
        self._first = False
        self._write_raw(text)

    def _pid(self, tensor):
        pid = self._pids.get(tensor)
        if pid is None:
            pid = len(self._pids) + 1
            self._pids[tensor] = pid
            self._emit({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": tensor}})
            self._emit({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}})
        return pid

    def complete(self, tensor, phase, start, end, args=None):
        """A phase of ``tensor`` from ``start`` to ``end`` (time.perf_counter() seconds)."""
        with self._lock:
            event = {"name": phase, "ph": "X", "pid": self._pid(tensor), "tid": 0, "ts": self._us(start),
                     "dur": round(max(end - start, 0.0) * 1e6, 3)}
            if args:
                event["args"] = args
            self._emit(event)

    def instant(self, name, args=None, tensor=None):
        """An instant event: global, or on ``tensor``'s row."""
        with self._lock:
            event = {"name": name, "ph": "i", "s": "g" if tensor is None else "p",
                     "pid": 0 if tensor is None else self._pid(tensor), "tid": 0,
                     "ts": self._us(time.perf_counter())}
            if args:
                event["args"] = args
            self._emit(event)

    def close(self):
        with self._lock:
            if self._file is None:
                return
            self._write_raw("\n]\n")
            self._file.close()
            self._file = None


def start(path, mark_cycles=False, max_bytes=1 << 30, rank=0):
    """Start writing the timeline to ``path`` (a running one is closed first)."""
    global _ACTIVE
    stop()
    _ACTIVE = Timeline(path, mark_cycles, max_bytes, rank)
    return _ACTIVE


def stop():
    """Close the timeline being written, if any."""
    global _ACTIVE
    tl, _ACTIVE = _ACTIVE, None
    if tl is not None:
        tl.close()


def active():
    return _ACTIVE


def flush():
    """Push what is buffered to the file (the job is about to end abruptly: os._exit skips buffers)."""
    tl = _ACTIVE
    if tl is not None and tl._lock.acquire(timeout=0.5):   # never wait long: the job is ending
        try:
            if tl._file is not None:
                tl._file.flush()
        finally:
            tl._lock.release()


@contextmanager
def op_scope(name):
    """Phases recorded inside belong to the op named ``name`` (the collective thread runs one op at
    a time)."""
    previous = getattr(_LOCAL, "op", None)
    _LOCAL.op = name
    try:
        yield
    finally:
        _LOCAL.op = previous


def current_op():
    return getattr(_LOCAL, "op", None)


class _Span:
    __slots__ = ("phase", "args", "start")

    def __init__(self, phase, args):
        self.phase = phase
        self.args = args

    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        tl = _ACTIVE
        if tl is not None:
            tl.complete(current_op() or "(no op)", self.phase, self.start, time.perf_counter(), self.args or None)
        return False


class _NoSpan:
    __slots__ = ()
    args = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NO_SPAN = _NoSpan()


def span(phase, **args):
    """``with span("SELECT"):`` records a phase of the current op; ``args`` (and entries added to
    the returned object's ``args`` inside the block, e.g. byte counts) go into the event."""
    if _ACTIVE is None:
        return _NO_SPAN
    return _Span(phase, dict(args))


def record(phase, start, end, **args):
    """A phase already timed (``time.perf_counter()`` seconds) of the current op."""
    tl = _ACTIVE
    if tl is not None:
        tl.complete(current_op() or "(no op)", phase, start, end, args or None)


def instant(name, tensor=None, **args):
    tl = _ACTIVE
    if tl is not None:
        tl.instant(name, args or None, tensor)
