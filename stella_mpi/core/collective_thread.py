"""The collective thread: one background thread runs every collective, in submission order.

Each public operation becomes an :class:`Op` (a JSON-able description that
must agree across ranks, plus input tensors and its executor) queued to this
thread; the caller gets an integer handle (Horovod's model: ``poll``/``synchronize``).
Because only this thread talks to MPI and gloo, the training thread keeps
computing while gradients travel.

Before an op moves any data its ranks agree on it: one all-reduce (MAX) of a
small int64 vector carrying a hash of the description. Equal hashes cost
nothing more; different hashes make every rank exchange the descriptions and
raise the same :class:`TensorMismatchError` naming the ranks and shapes, with
the ranks still in step. The same vector carries ``join`` state: a rank that
has joined answers each round with a neutral contribution built from the
active ranks' description.

Any other failure inside a collective (a deadline passed, a transport error)
leaves the ranks out of step, so it ends the job on every rank at once, with
a message naming the rank and the cause. From that moment no handle of this
rank completes as a success: the failed op, every op still queued and every
later submission raise :class:`HorovodInternalError`, and the process ends
(:func:`stella_mpi.comm.abort.end_job`), whichever thread is waiting.
"""
import hashlib
import itertools
import json
import os
import queue
import threading
import time
import traceback

import numpy as np
from mpi4py import MPI

from ..base.errors import (CollectiveRefused, HorovodInternalError, NonFiniteGradientError, StellaTimeoutError,
                           TensorMismatchError)
from ..comm.abort import end_job, record_status
from ..comm.messages import allgather_json
from .executors import neutral_inputs
from .nonfinite import has_nonfinite

_NEUTRAL = np.iinfo(np.int64).min
_HASH_MASK = (1 << 62) - 1
JOINABLE = ("allreduce", "barrier")  # as in Horovod: joined ranks contribute zeros to these


class Op:
    __slots__ = ("kind", "name", "desc", "inputs", "execute", "pset", "handle", "finite")

    def __init__(self, kind, name, desc, inputs, execute, pset, finite=None):
        self.kind = kind            # "allreduce", "allgather", ...: picks the neutral input for join
        self.name = name
        self.desc = desc            # JSON-able; equal on every rank of pset
        self.inputs = inputs
        self.execute = execute      # execute(pset, desc, inputs, joined) -> result
        self.pset = pset
        self.handle = None
        self.finite = finite        # tensors that must hold no NaN/Inf on any rank (gradients), or None


class Handle:
    __slots__ = ("done", "result", "error", "name", "post")

    def __init__(self, name, post=None):
        self.done = threading.Event()
        self.result = None
        self.error = None
        self.name = name
        self.post = post   # run on the caller's thread by wait(): the executor's result -> what the caller gets


def describe(desc):
    """One line naming a collective for error messages."""
    if desc is None:
        return "nothing (joined)"
    parts = [desc.get("kind", "?"), repr(desc.get("name", ""))]
    for key in ("dtype", "shape", "shapes", "trailing", "op", "root", "prescale", "postscale", "compressor", "step"):
        if key in desc:
            parts.append("%s=%s" % (key, desc[key]))
    return " ".join(parts)


