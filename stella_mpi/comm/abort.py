"""Ending the job: the one path every fatal failure takes, from any thread.

It writes the message to file descriptor 2 (``sys.stderr`` may be captured), records how this
rank ended for ``stellarun`` (``STELLA_STATUS_DIR``), gives the launcher a moment to forward the
output, and calls ``MPI_Abort`` on the world. ``MPI_Abort`` may return with this MPICH when it is
called from a thread other than the main one; the process then ends itself. Nothing after a
fatal failure returns into user code.
"""
import json
import os
import socket
import threading
import time

from ..base.config import launcher_rank_setting, status_dir_setting

_ending = threading.Lock()


def this_rank():
    """This process's world rank (MPI's when MPI is up, else the launcher's, else -1)."""
    try:
        from mpi4py import MPI
        if MPI.Is_initialized() and not MPI.Is_finalized():
            return MPI.COMM_WORLD.Get_rank()
    except Exception:  # noqa: BLE001 - asking must never fail on the abort path
        pass
    return launcher_rank_setting()


def record_status(cause, detail, rank=None):
    """Write how this rank ended to ``STELLA_STATUS_DIR/rank<r>.json`` for stellarun (a no-op
    without stellarun; the first record of a rank is kept). The record's format is stellarun's
    (stellarun/status.py: rank, host, pid, time, cause, detail); tests/unit/test_fail_stop_report.py
    checks that both writers agree."""
    directory = status_dir_setting()
    if not directory:
        return
    rank = this_rank() if rank is None else rank
    rec = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time(), "cause": cause,
           "detail": str(detail)[:2000]}
    try:
        fd = os.open(os.path.join(directory, "rank%d.json" % rank), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError:
        return   # already recorded (or no such directory): the first cause wins
    with os.fdopen(fd, "w") as f:
        json.dump(rec, f)


def end_job(message, cause="collective", exit_code=1):
    """Write ``message``, record ``cause``, abort the whole job. Never returns."""
    if not _ending.acquire(blocking=False):
        # another thread is already ending the job: wait for it to do so
        while True:
            time.sleep(60)
    try:
        if not message.endswith("\n"):
            message += "\n"
        os.write(2, message.encode(errors="replace"))
        record_status(cause, message.strip().splitlines()[0] if message.strip() else cause)
        time.sleep(0.5)  # let the launcher forward the message before the job is torn down
        from mpi4py import MPI
        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.COMM_WORLD.Abort(exit_code)
    finally:
        os._exit(exit_code)
