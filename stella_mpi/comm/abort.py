"""Ending the job: the one path every fatal failure takes, from any thread.

It writes the message to file descriptor 2 (``sys.stderr`` may be captured), records how this
rank ended for ``stellarun`` (``STELLA_STATUS_DIR``), gives the launcher a moment to forward the
output, and calls ``MPI_Abort`` on the world. ``MPI_Abort`` may return with this MPICH when it is
called from a thread other than the main one; the process then ends itself. Nothing after a
fatal failure returns into user code, and nothing on this path may raise or block for good:
every step is guarded, and an alarm (SIGALRM at its default action: the kernel ends the
process) bounds the whole path.

A child forked from a rank (a DataLoader worker, ``multiprocessing``) is not the rank: it never
touches MPI or the status records; on this path it just exits.
"""
import json
import os
import signal
import socket
import threading
import time

from ..base import timeline
from ..base.config import launcher_rank_setting, status_dir_setting, status_emit_setting

_lock = threading.Lock()
_ending_thread = None        # the thread that is ending the job
BACKSTOP_S = 30              # the longest the ending itself may take
RANK_PID = os.getpid()       # the rank's own process (a forked child is not the rank)


def _forked():
    global RANK_PID
    RANK_PID = -1   # in a child: none of this process's ending path is the rank's


os.register_at_fork(after_in_child=_forked)


def is_rank_process():
    return os.getpid() == RANK_PID


def this_rank():
    """This process's world rank (MPI's when MPI is up, else the launcher's, else -1)."""
    try:
        from mpi4py import MPI
        if MPI.Is_initialized() and not MPI.Is_finalized():
            return MPI.COMM_WORLD.Get_rank()
    except Exception:  # noqa: BLE001 - asking must never fail on the abort path
        pass
    return launcher_rank_setting()


_emitted = False   # this process printed its record as a marker line (no status directory on this host)


def record_status(cause, detail, rank=None, pid=None, silent=None):
    """Write how this rank ended to ``STELLA_STATUS_DIR/rank<r>.json`` for stellarun (a no-op
    without stellarun, in a forked child unless it writes for the rank's ``pid``, or when the
    rank is unknown; the first record of a rank is kept; never raises). The record's format is
    stellarun's (stellarun/status.py: rank, host, pid, time, cause, detail, and for a deadline
    the ranks that did not answer, ``silent``); tests/unit/test_fail_stop_report.py checks that
    both writers agree."""
    global _emitted
    try:
        directory = status_dir_setting()
        # a host other than stellarun's (its supervisor says so): no directory here; the record
        # goes to the launching host as one line of stderr that stellarun takes out of the output
        # (stellarun/status.py: MARKER)
        emit = status_emit_setting()
        rank = this_rank() if rank is None else rank
        if not (directory or emit) or rank < 0 or (pid is None and not is_rank_process()):
            return
        rec = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid() if pid is None else pid,
               "time": time.time(), "cause": cause, "detail": str(detail)[:2000]}
        if silent is not None:
            rec["silent"] = [int(r) for r in silent]
        if directory:
            fd = os.open(os.path.join(directory, "rank%d.json" % rank), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with os.fdopen(fd, "w") as f:
                json.dump(rec, f)
        elif _emitted:
            return   # the first cause of a rank is the one kept
        if emit:
            _emitted = True
            os.write(2, b"stellarun-status: " + json.dumps(rec, separators=(",", ":")).encode() + b"\n")
    except Exception:  # noqa: BLE001 - already recorded, no such directory, a full disk: no record
        pass


def _write(text):
    try:
        os.write(2, text.encode(errors="replace"))
    except OSError:
        pass


def end_job(message, cause="collective", exit_code=1, silent=None):
    """Write ``message`` (with a last line saying the job ends; nothing more when it is empty:
    the caller has written it), record ``cause``, abort the whole job. Never returns. Called
    again while the job is ending: from the same thread (a signal handler running inside the
    ending) it returns so that the ending goes on; from another thread it waits for the ending."""
    global _ending_thread
    me = threading.get_ident()
    if not is_rank_process():
        os._exit(exit_code)
    if not _lock.acquire(blocking=False):
        if _ending_thread == me:
            return
        time.sleep(BACKSTOP_S)
        os._exit(exit_code)
    _ending_thread = me
    try:
        if signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, None):
            signal.alarm(BACKSTOP_S)   # the kernel ends the process if anything below blocks
        rank = this_rank()
        if message:
            _write(message.rstrip("\n") + "\nstella_mpi: rank %d: ending the job on every rank\n" % rank)
        record_status(cause, message.strip().splitlines()[0] if message.strip() else cause, rank, silent=silent)
        timeline.flush()   # the events up to the failure are the ones a timeline is read for
        time.sleep(0.5)  # let the launcher forward the message before the job is torn down
        from mpi4py import MPI
        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.COMM_WORLD.Abort(exit_code)
    finally:
        os._exit(exit_code)
