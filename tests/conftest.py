"""Test-run setup. tests/mpi holds suites that run inside every rank under mpirun
(launched by test_mpi_suites.py with STELLA_MPI_SUITE=1); the plain test run skips them, so
the runner itself never initializes MPI."""
import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

collect_ignore = [] if os.environ.get("STELLA_MPI_SUITE") == "1" else ["mpi"]


@pytest.fixture(scope="session", autouse=True)
def _no_mpich_files_left():
    """Jobs that tests end on purpose (a killed rank, a deadline, a timeout) leave MPICH's
    shared-memory segments (/dev/shm/mpich_shm_*, a few MB each) and hydra's topology files
    (/tmp/hydra_hwloc_xmlfile_*) behind. stellarun and mpi_launch.run_job remove those of their
    own jobs; this net removes, at the end of the run, those created during it that no running
    process uses and that some other launch path left (one segment and one topology file after
    test_faults, test_stall_inspector, test_stellarun_failures and test_elastic)."""
    started = time.time()
    yield
    if os.environ.get("STELLA_MPI_SUITE") == "1":   # inside the ranks of a launched suite: the runner's job
        return
    if os.environ.get("STELLA_TESTS_NO_SWEEP") == "1":   # a run beside another (scripts/run_tests.sh): its job
        return
    from stellarun import leftovers
    made = leftovers.candidates(since=started - 1)
    leftovers.remove_after_job(set(made), since=started - 1, settle_s=5.0)
