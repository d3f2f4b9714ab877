"""Helpers for tests that launch ranks with mpirun, with a timeout."""
import os
import shutil
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mpirun_path():
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return here if os.path.exists(here) else shutil.which("mpirun")


def run_job(cmd, timeout, **kwargs):
    """``subprocess.run(cmd, timeout=timeout, **kwargs)`` for an MPI job started with plain
    mpirun, then what stellarun does after a job: MPICH's shared-memory segments and hydra's
    topology files created meanwhile that no running process uses are removed (a job that ends
    badly leaves them: a killed rank never unlinks its segment). The CompletedProcess carries
    the removed paths as ``leftovers_removed``; a timeout is raised after the clean-up."""
    from stellarun import leftovers
    since = time.time() - 1
    proc = None
    try:
        proc = subprocess.run(cmd, timeout=timeout, **kwargs)
        return proc
    finally:
        made = leftovers.candidates(since=since)
        removed = leftovers.remove_after_job(set(made), since=since)
        if proc is not None:
            proc.leftovers_removed = removed


def _job_env(extra):
    """The environment of a launched job: no inherited cluster layout, one BLAS thread per
    rank, a deadline, and the flag that lets the per-rank suites be collected."""
    env = dict(os.environ)
    env.pop("STELLA_CLUSTER", None)
    env.pop("STELLA_CLUSTERS", None)
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "STELLA_TIMEOUT": "60", "STELLA_MPI_SUITE": "1"})
    env.update(extra or {})
    return env


def run_mpi(np_, args, env=None, timeout=240, cwd=ROOT):
    """Run ``python -m mpi4py ARGS`` on ``np_`` ranks; returns the CompletedProcess.

    ``python -m mpi4py`` makes an uncaught exception on any rank abort the whole job, and
    the timeout bounds the run even if something hangs."""
    launcher = mpirun_path()
    if launcher is None:
        pytest.skip("no mpirun found (pip install mpich)")
    full_env = _job_env(env)
    cmd = [launcher, "-np", str(np_), sys.executable, "-m", "mpi4py"] + list(args)
    try:
        return run_job(cmd, timeout, env=full_env, cwd=cwd, capture_output=True, text=True)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        pytest.fail("mpirun -np %d %s timed out after %ds\n%s\n%s" % (np_, " ".join(args), timeout, out[-4000:],
                                                                     err[-4000:]))


def run_mpmd(parts, timeout=240, env=None):
    """MPMD launch: ``parts`` is a list of (nranks, extra_env, args) run as one MPI job
    (used to give ranks different STELLA_CLUSTER labels)."""
    launcher = mpirun_path()
    if launcher is None:
        pytest.skip("no mpirun found (pip install mpich)")
    cmd = [launcher]
    for i, (n, penv, args) in enumerate(parts):
        if i:
            cmd.append(":")
        cmd += ["-n", str(n)]
        for k, v in penv.items():
            cmd += ["-env", k, v]
        cmd += [sys.executable, "-m", "mpi4py"] + list(args)
    full_env = _job_env(env)
    return run_job(cmd, timeout, env=full_env, cwd=ROOT, capture_output=True, text=True)


def tagged_processes(var, value):
    """{pid: (command line, environment)} of the running processes whose environment has
    ``var=value`` (how a test finds the processes of the job it started)."""
    out = {}
    want = ("%s=%s" % (var, value)).encode()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open("/proc/%s/environ" % pid, "rb") as f:
                raw = f.read().split(b"\0")
            if want not in raw:
                continue
            with open("/proc/%s/cmdline" % pid, "rb") as f:
                cmd = f.read().split(b"\0")
        except OSError:
            continue
        out[int(pid)] = (cmd, dict(kv.split(b"=", 1) for kv in raw if b"=" in kv))
    return out
