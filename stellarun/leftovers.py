"""What MPICH leaves on the machine when a job does not end cleanly: its shared-memory
segments (``/dev/shm/mpich_shm_*``, a few MB each) and hydra's topology files
(``/tmp/hydra_hwloc_xmlfile_*``). A file is removed only when no running process has it open
or mapped, so the files of jobs still running are never touched."""
import os
import time

PATTERNS = (("/dev/shm", "mpich_shm_"), ("/tmp", "hydra_hwloc_xmlfile_"))


def in_use():
    """Paths that some running process has open or mapped."""
    used = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        fd_dir = "/proc/%s/fd" % pid
        try:
            for fd in os.listdir(fd_dir):
                try:
                    used.add(os.readlink(os.path.join(fd_dir, fd)))
                except OSError:
                    pass
            with open("/proc/%s/maps" % pid) as f:
                for line in f:
                    parts = line.split(None, 5)
                    if len(parts) == 6:
                        used.add(parts[5].strip())
        except OSError:
            continue   # gone meanwhile, or not ours to read
    return used


def candidates(since=None):
    """MPICH's files on this machine (created at or after ``since``, a unix time, if given)."""
    out = []
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
                if since is not None and os.stat(path).st_mtime < since:
                    continue
            except OSError:
                continue
            out.append(path)
    return sorted(out)


def remove_after_job(since, settle_s=3.0):
    """Remove the files of a job that just ended: those from ``since`` on, once its processes
    (which the launcher may still be killing) have let go of them, waiting up to ``settle_s``."""
    removed = []
    end = time.monotonic() + settle_s
    while True:
        removed += remove_unused(since)
        if not candidates(since) or time.monotonic() >= end:
            return removed
        time.sleep(0.2)


def remove_unused(since=None):
    """Remove the MPICH files that no running process uses (only those from ``since`` on, if
    given). Returns the removed paths."""
    files = candidates(since)
    if not files:
        return []
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
