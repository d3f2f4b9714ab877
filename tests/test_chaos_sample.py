"""A fixed sample of the chaos soak (tests/chaos_soak.py, whose full run is its own command):
a NaN gradient on one rank of local steps under mpirun (survived: the job ends with identical,
finite parameters), and garbage THC scales from one rank under stellarun (the job ends, naming
that rank); neither may hang or leave anything behind."""
import json
import os
import sys

import pytest

from mpi_launch import ROOT, mpirun_path

# (slow: the default run's 10 minutes; the failure modes it samples have their own tests in
# test_faults.py and test_stellarun_failures.py)
pytestmark = [pytest.mark.mpi, pytest.mark.slow]
sys.path.insert(0, os.path.join(ROOT, "tests"))


def test_a_fixed_sample_of_the_chaos_soak(tmp_path):
    if mpirun_path() is None:
        pytest.skip("no mpirun (pip install mpich)")
    import chaos_soak
    out = tmp_path / "chaos.json"
    rc = chaos_soak.main(["--seed", "7", "--case", "local/nan/mpirun", "--case", "thc/garbage/stellarun",
                          "--out", str(out)])
    rows = json.loads(out.read_text())["trials"]
    assert rc == 0, json.dumps(rows, indent=1)[-4000:]
    assert [(r["survived"], bool(r["named"])) for r in rows] == [(True, False), (False, True)]
    assert all(r["applied"] and not r["hung"] for r in rows)
