"""The collective thread: one background thread runs every collective.

Each public operation becomes an :class:`Op` (a JSON-able description that
must agree across ranks, plus input tensors and its executor) queued to this
thread; the caller gets an integer handle (Horovod's model: ``poll``/``synchronize``).
Because only this thread talks to MPI and gloo, the training thread keeps
computing while gradients travel.

With several ranks the ops are matched by name, as in Horovod (the default,
``STELLA_NEGOTIATION=name``). The thread cycles every ``HOROVOD_CYCLE_TIME``
ms. Each cycle runs one negotiation round (:mod:`.negotiation`), then the ops
that every rank of their process set has submitted, in the agreed order.
Consecutive small allreduces of one kind are fused into one buffer, up to
``HOROVOD_FUSION_THRESHOLD`` bytes. When every rank is idle, the cycle backs
off, and a submission ends the back-off. The stall inspector runs inside the
rounds: after ``HOROVOD_STALL_CHECK_TIME_SECONDS`` it names each op that some
ranks have submitted and the ranks missing it. After
``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``, if set, or after ``STELLA_TIMEOUT``,
it ends the job.

``STELLA_NEGOTIATION=order`` keeps the older model: ops run in submission
order, each after a round that checks every rank submitted the same one.

A mismatch (the same name with another shape, dtype or op) raises the same
:class:`TensorMismatchError` on every rank and leaves the ranks in step. Any
other failure inside a collective (a deadline passed, a transport error)
leaves the ranks out of step, so it ends the job on every rank at once, with a
message naming the rank and the cause. From that moment no handle of this rank
completes as a success: the failed op, every op still queued and every later
submission raise :class:`HorovodInternalError`, and the process ends
(:func:`stella_mpi.comm.abort.end_job`), whichever thread is waiting.
"""
import hashlib
import itertools
import json
import logging
import math
import os
import queue
import threading
import time
import traceback

import numpy as np
import torch
from mpi4py import MPI

from ..base import timeline
from ..base.errors import (CollectiveRefused, HorovodInternalError, NonFiniteGradientError, StellaTimeoutError,
                           TensorMismatchError)
from ..comm import diagnosis
from ..comm.abort import end_job, record_status
from ..comm.deadline import world_ranks
from ..comm.messages import allgather_json
from .dtypes import DTYPES
from .executors import EXECUTORS, neutral_inputs
from .negotiation import JOINABLE, Negotiator, Pending, describe
from .nonfinite import has_nonfinite

log = logging.getLogger("stella_mpi")
_NEUTRAL = np.iinfo(np.int64).min
_HASH_MASK = (1 << 62) - 1
_IDLE_CAP_S = 20e-3     # the longest cycle while every rank is idle or nothing moves
_FUSIBLE_KEYS = {"kind", "name", "dtype", "shapes", "op", "prescale", "postscale", "device"}


class Op:
    __slots__ = ("kind", "name", "desc", "inputs", "execute", "pset", "handle", "finite", "ready", "submitted",
                 "accepted")

    def __init__(self, kind, name, desc, inputs, execute, pset, finite=None, ready=None):
        self.kind = kind            # "allreduce", "allgather", ...: picks the neutral input for join
        self.name = name
        self.desc = desc            # JSON-able; equal on every rank of pset
        self.inputs = inputs
        self.execute = execute      # execute(pset, desc, inputs, joined) -> result
        self.pset = pset
        self.handle = None
        self.finite = finite        # tensors that must hold no NaN/Inf on any rank (gradients), or None
        self.ready = ready          # CUDA inputs: an event of the caller's stream, waited for before they are read
        self.submitted = self.accepted = None   # time.perf_counter() of submit() and of the thread taking it


class _Done(threading.Event):
    """The event of an op's end, with the time.perf_counter() it was set at (``at``; None before)."""

    def __init__(self):
        super().__init__()
        self.at = None

    def set(self):
        self.at = time.perf_counter()
        super().set()


