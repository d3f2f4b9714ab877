"""The Slurm batch scripts of examples/slurm/ on a real Slurm started on this machine
(tests/slurm_local.py: munged, slurmctld, two slurmd nodes): srun --mpi=pmi2 with the mpich
wheel, one cluster per node, and one per component of a heterogeneous job. Skips where Slurm
cannot be started. Not in the default test command: scripts/run_slurm_tests.sh installs Slurm
and runs these."""
import os
import re
import sys

import pytest

from mpi_launch import ROOT
from slurm_local import LocalSlurm, SlurmUnavailable

# behind their own command (scripts/run_slurm_tests.sh), as the house keeps long runs
pytestmark = [pytest.mark.mpi, pytest.mark.slurm, pytest.mark.slow]


@pytest.fixture(scope="module")
def slurm():
    local = LocalSlurm(nodes=2, cpus=2)
    try:
        local.start()
    except SlurmUnavailable as e:
        pytest.skip("no local Slurm: %s" % e)
    yield local
    local.close()


def _env():
    return {"STELLA_REPO": ROOT, "STELLA_PYTHON": sys.executable, "STELLA_TIMEOUT": "120", "OMP_NUM_THREADS": "1"}


def _check(rc, out):
    assert rc == 0, out[-4000:]
    assert "4 ranks in 2 clusters" in out, out[-4000:]
    assert "parameters identical on all 4 ranks: True" in out, out[-4000:]
    losses = [float(m.group(1)) for m in re.finditer(r"loss (\d+\.\d+)", out)]
    assert losses and losses[-1] < 5.55, out[-4000:]


def test_one_cluster_per_node(slurm):
    rc, out = slurm.sbatch(os.path.join(ROOT, "examples", "slurm", "train_two_clusters.sbatch"),
                           ["--steps", "20", "--log-every", "10", "--hidden", "256"], env=_env(), cwd=ROOT)
    _check(rc, out)
    assert "nodes n[1-2], 4 tasks" in out


def test_one_cluster_per_heterogeneous_component(slurm):
    rc, out = slurm.sbatch(os.path.join(ROOT, "examples", "slurm", "train_hetjob.sbatch"),
                           ["--steps", "20", "--log-every", "10", "--hidden", "256"], env=_env(), cwd=ROOT)
    _check(rc, out)
    assert "components on n1 and n2" in out


def test_a_failing_rank_ends_the_slurm_job(slurm, tmp_path):
    """A rank that raises ends the whole step (stella_mpi's fail-stop, srun --kill-on-bad-exit)."""
    script = tmp_path / "fail.sbatch"
    script.write_text("#!/bin/bash\n#SBATCH --nodes=2 --ntasks-per-node=1\nsrun --mpi=pmi2 --kill-on-bad-exit=1 "
                      "%s %s raise\n" % (sys.executable, os.path.join(ROOT, "tests", "scripts", "faulty_rank.py")))
    rc, out = slurm.sbatch(str(script), env=_env(), cwd=ROOT)
    assert rc != 0 and "boom on purpose" in out, out[-3000:]
