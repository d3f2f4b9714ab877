"""Process-wide state: the one :class:`Runtime` object that ``init()`` creates and
``shutdown()`` drops; and what ends the job when a rank goes: the ``excepthook`` (an uncaught
exception), the SIGTERM/SIGHUP handlers, and the deadline of MPI_Finalize armed at exit.

Everything a run accumulates lives in the Runtime: the settings, the world communicator,
the registered process sets, the collective thread with its handles, the cross-cluster
counters, the error-feedback residuals and step counters of ``hvd.allreduce`` with a sparse
compressor, and the counters that name unnamed collectives. After ``shutdown()`` nothing of
a run is left, and ``init()`` starts from scratch. The Horovod API reads the state through
:func:`current`, which raises Horovod's error before ``init()``.
"""
import atexit
import itertools
import logging
import os
import signal
import socket
import sys
import threading

import numpy as np
from mpi4py import MPI

from ..base import timeline
from ..base.config import Config, start_timeout_setting
from ..base.errors import NotInitializedError, StellaTimeoutError
from ..comm import diagnosis
from ..comm.abort import end_job, is_rank_process, record_status, this_rank
from ..comm.deadline import Deadline, end_on_timeout, world_ranks
from ..comm.messages import allgather_json
from ..comm.pacing import Pacer
from ..comm.process_watchdog import guard_exit
from ..comm.topology import cluster_label
from ..compression.memory import Memory
from .auto_names import AutoNames
from .collective_thread import CollectiveThread
from .counters import WanStats
from .process_sets import ProcessSet, global_process_set

log = logging.getLogger("stella_mpi")