class Handle:
    __slots__ = ("done", "result", "error", "name", "post", "pset")

    def __init__(self, name, post=None, pset=None):
        self.done = _Done()
        self.result = None
        self.error = None
        self.name = name
        self.post = post   # run on the caller's thread by wait(): the executor's result -> what the caller gets
        self.pset = pset   # the process set it runs on


# handle ids, process-wide: a handle kept across shutdown() and init() never names another run's op
_HANDLE_IDS = itertools.count(1)


class CollectiveThread:
    """The background thread and its queue; one per runtime."""

    def __init__(self, rank, config, comm=None, deadline=None, process_set=None, missed=None):
        """``comm``, ``deadline``: the global process set's communicator and deadline (None: one
        rank, ops run in submission order); ``process_set(id)``: the registered set of that id;
        ``missed(name)``: an op this rank did not submit ran (or was refused) in one of its sets."""
        self.rank = rank
        self.config = config
        self._process_set = process_set
        self._missed = missed
        self.negotiator = None
        if comm is not None and comm.Get_size() > 1 and getattr(config, "negotiation", "order") == "name":
            # the bit vector's length must be equal everywhere: the smallest capacity wins
            cap = np.array([config.cache_capacity], dtype=np.int64)
            agreed = np.empty_like(cap)
            deadline.wait(comm.Iallreduce(cap, agreed, op=MPI.MIN), "hvd.init(): the response cache's capacity")
            self.negotiator = Negotiator(comm, deadline, int(agreed[0]), busy=lambda: not self._queue.empty())
        self.fused_ops = 0
        self._current = None
        self._queue = queue.Queue()
        self._handles = {}
        self._ids = _HANDLE_IDS
        self._lock = threading.Lock()
        self._hash_cache = {}
        self._inflight = set()
        self._last_joined = -1
        self.checks = 0
        self.check_seconds = 0.0
        loop = self._loop if self.negotiator is None else self._named_loop

        def run():   # outside autograd: ops write into the caller's tensors (parameters too, as Horovod's do)
            with torch.no_grad():
                loop()
        self._thread = threading.Thread(target=run, name="stella-collectives", daemon=True)
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
        handle = Handle(op.name, post, op.pset)
        op.handle = handle
        op.submitted = time.perf_counter()
        with self._lock:
            if op.name in self._inflight:
                raise ValueError("Requested to run a collective on a tensor named %r while another one with "
                                 "that name is still in flight; use a different name." % op.name)
            self._inflight.add(op.name)
            hid = next(self._ids)
            self._handles[hid] = handle
        self._queue.put(op)
        return hid

    def busy_with(self, pset):
        """Whether an op of ``pset`` is queued or running on this rank."""
        with self._lock:
            return any(h.pset is pset and not h.done.is_set() for h in self._handles.values())

    def known(self, hid):
        return hid in self._handles

    def poll(self, hid):
        return self._get(hid).done.is_set()

    def finished_at(self, hid):
        """The time.perf_counter() at which the op of ``hid`` ended, or None while it runs."""
        done = self._get(hid).done
        return done.at if done.is_set() else None

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
                    if op.ready is not None:
                        op.ready.synchronize()
                    nonfinite = None if op.finite is None else has_nonfinite(op.finite)
                    op.accepted = time.perf_counter()
                    joined = self._agree(op.pset, op.desc, nonfinite)
                    op.handle.result = _traced([op], op.name, lambda: op.execute(op.pset, op.desc, op.inputs, joined))
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

    # ---------------- the thread, ops matched by name ----------------

    def _named_loop(self):
        cfg = self.config
        neg = self.negotiator
        cycle = max(0.0, cfg.cycle_time_s)
        pending = {}          # key -> Pending (its op in .op), in submission order
        join_op = None
        announce = False
        stopping = False
        report_next = False
        last_report = 0.0
        wait_s = cycle
        eager = 0.0
        start = time.monotonic()
        try:
            while True:
                # wait for the next cycle; a submission starts a round one cycle time after it
                # arrives at the latest (a back-off is cut short), gathering what else comes meanwhile:
                # as in Horovod, submissions within a cycle are negotiated (and fused) together, and an
                # op never completes between two calls of the same thread that follow each other
                due = start + wait_s
                while True:
                    left = due - time.monotonic()
                    try:
                        op = self._queue.get(timeout=left) if left > 0 else self._queue.get_nowait()
                    except queue.Empty:
                        break
                    due = min(due, time.monotonic() + cycle)
                    if op is None:
                        stopping = True
                    elif op.kind == "join":
                        join_op, announce = op, True
                    else:
                        self._accept(op, pending)
                now = time.monotonic()
                oldest = min((p.since for p in pending.values()), default=now)
                limit = min(self._stall_limits())
                want_report = now - oldest > limit and now - last_report > max(0.5, limit / 2)
                if want_report:
                    last_report = now
                t0 = time.perf_counter()
                outcome = neg.round(pending, announce, stopping, want_report, report_next)
                self.checks += 1
                self.check_seconds += time.perf_counter() - t0
                tl = timeline.active()
                if tl is not None and tl.mark_cycles:
                    tl.instant("CYCLE", {"pending": len(pending), "ready": len(outcome.ready),
                                         "round_ms": round(1e3 * (time.perf_counter() - t0), 3)})
                announce = False
                report_next = outcome.wants_report
                if outcome.report is not None:
                    self._inspect(outcome.report, pending, now)
                self._run_ready(outcome.ready, pending)
                start = time.monotonic()   # the next cycle counts from the end of this one
                if outcome.join_done and join_op is not None:
                    self._finish(join_op, result=outcome.last_joined)
                    join_op = None
                if outcome.all_stopping:
                    gone = HorovodInternalError("rank %d: hvd.shutdown() on every rank before the other ranks "
                                                "submitted this collective" % self.rank)
                    for p in pending.values():
                        self._finish(p.op, error=gone)
                    if join_op is not None:
                        self._finish(join_op, error=gone)
                    return
                # the next round: at the cycle after progress; with ops of its own waiting for the
                # others, soon (the round itself waits for them), backing off from 50 us while
                # nothing moves; idle, backing off from the cycle; never later than the cap
                cap = max(cycle, _IDLE_CAP_S)
                if outcome.progress:
                    wait_s, eager = cycle, 0.0
                elif pending or join_op is not None:
                    eager = min(max(2 * eager, 5e-5), cap)
                    wait_s = eager
                else:
                    wait_s = min(max(2 * wait_s, cycle), cap)
        except BaseException as e:  # noqa: BLE001 - a failed round or collective ends the job everywhere
            op = self._current if self._current is not None else None
            self._fail_named(op, e, pending, join_op)
            end_job("", cause=self._cause(e))   # the message is out already; never returns

    def _stall_limits(self):
        cfg = self.config
        limits = [cfg.timeout_s]
        if cfg.stall_check_s > 0:
            limits.append(cfg.stall_check_s)
        if cfg.stall_shutdown_s > 0:
            limits.append(cfg.stall_shutdown_s)
        return limits

    def _accept(self, op, pending):
        key = (op.pset.process_set_id, op.name)
        op.accepted = time.perf_counter()
        if op.ready is not None:
            op.ready.synchronize()   # CUDA inputs: the kernels that write them have run
        nonfinite = False if op.finite is None else bool(has_nonfinite(op.finite))
        pending[key] = Pending(key, op.desc, op.pset.ranks, nonfinite, time.monotonic(), op)

    def _finish(self, op, result=None, error=None):
        op.handle.result = result
        op.handle.error = error
        with self._lock:
            self._inflight.discard(op.name)
        op.handle.done.set()

    def _inspect(self, report, pending, now):
        """The stall inspector: every rank has sent what it has pending. Rank 0 warns, naming
        each collective that some ranks have submitted and the ranks missing it. A rank whose own op
        has waited past STELLA_TIMEOUT (or HOROVOD_STALL_SHUTDOWN_TIME_SECONDS) ends the job."""
        cfg = self.config
        lines = self.negotiator.pending_names(report, {k: p.members for k, p in pending.items()})
        if not lines:
            return
        text = "\n".join("  %r (process set %d): submitted by rank(s) %s; missing rank(s) %s"
                         % (key[1], key[0], ", ".join(map(str, have)), ", ".join(map(str, missing)))
                         for key, have, missing in lines)
        if self.rank == 0 and cfg.stall_check_s > 0:
            log.warning("stella_mpi: stall inspector: one or more collectives were submitted by some ranks and have "
                        "waited over %g s for the others:\n%s", min(self._stall_limits()), text)
        missing_of = {key: missing for key, _, missing in lines}
        for key, p in pending.items():
            op = p.op
            if key not in missing_of:
                continue
            age = now - p.since
            setting = "STELLA_TIMEOUT" if age > cfg.timeout_s else \
                "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS" if 0 < cfg.stall_shutdown_s < age else None
            if setting is not None:
                self._current = op
                raise StellaTimeoutError("rank %d: %s did not complete within %.0f s (%s): %s never submitted it\n%s"
                                         % (self.rank, describe(op.desc), age, setting,
                                            ", ".join(diagnosis.describe_rank(m) for m in
                                                      world_ranks(self.negotiator.comm, missing_of[key])), text))

    def _fusible(self, item):
        d = item.desc
        return item.error is None and d.get("kind") == "allreduce" and set(d) == _FUSIBLE_KEYS

    def _run_ready(self, ready, pending):
        """Run the ready ops in the agreed order; consecutive fusible allreduces of one process
        set, dtype, op and scaling go as one buffer up to the fusion threshold (the same decision
        on every rank: it depends on the descriptions alone)."""
        ready = _after_first(ready)
        i = 0
        while i < len(ready):
            item = ready[i]
            group = [item]
            if self._fusible(item):
                sig = _fusion_signature(item)
                total = _nbytes(item.desc)
                while i + len(group) < len(ready):
                    nxt = ready[i + len(group)]
                    if not self._fusible(nxt) or _fusion_signature(nxt) != sig or \
                            total + _nbytes(nxt.desc) > self.config.fusion_threshold:
                        break
                    total += _nbytes(nxt.desc)
                    group.append(nxt)
            i += len(group)
            if self.rank in item.members:
                if self._missed is not None:
                    for g in group:
                        if g.key not in pending:
                            self._missed(g.key[1])
                self._run_group(group, pending)

    def _run_group(self, group, pending):
        ops = [getattr(pending.pop(item.key, None), "op", None) for item in group]
        first = group[0]
        if first.error is not None:
            if ops[0] is not None:
                self._finish(ops[0], error=first.error)
            return
        pset = ops[0].pset if ops[0] is not None else self._process_set(first.key[0])
        self._current = next((op for op in ops if op is not None), None)
        try:
            if len(group) == 1:
                op = ops[0]
                if op is None:
                    inputs, execute = neutral_inputs(first.desc)
                else:
                    inputs, execute = op.inputs, op.execute
                result = _traced([op], first.desc["name"], lambda: execute(pset, first.desc, inputs, first.joined))
                if op is not None:
                    self._finish(op, result=result)
            else:
                self._run_fused(group, ops, pset)
        except CollectiveRefused as e:
            for op in ops:
                if op is not None:
                    self._finish(op, error=e)
        # (not in a finally: a collective that fails keeps its op as the one to name; one that
        # completed is forgotten, so that a later failure of a round does not name it)
        self._current = None

    def _run_fused(self, group, ops, pset):
        """Consecutive fusible allreduces (``ops``: None where this rank joined) as one buffer."""
        first = group[0]
        tensors, outputs, shapes, spans = [], [], [], []
        for item, op in zip(group, ops):
            ins = op.inputs if op is not None else neutral_inputs(item.desc)[0]
            spans.append((len(outputs), len(outputs) + len(ins[1])))
            tensors.extend(ins[0])
            outputs.extend(ins[1])
            shapes.extend(item.desc["shapes"])
        desc = dict(first.desc, shapes=shapes, name="%s (+%d fused)" % (first.desc["name"], len(group) - 1))
        _traced(ops, desc["name"], lambda: EXECUTORS["allreduce"].run(pset, desc, (tensors, outputs), first.joined))
        self.fused_ops += len(group)
        for (a, b), op in zip(spans, ops):
            if op is not None:
                self._finish(op, result=outputs[a:b])

    def _fail_named(self, op, exc, pending, join_op):
        """The named loop's form of :meth:`_fail_everything`: the op that failed (or the round),
        every pending op and the join fail, then every queued and later submission."""
        if op is None:   # the round itself: name what this rank was negotiating
            waiting = sorted(repr(key[1]) for key in pending)
            what = "negotiation round (%s)" % ("this rank waited for %s" % ", ".join(waiting[:6]) +
                                               (" and %d more" % (len(waiting) - 6) if len(waiting) > 6 else "")
                                               if waiting else "nothing pending on this rank")
            op = Op("negotiation", "negotiation round", {"kind": what}, (), None, None)
            op.handle = Handle(op.name)
        self._fail_everything(op, exc)
        for p in pending.values():
            p.op.handle.error = self._failure
            p.op.handle.done.set()
        if join_op is not None:
            join_op.handle.error = self._failure
            join_op.handle.done.set()


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
        record_status(self._cause(exc), str(self._failure), silent=getattr(exc, "silent_ranks", None))
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
                                    "only allreduce (dense or sparse) and barrier are" % (describe(desc), joined))
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


