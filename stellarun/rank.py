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
import socket
import subprocess
import sys
import threading
import time

from . import leftovers
from .status import EMIT_VAR, record, record_start

PRETEND_REMOTE_VAR = "STELLARUN_PRETEND_REMOTE"   # tests: hosts (comma-separated) whose ranks act as on another host

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


def on_another_host(directory):
    """Whether this rank runs on a host other than the launching one: the job's status directory
    (made there) does not exist here, or this host is named in STELLARUN_PRETEND_REMOTE (two pretend
    hosts of one machine, as the tests run them)."""
    me = os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()
    pretend = [h.strip() for h in os.environ.get(PRETEND_REMOTE_VAR, "").split(",") if h.strip()]
    return bool(directory) and (not os.path.isdir(directory) or me in pretend)


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
    if argv[:1] == ["--janitor"] and len(argv) == 2:
        return janitor(int(argv[1]))
    cmd = argv[1:] if argv[:1] == ["--"] else argv
    if not cmd:
        sys.stderr.write("usage: python -m stellarun.rank -- COMMAND...\n")
        return 2
    directory, rank = os.environ.get("STELLA_STATUS_DIR", ""), launcher_rank()
    remote = on_another_host(directory)
    env = None
    if remote:
        # no status directory here: the rank's first record and this supervisor's go to the
        # launching host as marker lines on stderr; a janitor cleans this host after the job
        directory = ""
        env = dict(os.environ, STELLA_STATUS_DIR="", **{EMIT_VAR: "1"})
        start_janitor()
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
                                 process_group=0, stdout=pipes, stderr=pipes, env=env)
    except OSError as e:
        record(directory, rank, "exit", "could not start %r: %s" % (cmd[0], e), emit=remote)
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
        record(directory, rank, "signal" if rc < 0 else "exit", describe_status(rc), child.pid, emit=remote)
    if rc < 0:   # end the way the rank ended, so that mpirun reports the same signal
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))   # the rank's core dump, not ours
        try:
            signal.signal(-rc, signal.SIG_DFL)
        except (OSError, ValueError):
            pass     # SIGKILL and SIGSTOP keep their default action anyway
        os.kill(os.getpid(), -rc)
    return rc if rc >= 0 else 128 - rc


def start_janitor():
    """On a host other than the launching one, what stellarun does for its own host after a job:
    a process in a session of its own (a failed job's abort kills the supervisor and the rank,
    not it) notes MPICH's files the rank uses while the supervisor lives, then removes those and
    the ones made since that nothing uses, and ends."""
    try:
        subprocess.Popen([sys.executable, "-m", "stellarun.rank", "--janitor", str(os.getpid())],
                         start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, close_fds=True)
    except OSError as e:
        sys.stderr.write("stellarun.rank: no clean-up on this host after the job (%s)\n" % e)


def janitor(supervisor):
    started, seen = time.time(), set()
    while os.path.exists("/proc/%d" % supervisor):
        seen |= leftovers.used_by_descendants(supervisor)
        time.sleep(0.5)
    leftovers.remove_after_job(seen, since=started - 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
