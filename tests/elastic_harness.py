"""What tests/test_elastic.py and bench/bench_elastic.py share: launching an elastic job of
tests/scripts/elastic_train.py on two pretend hosts of this machine, finding the workers of a
host, and reading rank 0's progress lines."""
import glob
import os
import re
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "elastic_train.py")
STELLARUN = [sys.executable, "-m", "stellarun"]


def workers(host=None, script="elastic_train.py"):
    """Pids of the training processes (``python .../script``; not their supervisors), of
    ``host`` or of every host."""
    pids = []
    for proc in glob.glob("/proc/[0-9]*"):
        try:
            with open(proc + "/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
            if len(cmd) < 2 or not cmd[1].endswith(script.encode()):   # python SCRIPT: not mpirun,
                continue                                                       # stellarun or a supervisor
            with open(proc + "/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if host is None or ("HOROVOD_HOSTNAME=%s" % host).encode() in env:
            pids.append(int(proc.rsplit("/", 1)[1]))
    return sorted(pids)


def read(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def progress(path):
    """[(step, size, unix time)] printed by rank 0 so far."""
    return [(int(a), int(b), float(c)) for a, b, c in
            re.findall(r"progress step=(\d+) size=(\d+) t=([0-9.]+)", read(path))]


def wait(cond, timeout, poll=0.05):
    """``cond()``'s first true value within ``timeout`` seconds, else None."""
    end = time.time() + timeout
    while time.time() < end:
        got = cond()
        if got:
            return got
        time.sleep(poll)
    return None


def write_hosts(listing, hosts):
    tmp = str(listing) + ".tmp"
    with open(tmp, "w") as f:
        f.write("".join("%s:%d\n" % h for h in hosts))
    os.replace(tmp, str(listing))


def discovery(directory, hosts):
    """A discovery script printing the hosts file (returned with it), which starts as ``hosts``."""
    listing = os.path.join(str(directory), "hosts")
    write_hosts(listing, hosts)
    script = os.path.join(str(directory), "discover.sh")
    with open(script, "w") as f:
        f.write("#!/bin/sh\ncat %s\n" % listing)
    os.chmod(script, 0o755)
    return listing, script


def launch(directory, script, np_, steps, extra=(), train_args=()):
    """Start ``stellarun --elastic`` (localhost = cluster a, 127.0.0.1 = cluster b); returns
    (Popen, log path, result path, open log file)."""
    log = os.path.join(str(directory), "job.log")
    out = os.path.join(str(directory), "result.json")
    cmd = STELLARUN + ["--elastic", "-np", str(np_), "--min-np", str(max(1, np_ // 2)), "--host-discovery-script",
                       script, "--cluster-of", "localhost=a", "--cluster-of", "127.0.0.1=b", "--timeout", "60"] + \
        list(extra) + [sys.executable, SCRIPT, "--steps", str(steps), "--out", out] + list(train_args)
    f = open(log, "w")
    proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    return proc, log, out, f


def finish(proc, f, timeout=240):
    """The job's exit code (None: it had to be killed after ``timeout`` s)."""
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        rc = None
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    f.close()
    return rc