def _traced(ops, scope, run):
    """``run()``, and with a timeline on (base/timeline.py) each op's QUEUE and NEGOTIATE phases
    and its execution (named after its kind), the route's phases inside going to ``scope``
    (the op's tensor, or the fused buffer of several). An op's row is its description's name
    (the CPU engine's bucket, whatever the step; the step goes in the event's args)."""
    tl = timeline.active()
    if tl is None:
        return run()
    start = time.perf_counter()
    for op in ops:
        if op is not None and op.submitted is not None and op.accepted is not None:
            row = op.desc.get("name") or op.name
            tl.complete(row, "QUEUE", op.submitted, op.accepted)
            tl.complete(row, "NEGOTIATE", op.accepted, start)
    try:
        with timeline.op_scope(scope):
            return run()
    finally:
        end = time.perf_counter()
        for op in ops:
            if op is not None:
                args = {"dtype": op.desc.get("dtype"), "device": op.desc.get("device"), "step": op.desc.get("step")}
                if len(ops) > 1:
                    args["fused_in"] = scope
                tl.complete(op.desc.get("name") or op.name, op.kind.upper(), start, end,
                            {k: v for k, v in args.items() if v is not None})


def _after_first(ready):
    """The ready ops, each moved behind the op its description names as ``after`` when both are
    ready in the same round (the same order on every rank: it depends on descriptions alone).

    Ops matched by name run in the negotiation's order, not in submission order. A producer
    whose ops must run in order (the CPU engine's updates of one bucket, step after step) says
    so with ``after``. If every rank submitted the earlier op first, it is ready in the same
    round as the later one or before."""
    if not any("after" in item.desc for item in ready):
        return ready
    out, placed, waiting = [], set(), list(ready)
    names = {(item.key[0], item.key[1]) for item in ready}
    while waiting:
        rest = []
        for item in waiting:
            before = item.desc.get("after")
            key = (item.key[0], before)
            if before is None or key not in names or key in placed:
                out.append(item)
                placed.add(item.key)
            else:
                rest.append(item)
        if len(rest) == len(waiting):   # a cycle of afters: keep the negotiated order
            out.extend(rest)
            break
        waiting = rest
    return out


def _fusion_signature(item):
    """What allreduces must share to go in one buffer: process set, dtype, op, scaling and device."""
    d = item.desc
    return item.key[0], d["dtype"], d["op"], d["prescale"], d["postscale"], d.get("device", "cpu")


def _nbytes(desc):
    return DTYPES[desc["dtype"]].itemsize * sum(math.prod(s) for s in desc["shapes"])
