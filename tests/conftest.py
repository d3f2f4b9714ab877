"""Test-run setup. tests/mpi holds suites that run inside every rank under mpirun
(launched by test_mpi_suites.py with STELLA_MPI_SUITE=1); the plain test run skips them, so
the runner itself never initializes MPI."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

collect_ignore = [] if os.environ.get("STELLA_MPI_SUITE") == "1" else ["mpi"]
