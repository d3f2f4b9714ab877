"""What MPICH leaves on the machine when a job does not end cleanly: its shared-memory
segments (``/dev/shm/mpich_shm_*``, a few MB each) and hydra's topology files
(``/tmp/hydra_hwloc_xmlfile_*``), and what stellarun itself leaves when it is killed (its
status directories). Only this user's files are touched, and a file only when no running
process of this user has it open or mapped. After a job, stellarun removes the files the job's processes were seen to use (it
looks while the job runs) and those created during the job that nobody uses."""
import os
import shutil
import tempfile
import time

PATTERNS = (("/dev/shm", "mpich_shm_"), ("/tmp", "hydra_hwloc_xmlfile_"))
CLEAN_MIN_AGE_S = 60   # --clean leaves younger files alone (a job may be starting)


def _prefixes():
    return tuple(os.path.join(d, p) for d, p in PATTERNS)


def _files_of(pid, prefixes):
    """MPICH files process ``pid`` has open or mapped (raises OSError if it cannot be read)."""
    out = set()
    fd_dir = "/proc/%s/fd" % pid
    for fd in os.listdir(fd_dir):
        try:
            path = os.readlink(os.path.join(fd_dir, fd))
        except OSError:
            continue
        if path.startswith(prefixes):
            out.add(path)
    with open("/proc/%s/maps" % pid) as f:
        for line in f:
            i = line.find("/")
            if i >= 0 and line.startswith(prefixes, i):
                out.add(line[i:].strip())
    return out


def in_use():
    """MPICH files that this user's running processes (those it may look at) have open or mapped."""
    prefixes, uid = _prefixes(), os.geteuid()
    used = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if uid != 0 and os.stat("/proc/" + pid).st_uid != uid:
                continue
            used |= _files_of(pid, prefixes)
        except OSError:
            continue   # gone meanwhile, or not to be looked at (then not one of this user's ranks)
    return used


def used_by_descendants(root):
    """MPICH files that process ``root`` and its descendants have open or mapped now."""
    prefixes = _prefixes()
    children = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open("/proc/%s/stat" % pid) as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(pid))
            except (OSError, ValueError, IndexError):
                continue
    seen, todo = set(), [root]
    while todo:
        pid = todo.pop()
        try:
            seen |= _files_of(pid, prefixes)
        except OSError:
            pass
        todo += children.get(pid, [])
    return seen


def candidates(since=None, older_than=None):
    """This user's MPICH files on this machine, created at or after ``since`` (unix time) or
    last changed before ``older_than`` seconds ago, if given."""
    out, uid, now = [], os.geteuid(), time.time()
    for directory, prefix in PATTERNS:
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for name in names:
            if not name.startswith(prefix):
                continue
            path = os.path.join(directory, name)
            try:
                st = os.stat(path)
            except OSError:
                continue
            if st.st_uid != uid or (since is not None and st.st_mtime < since) or \
                    (older_than is not None and st.st_mtime > now - older_than):
                continue
            out.append(path)
    return sorted(out)


def _remove_unused(files):
    used = in_use()
    removed = []
    for path in files:
        if path in used:
            continue
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed


def remove_unused(older_than=CLEAN_MIN_AGE_S):
    """``stellarun --clean``: remove this user's MPICH files that no running process uses (and
    that are older than ``older_than`` seconds), and the status directories of stellarun runs
    that no longer exist. Returns the removed paths."""
    removed = _remove_unused(candidates(older_than=older_than))
    tmp = tempfile.gettempdir()
    from .status import DIR_PREFIX, launcher_alive
    for name in os.listdir(tmp):
        path = os.path.join(tmp, name)
        if name.startswith(DIR_PREFIX) and os.path.isdir(path) and not launcher_alive(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def remove_after_job(seen, since, settle_s=3.0):
    """Remove the files of a job that just ended: those its processes were seen to use, and those
    created since ``since`` that nobody uses, once its processes (which the launcher may still
    be killing) have let go of them, waiting up to ``settle_s``."""
    removed = []
    end = time.monotonic() + settle_s
    while True:
        mine = sorted(set(candidates(since=since)) | {p for p in seen if os.path.exists(p)})
        removed += _remove_unused(mine)
        left = [p for p in seen if os.path.exists(p)]
        if not left or time.monotonic() >= end:
            return removed
        time.sleep(0.2)
