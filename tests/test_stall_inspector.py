"""Horovod's stall inspector: a collective that some ranks have submitted and others not is
named, with the missing ranks, after HOROVOD_STALL_CHECK_TIME_SECONDS; it ends the job after
HOROVOD_STALL_SHUTDOWN_TIME_SECONDS."""
import os
import subprocess
import sys

import pytest

from mpi_launch import ROOT, mpirun_path, run_mpi

pytestmark = pytest.mark.mpi


def test_a_stall_is_named_and_then_resolves():
    proc = run_mpi(2, ["tests/scripts/stall_rank.py", "4"], env={"HOROVOD_STALL_CHECK_TIME_SECONDS": "1"},
                   timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "stall inspector" in out, out[-3000:]
    assert "'lonely' (process set 0): submitted by rank(s) 0; missing rank(s) 1" in out, out[-3000:]
    assert out.count("done") == 2


def test_stall_shutdown_ends_the_job_naming_the_missing_rank():
    """Under stellarun (which reports the cause and removes what MPICH leaves after an abort)."""
    stellarun = os.path.join(os.path.dirname(sys.executable), "stellarun")
    if mpirun_path() is None or not os.path.exists(stellarun):
        pytest.skip("no mpirun or stellarun")
    env = dict(os.environ, STELLA_TIMEOUT="60", PYTHONUNBUFFERED="1", HOROVOD_STALL_CHECK_TIME_SECONDS="1",
               HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="3")
    proc = subprocess.run([stellarun, "-np", "3", sys.executable, "tests/scripts/stall_rank.py", "60"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 12, out[-3000:]   # stellarun's code for a deadline
    assert "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS" in out, out[-3000:]
    assert "rank 2 (host" in out and "never submitted it" in out, out[-3000:]
    assert "done" not in out
