"""One rank under stellarun's supervision: ``python -m stellarun.rank -- COMMAND...``.

mpirun starts this small process in place of each rank; it runs the rank's command as its child
and, when the child ends abnormally, records how (signal or exit code) in ``STELLA_STATUS_DIR``
for stellarun's report. stella_mpi itself records the richer causes it knows (an uncaught
exception, a failed collective, a passed deadline) before it ends a job; the first record of a
rank wins. The supervisor forwards the signals it gets to the rank, ends with the rank's own
status (so mpirun sees the same failure), and dies with its parent: if mpirun's proxy goes, the
supervisor and the rank go too, so a killed launcher leaves nothing running."""
import ctypes
import os
import signal
import subprocess
import sys

from .status import record, record_start

PR_SET_PDEATHSIG = 1
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def die_with_parent(sig=signal.SIGKILL):
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux; else nothing)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def describe_status(rc):
    """'killed by signal 9 (SIGKILL)' or 'exited with code 3' for a Popen return code."""
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = "?"
        return "killed by signal %d (%s)" % (-rc, name)
    return "exited with code %d" % rc


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    cmd = argv[1:] if argv[:1] == ["--"] else argv
    if not cmd:
        sys.stderr.write("usage: python -m stellarun.rank -- COMMAND...\n")
        return 2
    parent = os.getppid()
    die_with_parent()
    if os.getppid() != parent:   # the parent went before the request took effect
        return 1
    child = subprocess.Popen(cmd, close_fds=False, preexec_fn=die_with_parent)
    record_start(os.environ.get("STELLA_STATUS_DIR", ""), int(os.environ.get("PMI_RANK", "-1") or -1), child.pid)
    for s in FORWARDED:
        signal.signal(s, lambda signum, frame: child.send_signal(signum))
    rc = child.wait()
    if rc != 0:
        record(os.environ.get("STELLA_STATUS_DIR", ""), int(os.environ.get("PMI_RANK", "-1") or -1),
               "signal" if rc < 0 else "exit", describe_status(rc), child.pid)
    if rc < 0:   # end the way the rank ended, so that mpirun reports the same signal
        try:
            signal.signal(-rc, signal.SIG_DFL)
        except (OSError, ValueError):
            pass     # SIGKILL and SIGSTOP keep their default action anyway
        os.kill(os.getpid(), -rc)
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    sys.exit(main())
