"""Deadlines on MPI's start and end, which no request can be polled for.

Importing mpi4py's MPI module initializes MPI, and MPI_Init waits for every rank of the job to
arrive; MPI_Finalize, at the end of the program, can wait for a peer too. A rank that freezes or
dies must not hang the others there, so both run under a watchdog (``STELLA_TIMEOUT``).

The watchdog is a forked child process, not a thread: MPI_Init may spin holding the GIL, and
MPI_Finalize runs when Python's threads are gone. The child keeps only a pipe (and stderr) open;
it waits on the pipe, whose write end only the parent holds: the parent closes it when the
guarded step is over, or the kernel does when the parent exits. If the deadline passes first,
the child writes the message, records the failure for stellarun, waits a second (the launcher
may look at the job) and kills the parent, which the launcher sees as a failed rank. Where a
fork is not possible (no memory), the step runs without its deadline."""
import os
import select
import signal
import socket
import sys
import time

from ..base.config import launcher_rank_setting, start_timeout_setting, timeout_setting
from .abort import record_status


def _timeout(setting=timeout_setting):
    try:
        return setting()
    except ValueError:
        return 120.0   # init() reports the bad setting


def watch(timeout, message, rank, explain=None):
    """Fork a watchdog that kills this process unless the returned pipe end is closed (or this
    process exits) within ``timeout`` seconds; ``explain()`` (run in the watchdog, without MPI)
    adds to the message. Returns (write end, child pid), or None."""
    parent = os.getpid()
    r, w = os.pipe()
    try:
        child = os.fork()
    except OSError:
        os.close(r)
        os.close(w)
        return None
    if child == 0:
        try:
            os.closerange(3, r)   # the parent's sockets, shared memory and PMI stay the parent's
            os.closerange(r + 1, os.sysconf("SC_OPEN_MAX"))
            ready, _, _ = select.select([r], [], [], timeout)
            if not ready:
                try:
                    if explain is not None:
                        message = message.rstrip("\n") + explain() + "\n"
                except Exception:  # noqa: BLE001 - the message as it is, then
                    pass
                try:
                    os.write(2, message.encode(errors="replace"))
                except OSError:
                    pass
                record_status("deadline", message.strip(), rank=rank, pid=parent)
                time.sleep(1.0)
                os.kill(parent, signal.SIGKILL)
        finally:
            os._exit(0)
    os.close(r)
    return w, child


def _stat(pid):
    """(state, parent pid) of process ``pid`` from /proc, or None."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[1])
    except (OSError, IndexError, ValueError):
        return None


def _comm(pid):
    try:
        with open("/proc/%d/comm" % pid) as f:
            return f.read().strip()
    except OSError:
        return ""


def stopped_peers(rank_pid=None):
    """'; rank 3 (host h, pid p) is stopped' for the ranks of this job on this host that are
    stopped now (SIGSTOP, a debugger), found without MPI (before MPI_Init nobody can be asked):
    the processes under the same hydra proxy as this rank (through a stellarun supervisor too)
    whose environment names a PMI rank."""
    me = os.getppid() if rank_pid is None else rank_pid   # (run in the watchdog: its parent is the rank)
    proxy, pid = None, me
    for _ in range(4):
        st = _stat(pid)
        if st is None or st[1] <= 1:
            break
        pid = st[1]
        if _comm(pid).startswith("hydra_pmi_prox"):
            proxy = pid
            break
    if proxy is None:
        return ""
    parents, states = {}, {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None:
                states[int(entry)], parents[int(entry)] = st
    found = []
    for pid, state in sorted(states.items()):
        if pid == me or state not in ("T", "t"):
            continue
        up, ok = pid, False
        for _ in range(3):
            up = parents.get(up)
            if up == proxy:
                ok = True
                break
            if up is None:
                break
        if not ok:
            continue
        try:
            with open("/proc/%d/environ" % pid, "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            rank = int(env[b"PMI_RANK"])
        except (OSError, KeyError, ValueError):
            continue
        found.append("rank %d (host %s, pid %d)" % (rank, socket.gethostname(), pid))
    return "; on this host %s %s stopped (SIGSTOP or a debugger)" % (
        ", ".join(found), "is" if len(found) == 1 else "are") if found else ""


def import_mpi():
    """Import ``mpi4py.MPI`` (initializing MPI) unless it is already; this process ends with a
    message if MPI_Init has not returned within the deadline."""
    if "mpi4py.MPI" in sys.modules:
        return
    timeout, rank = _timeout(start_timeout_setting), launcher_rank_setting()
    guard = watch(timeout, "stella_mpi: rank %d (as the launcher numbers it): MPI_Init did not complete within %.0f "
                  "s (STELLA_START_TIMEOUT, else STELLA_TIMEOUT): a rank of the job has not started (frozen, still loading, or its host is "
                  "down)\n" % (rank, timeout), rank, explain=stopped_peers)
    try:
        from mpi4py import MPI  # noqa: F401
    finally:
        if guard is not None:
            os.close(guard[0])             # the watchdog sees end-of-file and leaves
            try:
                os.waitpid(guard[1], 0)
            except ChildProcessError:      # SIGCHLD ignored: nothing to reap
                pass


def guard_exit(rank):
    """Arm the deadline of this process's end (MPI_Finalize, interpreter teardown): the watchdog
    kills the process if it is still alive ``STELLA_TIMEOUT`` seconds from now."""
    from . import diagnosis   # not at the top: it imports MPI, which import_mpi must start first
    timeout = _timeout()
    watch(timeout, "stella_mpi: rank %d: the process did not end within %.0f s (STELLA_TIMEOUT) after the program "
          "did: MPI_Finalize waits for a peer that has stalled, or teardown hangs; ending this process\n"
          % (rank, timeout), rank, explain=diagnosis.stopped_here)
