"""How each rank of a job ended: one JSON record per rank in the job's status directory
(``STELLA_STATUS_DIR``), written by the rank itself (stella_mpi.comm.abort.record_status) or
by its supervisor (:mod:`.rank`), read by stellarun after the job.

A record: ``{"rank", "host", "pid", "time", "cause", "detail"}`` in ``rank<r>.json``, created
exclusively, so the first cause of a rank wins; a deadline's record may add ``"silent"``, the
ranks that did not answer its diagnosis (``stellarun --elastic`` tells a cluster cut off by its
link from it). Causes, and stellarun's exit code for each when
it is the job's first failure:"""
import json
import os
import socket
import time

EXIT_CODES = {
    "exception": 10,    # a rank raised an uncaught exception
    "collective": 11,   # a collective failed (transport error, malformed payload from a peer)
    "deadline": 12,     # a wait passed STELLA_TIMEOUT: a rank stalled or never came
    "signal": 13,       # a rank was killed by a signal
    "exit": 14,         # a rank exited with a non-zero code of its own
}
LAUNCH_FAILED = 15      # mpirun failed and no rank said why
FIELDS = ("rank", "host", "pid", "time", "cause", "detail")
DIR_PREFIX = "stellarun-status-"   # the job's status directory, in the temporary directory


def write_owner(directory):
    """Note the launcher's pid in its status directory (``stellarun --clean`` removes the
    directories of launchers that are gone)."""
    with open(os.path.join(directory, "launcher.pid"), "w") as f:
        f.write(str(os.getpid()))


def launcher_alive(directory):
    try:
        with open(os.path.join(directory, "launcher.pid")) as f:
            return os.path.exists("/proc/%d" % int(f.read().strip()))
    except (OSError, ValueError):
        # no pid yet: a directory made a moment ago is still being set up
        try:
            return time.time() - os.stat(directory).st_mtime < 60
        except OSError:
            return False


def any_record(directory):
    """Whether a rank of the job has recorded a failure yet."""
    try:
        return any(n.startswith("rank") for n in os.listdir(directory))
    except OSError:
        return False


def record(directory, rank, cause, detail, pid=None):
    """Write a rank's record unless it has one (no-op without a directory)."""
    if not directory:
        return
    rec = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid() if pid is None else pid,
           "time": time.time(), "cause": cause, "detail": str(detail)[:2000]}
    try:
        fd = os.open(os.path.join(directory, "rank%d.json" % rank), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError:
        return
    with os.fdopen(fd, "w") as f:
        json.dump(rec, f)


def record_start(directory, rank, pid):
    """Note which process runs ``rank`` (``started<r>.json``), so stellarun can look at it."""
    if not directory:
        return
    try:
        with open(os.path.join(directory, "started%d.json" % rank), "w") as f:
            json.dump({"rank": rank, "host": socket.gethostname(), "pid": pid}, f)
    except OSError:
        pass   # not on this host (a multi-host job): stellarun only looks at its own host


def stopped_ranks(directory):
    """The ranks of this host whose process is stopped now (SIGSTOP, a debugger): [record]."""
    out = []
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        if not (name.startswith("started") and name.endswith(".json")):
            continue
        try:
            with open(os.path.join(directory, name)) as f:
                rec = json.load(f)
            if rec.get("host") != socket.gethostname():
                continue
            with open("/proc/%d/stat" % int(rec["pid"])) as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            continue
        if state in ("T", "t"):
            out.append(rec)
    return out


def read_all(directory):
    """Every well-formed record, earliest first."""
    out = []
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        if not (name.startswith("rank") and name.endswith(".json")):
            continue
        try:
            with open(os.path.join(directory, name)) as f:
                rec = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and all(k in rec for k in FIELDS) and rec["cause"] in EXIT_CODES \
                and isinstance(rec["rank"], int) and not isinstance(rec["rank"], bool):
            silent = rec.pop("silent", None)
            if isinstance(silent, list) and all(isinstance(r, int) and not isinstance(r, bool) for r in silent):
                rec["silent"] = silent
            out.append(rec)
    return sorted(out, key=lambda r: r["time"])


def report(records):
    """(one-line summary of the first failure, exit code) of a failed job, or (None, 0)."""
    if not records:
        return None, 0
    first = records[0]
    line = "rank %s (host %s, pid %s) failed first: %s: %s" % (first["rank"], first["host"], first["pid"],
                                                               first["cause"], first["detail"])
    if len(records) > 1:
        line += " (%d more rank(s) reported failures after it)" % (len(records) - 1)
    return line, EXIT_CODES[first["cause"]]
