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


def record(directory, rank, cause, detail, pid=None, emit=False):
    """Write a rank's record unless it has one (no-op without a directory); ``emit`` (a host
    other than the launching one, where there is no directory): print it as a marker line on
    stderr instead."""
    if not directory and not emit:
        return
    rec = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid() if pid is None else pid,
           "time": time.time(), "cause": cause, "detail": str(detail)[:2000]}
    if directory:
        try:
            fd = os.open(os.path.join(directory, "rank%d.json" % rank), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError:
            return
        with os.fdopen(fd, "w") as f:
            json.dump(rec, f)
    if emit:
        try:
            os.write(2, marker_line(rec))
        except OSError:
            pass


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


def _checked(rec):
    """``rec`` if it is a well-formed record (a bad ``silent`` dropped), else None."""
    if not (isinstance(rec, dict) and all(k in rec for k in FIELDS) and rec["cause"] in EXIT_CODES
            and isinstance(rec["rank"], int) and not isinstance(rec["rank"], bool)
            and isinstance(rec["time"], (int, float))):
        return None
    silent = rec.pop("silent", None)
    if isinstance(silent, list) and all(isinstance(r, int) and not isinstance(r, bool) for r in silent):
        rec["silent"] = silent
    return rec


def read_all(directory):
    """Every well-formed record, earliest first."""
    out = []
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        if not (name.startswith("rank") and name.endswith(".json")):
            continue
        try:
            with open(os.path.join(directory, name)) as f:
                rec = _checked(json.load(f))
        except (OSError, ValueError):
            continue
        if rec is not None:
            out.append(rec)
    return sorted(out, key=lambda r: r["time"])


# ---------------------------------------------------------------- records from other hosts
#
# The status directory is made on the launching host. On another host (where that directory
# does not exist) a rank's supervisor clears STELLA_STATUS_DIR and sets STELLA_STATUS_EMIT: the
# rank's first record and the supervisor's are printed on stderr as one MARKER line each, which
# hydra forwards to mpirun on the launching host (nothing is written on that host). stellarun reads mpirun's
# stderr, takes the marker lines out of it (:class:`MarkerFilter`) and reports them with the
# records of its own host (:func:`merged`).

MARKER = b"stellarun-status: "
EMIT_VAR = "STELLA_STATUS_EMIT"


def marker_line(rec):
    return MARKER + json.dumps(rec, separators=(",", ":")).encode() + b"\n"


def parse_marker(line):
    """The record of a marker line (bytes, without its newline), or None."""
    if not line.startswith(MARKER):
        return None
    try:
        return _checked(json.loads(line[len(MARKER):].decode(errors="replace")))
    except ValueError:
        return None


class MarkerFilter:
    """Passes a byte stream on (``write``) without its marker lines, which it keeps as records.
    Complete lines go on at once; a partial line only waits while it could still be a marker."""

    def __init__(self, write):
        self.write = write
        self.records = []
        self._held = b""

    def feed(self, chunk):
        data = self._held + chunk
        self._held = b""
        while data:
            nl = data.find(b"\n")
            if nl < 0:
                if MARKER.startswith(data[:len(MARKER)]):
                    self._held = data   # may be the start of a marker line
                else:
                    self.write(data)
                return
            line, data = data[:nl], data[nl + 1:]
            rec = parse_marker(line)
            if rec is not None:
                self.records.append(rec)
            else:
                self.write(line + b"\n")

    def close(self):
        if self._held:
            rec = parse_marker(self._held)
            if rec is not None:
                self.records.append(rec)
            else:
                self.write(self._held)
            self._held = b""


def merged(local, remote):
    """The records of this host and those that came as marker lines, the first of each rank
    kept, earliest first."""
    first = {}
    for rec in sorted(list(local) + list(remote), key=lambda r: r["time"]):
        first.setdefault(rec["rank"], rec)
    return sorted(first.values(), key=lambda r: r["time"])


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
