"""The Horovod-style example trains on 4 ranks in 2 clusters (launched by stellarun) and
ends with identical parameters on every rank."""
import os
import subprocess
import sys

import pytest

from mpi_launch import ROOT

pytestmark = pytest.mark.mpi


def test_example_trains_and_parameters_agree():
    stellarun = os.path.join(os.path.dirname(sys.executable), "stellarun")
    if not os.path.exists(stellarun):
        pytest.skip("stellarun is not installed in this environment")
    proc = subprocess.run([stellarun, "-np", "4", "--clusters", "2", "--timeout", "60", sys.executable,
                           "examples/train_horovod.py", "--steps", "40", "--log-every", "20"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "4 ranks in 2 clusters" in out
    assert "parameters identical on all 4 ranks: True" in out
    losses = [float(line.split("loss")[1].split()[0]) for line in out.splitlines() if line.startswith("step")]
    assert len(losses) == 2 and losses[-1] < 5.55  # below the uniform-guess loss ln(256)
