"""One rank under stellarun's supervision: ``python -m stellarun.rank -- COMMAND...``.

mpirun starts this small process in place of each rank; it runs the rank's command as its child
and, when the child ends abnormally, records how (signal or exit code) in ``STELLA_STATUS_DIR``
for stellarun's report. stella_mpi itself records the richer causes it knows (an uncaught
exception, a failed collective, a passed deadline) before it ends a job; the first record of a
rank wins. The supervisor forwards the signals it gets to the rank (which runs in a process
group of its own, so that a signal to the supervisor's group does not reach it twice), ends with
the rank's own status (so mpirun sees the same failure), and dies with its parent: if mpirun's
proxy goes, the supervisor and the rank go too, so a killed launcher leaves nothing running.
Nothing here may stop the rank from running: a status directory that does not exist on this
host (a multi-host job: it is made on the launching host) only means no record."""
import ctypes
import os
import resource
import signal
import subprocess
import sys
import threading

from .status import record, record_start

PR_SET_PDEATHSIG = 1
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")   # as stella_mpi.base.config reads them
SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS")
OUTPUT_DIR_VAR = "STELLA_OUTPUT_DIR"   # stellarun --output-filename: where each rank's output is kept
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl   # looked up once: the forked child only calls it
except (OSError, AttributeError):
    _prctl = None


def die_with_parent(expect_parent=None):
    """Ask the kernel to SIGKILL this process when its parent dies (Linux; else nothing). With
    ``expect_parent`` (in a child between fork and exec): if that parent is already gone, exit."""
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if expect_parent is not None and os.getppid() != expect_parent:
        os._exit(1)


def launcher_rank():
    for var in RANK_VARS:
        try:
            return int(os.environ[var])
        except (KeyError, ValueError):
            continue
    return -1


def output_paths(directory, rank):
    """``DIR/rank.N/stdout`` and ``stderr`` of ``rank`` (N zero-padded to the job size's width, so
    the folders sort by rank, as horovodrun's --output-filename does); None without a directory."""
    if not directory or rank < 0:
        return None
    size = 0
    for var in SIZE_VARS:
        try:
            size = int(os.environ[var])
            break
        except (KeyError, ValueError):
            continue
    folder = os.path.join(directory, "rank.%0*d" % (len(str(max(size - 1, 0))), rank))
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, "stdout"), os.path.join(folder, "stderr")


def _tee(pipe, console, path):
    """Copy the rank's output to the console (as without --output-filename) and to its file."""
    with open(path, "wb") as f:
        while True:
            chunk = os.read(pipe.fileno(), 65536)
            if not chunk:
                break
            f.write(chunk)
            f.flush()
            try:
                console.write(chunk)
                console.flush()
            except (OSError, ValueError):
                pass
    pipe.close()


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
    directory, rank = os.environ.get("STELLA_STATUS_DIR", ""), launcher_rank()
    parent = os.getppid()
    die_with_parent()
    if os.getppid() != parent:   # the parent went before the request took effect
        return 1
    pending, child = [], None

    def forward(signum, frame):
        if child is None:
            pending.append(signum)     # arrived before the rank started: delivered once it has
        else:
            try:
                os.killpg(child.pid, signum)
            except ProcessLookupError:
                pass
    for s in FORWARDED:
        signal.signal(s, forward)

    me = os.getpid()
    try:
        paths = output_paths(os.environ.get(OUTPUT_DIR_VAR, ""), rank)
    except OSError as e:
        sys.stderr.write("stellarun.rank: rank %d: no output files (%s); output goes to the console only\n" % (rank, e))
        paths = None
    pipes = subprocess.PIPE if paths else None
    try:
        child = subprocess.Popen(cmd, close_fds=False, preexec_fn=lambda: die_with_parent(expect_parent=me),
                                 process_group=0, stdout=pipes, stderr=pipes)
    except OSError as e:
        record(directory, rank, "exit", "could not start %r: %s" % (cmd[0], e))
        sys.stderr.write("stellarun.rank: could not start %r: %s\n" % (cmd[0], e))
        return 127
    record_start(directory, rank, child.pid)
    copiers = []
    if paths:
        for pipe, console, path in ((child.stdout, sys.stdout.buffer, paths[0]), (child.stderr, sys.stderr.buffer, paths[1])):
            t = threading.Thread(target=_tee, args=(pipe, console, path), daemon=True)
            t.start()
            copiers.append(t)
    for signum in pending:
        forward(signum, None)
    rc = child.wait()
    for t in copiers:
        t.join(timeout=5)
    if rc != 0:
        record(directory, rank, "signal" if rc < 0 else "exit", describe_status(rc), child.pid)
    if rc < 0:   # end the way the rank ended, so that mpirun reports the same signal
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))   # the rank's core dump, not ours
        try:
            signal.signal(-rc, signal.SIG_DFL)
        except (OSError, ValueError):
            pass     # SIGKILL and SIGSTOP keep their default action anyway
        os.kill(os.getpid(), -rc)
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    sys.exit(main())