class Runtime:
    """Everything ``init()`` creates; torn down by ``shutdown()``."""

    def __init__(self, comm, process_sets):
        # Horovod's init(process_sets="dynamic"): sets added and removed later (always possible here)
        if process_sets == "dynamic":
            process_sets = None
        if process_sets is not None and not isinstance(process_sets, (list, tuple)):
            raise ValueError("hvd.init(process_sets=...) takes a list of process sets (or rank lists), or "
                             "'dynamic', not %r" % (process_sets,))
        self.config = Config.from_env()
        logging.basicConfig()
        level = self.config.log_level.upper()
        level = level if level in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL") else "WARNING"
        log.setLevel(level)
        # the cross-cluster route (optim/tuning.py) is told by default: one line at the start and
        # one per change, on rank 0; STELLA_LOG_LEVEL=error silences it
        logging.getLogger("stella_mpi.route").setLevel("INFO" if level == "WARNING" else level)
        cfg = self.config
        if comm is None:
            comm = MPI.COMM_WORLD
        elif isinstance(comm, (list, tuple)):
            world = MPI.COMM_WORLD
            ranks = sorted(comm)
            whole = world.Get_group()
            group = whole.Incl(ranks)
            with Deadline(cfg.timeout_s, world.Get_rank(), peers=ranks).guard(
                    "hvd.init(comm=%s): creating the communicator" % ranks):
                comm = world.Create_group(group)
            group.Free()
            whole.Free()
        # every rank of the job must call init(): the duplication is where they meet
        arrival = Deadline(start_timeout_setting(), comm.Get_rank(), peers=world_ranks(comm, range(comm.Get_size())))
        self.world, request = comm.Idup()
        arrival.wait(request, "hvd.init() (every rank must call it)")
        self.rank = self.world.Get_rank()
        self.size = self.world.Get_size()
        roster = allgather_json(self.world, [socket.gethostname(), os.getpid(), MPI.COMM_WORLD.Get_rank()], arrival,
                                "hvd.init(): hosts")
        diagnosis.set_roster({e[2]: e[:2] for e in roster})
        self.wan_stats = WanStats()
        self.pacer = Pacer(cfg.wan_pace_bps, cfg.wan_pace_delay_s)
        self.sparse_memory = Memory()   # error-feedback residuals of hvd.allreduce(..., compression=sparse)
        self.sparse_steps = {}          # name -> steps taken by hvd.allreduce(..., compression=sparse)
        self.auto_names = AutoNames()   # the counters that name unnamed collectives
        self.closers = []               # called at shutdown before the communicators are freed
        global_process_set.ranks = list(range(self.size))
        self._build(global_process_set, is_global=True)
        global_process_set.process_set_id = 0
        self.process_sets = {0: global_process_set}
        self._set_ids = itertools.count(1)   # never reused: a removed set's auto-name counters stay behind
        self.collective_thread = CollectiveThread(self.rank, cfg, global_process_set.comms.comm,
                                                  global_process_set.deadline, self.process_sets.get,
                                                  self.auto_names.catch_up)
        for ps in process_sets or []:
            self.add_process_set(ps)
        if cfg.timeline:
            self.start_timeline(cfg.timeline, cfg.timeline_mark_cycles)
        topo = global_process_set.topology
        log.debug("rank %d: node %d (local %d/%d), cluster %d/%d (cluster rank %d/%d), intra backend %s",
                  self.rank, topo.node_id, topo.local_rank, topo.local_size, topo.cluster_id,
                  topo.num_clusters, topo.cluster_rank, topo.cluster_size, global_process_set.intra.name)

    def _build(self, ps, is_global):
        """A process set's clusters are those of the global set's topology: a set with fewer ranks
        on a node than STELLA_CLUSTERS asks for still knows which cluster each rank is in."""
        cfg = self.config
        if is_global:
            def label_of(node_id, lr, ls):
                return cluster_label(cfg, node_id, lr, ls)
        else:
            cluster = global_process_set.topology.cluster_id

            def label_of(node_id, lr, ls):
                return "cluster:%d" % cluster
        ps._build(self.world, cfg, label_of, is_global, self.wan_stats, self.pacer)

    def auto_name(self, prefix, process_set=None):
        """Horovod-style name for an unnamed op (core/auto_names.py)."""
        return self.auto_names.take(prefix, getattr(process_set, "process_set_id", 0) or 0)

    def add_process_set(self, ps):
        try:
            return self._add_process_set(ps)
        except StellaTimeoutError as e:   # a rank never came: the ranks are out of step
            end_on_timeout(e)

    def _add_process_set(self, ps):
        if not isinstance(ps, ProcessSet):
            ps = ProcessSet(ps)
        if ps.process_set_id is not None:
            raise ValueError("%r is already registered" % ps)
        if ps._mpi_comm is not None:
            # a communicator names its members; gather them as world ranks
            sub = ps._mpi_comm
            mine = np.array([self.rank], dtype=np.int64)
            members = np.zeros(sub.Get_size(), dtype=np.int64)
            global_process_set.deadline.wait(sub.Iallgather(mine, members), "add_process_set: the members")
            ps.ranks = sorted(members.tolist())
        existing = [p for p in self.process_sets.values() if p.ranks == ps.ranks]
        if existing:
            raise ValueError("a process set with ranks %s already exists (id %d)" % (ps.ranks, existing[0].process_set_id))
        self._build(ps, is_global=False)
        ps.process_set_id = next(self._set_ids)
        self.process_sets[ps.process_set_id] = ps
        return ps

    def remove_process_set(self, ps):
        if ps.process_set_id in (None, 0):
            raise ValueError("cannot remove %r" % ps)
        # every rank meets here, and learns whether any still has an op of the set queued or running
        # (its communicators would be freed under it): then every rank refuses alike
        busy = np.array([int(self.collective_thread.busy_with(ps))], dtype=np.int32)
        try:
            global_process_set.deadline.wait(self.world.Iallreduce(MPI.IN_PLACE, busy, op=MPI.MAX),
                                             "process set change")
        except StellaTimeoutError as e:
            end_on_timeout(e)
        if busy[0]:
            raise ValueError("hvd.remove_process_set(%r): a collective of that set is still queued or running on some "
                             "rank; synchronize its handles first" % ps)
        del self.process_sets[ps.process_set_id]
        ps._free()
        ps.process_set_id = None
        return True

    def start_timeline(self, path, mark_cycles=False):
        """Horovod's timeline (base/timeline.py): rank 0 writes ``path``; with ``{rank}`` in it,
        every rank writes its own file."""
        path = str(path)
        if "{rank}" in path:
            path = path.replace("{rank}", str(self.rank))
        elif self.rank != 0:
            return
        timeline.start(path, mark_cycles, self.config.timeline_max_bytes, self.rank)

    def stop_timeline(self):
        timeline.stop()

    def close(self):
        self.collective_thread.stop(self.config.timeout_s)
        for close in self.closers:   # (e.g. an overlapped local-steps exchange still in flight)
            try:
                close()
            except Exception as e:  # noqa: BLE001 - one closer must not keep the communicators from being freed
                log.warning("rank %d: hvd.shutdown(): %s", self.rank, e)
        timeline.stop()
        with Deadline(self.config.timeout_s, self.rank).guard("hvd.shutdown(): freeing the communicators"):
            for ps in list(self.process_sets.values()):
                ps._free()
                ps.process_set_id = None
            self.world.Free()


