"""PyTorch Lightning with stella's DDP hook (examples/train_lightning.py) under stellarun, 2
clusters, on CPU: Lightning's DDPStrategy API (StellaDDPStrategy, which also registers the hook
on CPU), the hook's sparse route across clusters, identical parameters on every rank. Skips
where lightning is not installed (``pip install stella_mpi[lightning]``; scripts/setup_env.sh
installs it)."""
import json
import os
import subprocess
import sys

import pytest

from mpi_launch import ROOT

pytestmark = pytest.mark.mpi
pytest.importorskip("lightning", reason="lightning is not installed (pip install stella_mpi[lightning])")

STEPS = 30


def test_lightning_trains_through_the_hook_across_two_clusters(tmp_path):
    out = tmp_path / "lightning.json"
    stellarun = os.path.join(os.path.dirname(sys.executable), "stellarun")
    cmd = [stellarun, "-np", "2", "--clusters", "2", "--timeout", "120", sys.executable, "examples/train_lightning.py",
           "--steps", str(STEPS), "--compression", "cacheaware", "--density", "0.01", "--json-out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = json.loads(out.read_text())
    print(result)
    assert result["identical"] and result["steps"] == STEPS
    assert result["hook_steps"] == STEPS          # every step's buckets went through stella_hook
    dense = 4 * result["parameters"] * STEPS      # what dense steps would send from this rank
    assert 0 < result["wan_bytes_sent"] < 0.5 * dense, (result["wan_bytes_sent"], dense)
