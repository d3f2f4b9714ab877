"""stellarun under failure: the first failed rank named with its cause, one exit code per kind
of failure, MPICH's files of the job removed, and the job gone when stellarun is killed."""
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from mpi_launch import ROOT, mpirun_path, tagged_processes

pytestmark = pytest.mark.mpi
STELLARUN = os.path.join(os.path.dirname(sys.executable), "stellarun")


def _unused_leftovers():
    from stellarun import leftovers
    return set(leftovers.candidates()) - (leftovers.in_use() or set())


def _stellarun(*args, timeout_s=30, env=None):
    if mpirun_path() is None or not os.path.exists(STELLARUN):
        pytest.skip("no mpirun or stellarun")
    full = dict(os.environ, STELLA_TIMEOUT=str(timeout_s), PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.run([STELLARUN] + list(args), cwd=ROOT, env=full, capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize("mode,code,says,timeout_s", [
    ("raise", 10, r"rank 1 \(host [^,]+, pid \d+\) failed first: exception: .*boom on purpose", 30),
    ("corrupt", 11, r"failed first: collective: .*rank 1 sent a malformed payload", 30),
    # the stalled rank's collective thread still cycles: the others see it never submitted step.0
    # (slow: the deadline's naming is tests/test_faults.py's; the exit code of a deadline is the same path)
    pytest.param("stall", 12, r"failed first: deadline: .*rank 1 \(host [^,]+, pid \d+\) never submitted it", 8,
                 marks=pytest.mark.slow),
    ("kill", 13, r"rank 1 \(host [^,]+, pid \d+\) failed first: signal: killed by signal 9 \(SIGKILL\)", 30),
    ("exit", 14, r"rank 1 \(host [^,]+, pid \d+\) failed first: exit: exited with code 3", 30),
])
def test_the_first_failure_is_reported_with_its_own_exit_code(mode, code, says, timeout_s):
    before = _unused_leftovers()
    # (one rank per cluster: rank 0 fails second, so one cause still has to win)
    proc = _stellarun("-np", "2", "--clusters", "2", sys.executable, "tests/scripts/faulty_rank.py", mode,
                      timeout_s=timeout_s)
    out = proc.stdout + proc.stderr
    assert proc.returncode == code, out[-3000:]
    report = [ln for ln in out.splitlines() if "failed first:" in ln]
    assert len(report) == 1 and re.search(says, report[0]), out[-3000:]
    assert not _unused_leftovers() - before, "MPICH files left: %s" % sorted(_unused_leftovers() - before)


def test_a_rank_frozen_at_start_up_is_named():
    """Before MPI_Init nobody can ask where a rank is; stellarun looks at the processes."""
    proc = _stellarun("-np", "2", sys.executable, "tests/scripts/faulty_rank.py", "stop_at_start", timeout_s=5)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 12, out[-3000:]
    assert re.search(r"rank 1 \(host [^,]+, pid \d+\) was stopped", out), out[-3000:]


def test_a_job_that_succeeds_exits_0():
    proc = _stellarun("-np", "2", sys.executable, "-c", "import stella_mpi as hvd, torch; hvd.init(); "
                      "hvd.allreduce(torch.ones(3)); print('ok', hvd.rank())")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "failed first" not in proc.stdout


def test_usage_errors_exit_2():
    proc = _stellarun("-np", "2", "--clusters", "3", sys.executable, "-c", "pass")
    assert proc.returncode == 2 and "--clusters 3 is more than the 2 ranks" in proc.stderr


def _job_processes(token):
    """The rank processes of the job whose environment carries ``token`` (not their supervisors)."""
    return [pid for pid, (cmd, _) in tagged_processes("STELLA_TEST_TOKEN", token).items()
            if len(cmd) > 1 and cmd[1] == b"-c"]   # python -c SCRIPT: not mpirun, stellarun or a supervisor


class _LongJob:
    """A 2-rank job under stellarun that runs for a minute; always torn down."""

    def __init__(self):
        if mpirun_path() is None or not os.path.exists(STELLARUN):
            pytest.skip("no mpirun or stellarun")
        self.token = "longjob%d_%d" % (os.getpid(), time.monotonic_ns())
        self.marks = tempfile.mkdtemp(prefix="stella-longjob-")
        script = ("import os, time, stella_mpi as hvd, torch\nhvd.init()\n"
                  "open(os.path.join(%r, str(hvd.rank())), 'w').close()\n"
                  "for i in range(3000):\n    hvd.allreduce(torch.ones(4), name='s%%d' %% i); time.sleep(0.02)\n"
                  % self.marks)
        self.proc = subprocess.Popen([STELLARUN, "-np", "2", sys.executable, "-c", script], cwd=ROOT,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1", STELLA_TEST_TOKEN=self.token),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)

    def ranks(self):
        return _job_processes(self.token)

    def wait_for_ranks(self, n=2):
        """Until ``n`` ranks are past hvd.init() and training."""
        end = time.monotonic() + 90
        while len(os.listdir(self.marks)) < n and time.monotonic() < end and self.proc.poll() is None:
            time.sleep(0.2)
        assert len(os.listdir(self.marks)) >= n, "the ranks did not get through hvd.init()"

    def close(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for pid in self.ranks():
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.marks, ignore_errors=True)


def test_killing_stellarun_takes_its_job_down():
    job = _LongJob()
    try:
        job.wait_for_ranks()
        os.kill(job.proc.pid, signal.SIGKILL)
        job.proc.wait(timeout=10)
        end = time.monotonic() + 15
        while job.ranks() and time.monotonic() < end:
            time.sleep(0.2)
        assert not job.ranks(), "ranks still running after stellarun was killed"
    finally:
        job.close()


def test_sigterm_stops_the_job_and_says_so():
    job = _LongJob()
    try:
        job.wait_for_ranks()
        os.kill(job.proc.pid, signal.SIGTERM)
        out, _ = job.proc.communicate(timeout=30)
        assert job.proc.returncode == 128 + signal.SIGTERM, out[-2000:]
        assert "stopped by SIGTERM" in out and "failed first" not in out, out[-2000:]
        end = time.monotonic() + 10
        while job.ranks() and time.monotonic() < end:
            time.sleep(0.2)
        assert not job.ranks()
    finally:
        job.close()


def test_clean_removes_only_unused_old_files_of_this_user(tmp_path, monkeypatch):
    from stellarun import leftovers
    shm, hw = tmp_path / "shm", tmp_path / "tmp"
    shm.mkdir()
    hw.mkdir()
    monkeypatch.setattr(leftovers, "PATTERNS", ((str(shm), "mpich_shm_"), (str(hw), "hydra_hwloc_xmlfile_")))
    old = time.time() - 3600
    paths = {name: str(d / name) for d, name in ((shm, "mpich_shm_used"), (shm, "mpich_shm_stale"),
                                                 (hw, "hydra_hwloc_xmlfile_stale"), (shm, "mpich_shm_young"))}
    for name, p in paths.items():
        with open(p, "wb") as f:
            f.write(b"x")
        if name != "mpich_shm_young":
            os.utime(p, (old, old))
    held = open(paths["mpich_shm_used"], "rb")   # in use by this process
    try:
        removed = leftovers.remove_unused()
    finally:
        held.close()
    assert paths["mpich_shm_stale"] in removed and paths["hydra_hwloc_xmlfile_stale"] in removed
    assert os.path.exists(paths["mpich_shm_used"]) and os.path.exists(paths["mpich_shm_young"])