class CollectiveThread:
    """The background thread and its queue; one per runtime."""

    def __init__(self, rank, config):
        self.rank = rank
        self.config = config
        self._queue = queue.Queue()
        self._handles = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._hash_cache = {}
        self._inflight = set()
        self._last_joined = -1
        self.checks = 0
        self.check_seconds = 0.0
        self._thread = threading.Thread(target=self._loop, name="stella-collectives", daemon=True)
        self._stopped = False
        self._failure = None   # the HorovodInternalError every handle raises after a fatal failure
        self._thread.start()

    # ---------------- caller side ----------------

    def submit(self, op, post=None):
        """Queue ``op``; returns its integer handle. ``post`` turns the executor's result into
        what :meth:`wait` returns (on the waiting thread)."""
        if self._failure is not None:
            raise HorovodInternalError(str(self._failure))
        if self._stopped:
            raise HorovodInternalError("stella_mpi has been shut down; call hvd.init() again")
        handle = Handle(op.name, post)
        op.handle = handle
        with self._lock:
            if op.name in self._inflight:
                raise ValueError("Requested to run a collective on a tensor named %r while another one with "
                                 "that name is still in flight; use a different name." % op.name)
            self._inflight.add(op.name)
            hid = next(self._ids)
            self._handles[hid] = handle
        self._queue.put(op)
        return hid

    def known(self, hid):
        return hid in self._handles

    def poll(self, hid):
        return self._get(hid).done.is_set()

    def wait(self, hid):
        handle = self._get(hid)
        # the thread enforces every network deadline; this only guards against a dead thread
        while not handle.done.wait(1.0):
            if not self._thread.is_alive():
                raise HorovodInternalError("rank %d: the stella_mpi collective thread has stopped" % self.rank)
        with self._lock:
            self._handles.pop(hid, None)
        if handle.error is self._failure and handle.error is not None:
            raise HorovodInternalError(str(handle.error))   # a fresh one per raise (several threads may wait)
        if handle.error is not None:
            raise handle.error
        return handle.post(handle.result) if handle.post is not None else handle.result

    def _get(self, hid):
        try:
            return self._handles[hid]
        except KeyError:
            raise ValueError("unknown or already synchronized handle %r" % (hid,)) from None

    def stop(self, timeout_s):
        """Let the queued ops finish and the thread end; every wait of those ops has its own
        deadline, so the thread is given that and a margin before the job is ended."""
        if self._stopped:
            return
        self._stopped = True
        self._queue.put(None)
        self._thread.join(timeout_s + 30)
        if self._thread.is_alive():
            end_job("stella_mpi: rank %d: hvd.shutdown(): the collective thread did not stop within %.0f s"
                    % (self.rank, timeout_s + 30), cause="deadline")

    # ---------------- the thread ----------------

    def _loop(self):
        while True:
            op = self._queue.get()
            if op is None:
                return
            fatal = None
            try:
                if op.kind == "join":
                    op.handle.result = self._join(op)
                else:
                    nonfinite = None if op.finite is None else has_nonfinite(op.finite)
                    joined = self._agree(op.pset, op.desc, nonfinite)
                    op.handle.result = op.execute(op.pset, op.desc, op.inputs, joined)
            except CollectiveRefused as e:
                op.handle.error = e          # raised on every rank alike: the ranks are still in step
            except BaseException as e:  # noqa: BLE001 - a failed collective ends the job everywhere
                fatal = e
                self._fail_everything(op, e)
            finally:
                with self._lock:
                    self._inflight.discard(op.name)
                op.handle.done.set()
                if fatal is not None:
                    end_job("", cause=self._cause(fatal))   # the message is out already; never returns

    def _fail_everything(self, op, exc):
        """After ``op`` failed with ``exc``: it, every queued op and every later one raise, and the
        whole story is written (and recorded for stellarun) before any waiting thread wakes up
        and reports its own exception."""
        first_line = (str(exc).splitlines() or [""])[0]
        self._failure = HorovodInternalError("rank %d: %s failed (%s: %s); the job is ending on every rank"
                                             % (self.rank, describe(op.desc), type(exc).__name__, first_line))
        op.handle.error = self._failure
        try:
            trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            os.write(2, ("stella_mpi: rank %d: %s failed: %s: %s\n%sstella_mpi: rank %d: ending the job on every "
                         "rank\n" % (self.rank, describe(op.desc), type(exc).__name__, exc, trace, self.rank)
                         ).encode(errors="replace"))
        except Exception:  # noqa: BLE001 - nothing may stop the failure from being final
            pass
        record_status(self._cause(exc), str(self._failure))
        while True:
            try:
                queued = self._queue.get_nowait()
            except queue.Empty:
                return
            if queued is not None:
                queued.handle.error = self._failure
                queued.handle.done.set()

    @staticmethod
    def _cause(exc):
        return "deadline" if isinstance(exc, StellaTimeoutError) else "collective"

    def _hash(self, desc):
        key = json.dumps(desc, sort_keys=True, separators=(",", ":"))
        h = self._hash_cache.get(key)
        if h is None:
            h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") & _HASH_MASK
            if len(self._hash_cache) > 65536:
                self._hash_cache.clear()
            self._hash_cache[key] = h
        return h

    def _round(self, pset, vec, what):
        out = np.empty(6, dtype=np.int64)
        pset.deadline.wait(pset.comms.comm.Iallreduce(vec, out, op=MPI.MAX), what)
        return out

    def _agree(self, pset, desc, nonfinite=None):
        """Check that every rank of ``pset`` runs the same collective, and (``nonfinite`` not
        None: whether this rank's gradients hold NaN/Inf) that no rank's input is non-finite.
        Returns the number of joined ranks taking part with neutral inputs.

        The round's vector (MAX over the ranks): the description's hash and its negation
        (equal hashes iff max(h) == -max(-h)), joined, active, the rank that joined last, and
        1 + the highest rank with a non-finite input (0: none)."""
        check = self.config.check_collectives
        if not check and nonfinite is None:
            return 0
        t0 = time.perf_counter()
        h = self._hash(desc) if check else 0
        res = self._round(pset, np.array([h, -h, 0, 1, -1, self.rank + 1 if nonfinite else 0], dtype=np.int64),
                          "agreement on " + describe(desc))
        self.checks += 1
        self.check_seconds += time.perf_counter() - t0
        mismatch = res[0] != -res[1]
        if res[4] >= 0:
            self._last_joined = int(res[4])
        descs = None
        if mismatch or res[2] != 0:
            descs = allgather_json(pset.comms.comm, desc, pset.deadline, "collective descriptions")
        if mismatch:
            raise self._mismatch_error(pset, descs)
        if res[5] > 0:
            raise NonFiniteGradientError("rank %d: a non-finite gradient (NaN or Inf) on rank %d in %s; refused on "
                                         "every rank" % (self.rank, res[5] - 1, describe(desc)))
        if descs is None:
            return 0
        joined = sum(1 for d in descs if d is None)
        if joined and desc["kind"] not in JOINABLE:
            raise CollectiveRefused("%s is not supported while %d rank(s) have joined (hvd.join); "
                                    "only allreduce and barrier are" % (describe(desc), joined))
        return joined

    def _mismatch_error(self, pset, descs):
        lines = ["ranks submitted different collectives at the same point:"]
        for r, d in enumerate(descs):
            lines.append("  rank %d: %s" % (pset.ranks[r], describe(d)))
        return TensorMismatchError("\n".join(lines))

    def _join(self, op):
        """This rank has no more data: serve the others' collectives with neutral inputs until
        every rank has joined. Returns the rank that joined last."""
        pset = op.pset
        first = True
        while True:
            vec = np.array([_NEUTRAL, _NEUTRAL, 1, 0, self.rank if first else -1, 0], dtype=np.int64)
            res = self._round(pset, vec, "join")
            first = False
            if res[4] >= 0:
                self._last_joined = int(res[4])
            if res[3] == 0:
                return self._last_joined
            descs = allgather_json(pset.comms.comm, None, pset.deadline, "collective descriptions")
            active = [d for d in descs if d is not None]
            if len({json.dumps(d, sort_keys=True) for d in active}) > 1:
                continue  # the active ranks disagree: they raise TensorMismatchError; nothing moves
            if res[5] > 0:
                continue  # an active rank's input is not finite: they refuse it alike; nothing moves
            desc = active[0]
            if desc["kind"] not in JOINABLE:
                continue  # the active ranks refuse it alike
            joined = sum(1 for d in descs if d is None)
            inputs, execute = neutral_inputs(desc)
            execute(pset, desc, inputs, joined)
