"""Run a bench script's worker as an MPI job of two clusters of one rank each, with the link
between them paced in user space, and return what its rank 0 wrote (JSON).

The script takes ``--worker --worker-out PATH`` and its own arguments; the job is started with
the environment's mpirun through tests/mpi_launch.run_job, so no MPICH file is left behind."""
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_two_clusters(script, worker_args, rate_bps, threads, timeout):
    from tests.mpi_launch import mpirun_path, run_job
    fd, worker_out = tempfile.mkstemp(prefix="stella_bench_", suffix=".json")
    os.close(fd)
    env = dict(os.environ, STELLA_CLUSTERS="2", STELLA_WAN_PACE_BPS=str(rate_bps), OMP_NUM_THREADS=str(threads),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [mpirun_path(), "-np", "2", sys.executable, "-m", "mpi4py", os.path.abspath(script), "--worker",
           "--worker-out", worker_out] + [str(a) for a in worker_args]
    try:
        run_job(cmd, timeout, env=env, check=True)
        with open(worker_out) as f:
            return json.load(f)
    finally:
        os.remove(worker_out)
