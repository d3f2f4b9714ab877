"""stellarun under failure: the first failed rank named with its cause, one exit code per kind
of failure, MPICH's files of the job removed, and the job gone when stellarun is killed."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from mpi_launch import ROOT, mpirun_path

pytestmark = pytest.mark.mpi
STELLARUN = os.path.join(os.path.dirname(sys.executable), "stellarun")


def _leftovers_now():
    from stellarun import leftovers
    return set(leftovers.candidates())


def _stellarun(*args, timeout=120, env=None):
    if mpirun_path() is None or not os.path.exists(STELLARUN):
        pytest.skip("no mpirun or stellarun")
    full = dict(os.environ, STELLA_TIMEOUT="3", PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.run([STELLARUN] + list(args), cwd=ROOT, env=full, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("mode,code,says", [
    ("raise", 10, "rank 1 (host"),
    ("corrupt", 11, "rank 1 sent a malformed payload"),
    ("stall", 12, "rank 1 (host"),
    ("kill", 13, "killed by signal 9 (SIGKILL)"),
    ("exit", 14, "exited with code 3"),
])
def test_the_first_failure_is_reported_with_its_own_exit_code(mode, code, says):
    before = _leftovers_now()
    t0 = time.monotonic()
    proc = _stellarun("-np", "4", "--clusters", "2", sys.executable, "tests/scripts/faulty_rank.py", mode)
    out = proc.stdout + proc.stderr
    assert proc.returncode == code, out[-3000:]
    assert time.monotonic() - t0 < 40
    report = [ln for ln in out.splitlines() if "failed first:" in ln]
    assert len(report) == 1 and says in report[0], out[-3000:]
    assert not _leftovers_now() - before, "MPICH files left: %s" % sorted(_leftovers_now() - before)


def test_a_rank_frozen_at_start_up_is_named():
    """Before MPI_Init nobody can ask where a rank is; stellarun looks at the processes."""
    proc = _stellarun("-np", "3", sys.executable, "tests/scripts/faulty_rank.py", "stop_at_start")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 12, out[-3000:]
    assert re.search(r"rank 1 \(host [^,]+, pid \d+\) was stopped", out), out[-3000:]


def test_a_job_that_succeeds_exits_0():
    proc = _stellarun("-np", "2", sys.executable, "-c", "import stella_mpi as hvd, torch; hvd.init(); "
                      "hvd.allreduce(torch.ones(3)); print('ok', hvd.rank())")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "failed first" not in proc.stdout


def _long_job():
    if mpirun_path() is None or not os.path.exists(STELLARUN):
        pytest.skip("no mpirun or stellarun")
    script = ("import time, torch, stella_mpi as hvd\nhvd.init()\n"
              "for i in range(3000):\n    hvd.allreduce(torch.ones(4), name='s%d' % i); time.sleep(0.02)\n")
    return subprocess.Popen([STELLARUN, "-np", "2", sys.executable, "-c", script], cwd=ROOT,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _job_processes(launcher_pid):
    """Processes of the job started by ``launcher_pid`` (they carry its status directory)."""
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open("/proc/%s/cmdline" % pid, "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if "stellarun.rank" in cmd and "hvd.allreduce(torch.ones(4)" in cmd:
                out.append(int(pid))
    return out


def _wait_for_ranks(proc, n):
    end = time.monotonic() + 60
    while len(_job_processes(proc.pid)) < n and time.monotonic() < end:
        time.sleep(0.2)
    assert len(_job_processes(proc.pid)) >= n


def test_killing_stellarun_takes_its_job_down():
    proc = _long_job()
    _wait_for_ranks(proc, 2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    end = time.monotonic() + 15
    while _job_processes(proc.pid) and time.monotonic() < end:
        time.sleep(0.2)
    assert not _job_processes(proc.pid), "ranks still running after stellarun was killed"


def test_sigterm_stops_the_job_and_says_so():
    proc = _long_job()
    _wait_for_ranks(proc, 2)
    os.kill(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, out[-2000:]
    assert "stopped by SIGTERM" in out
    assert not _job_processes(proc.pid)


def test_clean_removes_only_unused_files(tmp_path):
    from stellarun import leftovers
    used_path = "/dev/shm/mpich_shm_stellatest_used_%d" % os.getpid()
    stale_path = "/dev/shm/mpich_shm_stellatest_stale_%d" % os.getpid()
    for p in (used_path, stale_path):
        with open(p, "wb") as f:
            f.write(b"x")
    held = open(used_path, "rb")   # in use by this process
    try:
        removed = leftovers.remove_unused()
        assert stale_path in removed and used_path not in removed
        assert os.path.exists(used_path) and not os.path.exists(stale_path)
    finally:
        held.close()
        for p in (used_path, stale_path):
            if os.path.exists(p):
                os.unlink(p)