_runtime = None
_lock = threading.Lock()
_prev_excepthook = None
_ever = [False]      # whether this process ever called init()


def current(what="this operation"):
    """The running Runtime; Horovod's ValueError before ``init()``."""
    if _runtime is None:
        raise NotInitializedError(what)
    return _runtime


def running():
    """The running Runtime, or None."""
    return _runtime


def is_initialized():
    return _runtime is not None


def _abort_on_uncaught(exc_type, exc, tb):
    """An uncaught exception on one rank ends the job on every rank, naming this rank."""
    ending = is_rank_process() and MPI.Is_initialized() and not MPI.Is_finalized() and \
        MPI.COMM_WORLD.Get_size() > 1 and not issubclass(exc_type, SystemExit)
    rank = this_rank()
    try:
        if ending:
            sys.stderr.write("stella_mpi: rank %d raised an uncaught %s\n" % (rank, exc_type.__name__))
        (_prev_excepthook or sys.__excepthook__)(exc_type, exc, tb)
        sys.stderr.flush()
    finally:
        if ending:
            end_job("stella_mpi: rank %d: uncaught %s: %s" % (rank, exc_type.__name__, exc), cause="exception")


def _end_on_signal(signum, frame):
    """SIGTERM/SIGHUP on one rank (a scheduler, a revoked host, a user) end the job everywhere,
    naming this rank: under plain mpirun nobody else would (hydra's report may name another pid).
    The rank says so and records it, then dies of the signal as it would have without stella_mpi
    (the launcher ends the others)."""
    if is_rank_process():
        message = "stella_mpi: %s received %s; ending the job on every rank" % (
            diagnosis.describe_rank(this_rank()), signal.Signals(signum).name)
        try:
            os.write(2, (message + "\n").encode())
        except OSError:
            pass
        record_status("signal", message)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install_signal_handlers():
    """From ``import stella_mpi`` on (start-up is when schedulers and users often strike), where
    the program has not set its own handlers (a handler it sets later replaces these)."""
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(s) == signal.SIG_DFL:
                signal.signal(s, _end_on_signal)


def _install_excepthook():
    global _prev_excepthook
    if _prev_excepthook is None:
        _prev_excepthook = sys.excepthook
        sys.excepthook = _abort_on_uncaught


def init(comm=None, process_sets=None):
    """Start stella_mpi (idempotent). ``comm``: an mpi4py communicator or a list of world
    ranks to run on (default: all); ``process_sets``: ProcessSets to register now."""
    global _runtime
    with _lock:
        if _runtime is not None:
            for ps in process_sets or []:
                if isinstance(ps, ProcessSet) and ps.process_set_id is None:
                    _runtime.add_process_set(ps)
            return
        if not MPI.Is_initialized():
            MPI.Init_thread(MPI.THREAD_MULTIPLE)
        try:
            _runtime = Runtime(comm, process_sets)
        except StellaTimeoutError as e:
            # a rank never came: the job cannot start, and MPI cannot finalize cleanly either
            end_on_timeout(e)
        _ever[0] = True
        _install_excepthook()


def shutdown():
    """Stop the collective thread and free every communicator. ``init()`` may be called again."""
    global _runtime
    with _lock:
        if _runtime is None:
            return
        rt, _runtime = _runtime, None
        rt.close()


def _at_exit():
    """At the end of the program: meet the other ranks of the runtime with the deadline (MPI_Finalize
    would wait for a frozen peer without one, and name nobody), shut down, and give MPI_Finalize
    itself a deadline. Only in a rank that called ``init()`` (not in a child forked from it)."""
    if not is_rank_process() or not _ever[0]:
        return
    rt = _runtime
    if rt is not None and rt.size > 1:
        try:
            Deadline(rt.config.timeout_s, rt.rank, peers=world_ranks(rt.world, range(rt.size))).wait(
                rt.world.Ibarrier(), "the end of the program")
        except StellaTimeoutError as e:
            end_on_timeout(e)
    shutdown()
    if MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
        guard_exit(MPI.COMM_WORLD.Get_rank())   # MPI_Finalize comes next: it gets a deadline too


atexit.register(_at_exit)
_install_signal_handlers()
