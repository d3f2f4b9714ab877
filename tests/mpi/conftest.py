"""Runs inside every rank (pytest under mpirun). A failed test aborts the whole job at once:
the other ranks would otherwise wait in a collective that never comes."""
import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def hvd_session():
    import stella_mpi as hvd
    hvd.init()
    yield hvd
    hvd.shutdown()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        from mpi4py import MPI
        msg = "\nrank %d: %s FAILED:\n%s\n" % (MPI.COMM_WORLD.Get_rank(), item.nodeid, report.longreprtext)
        os.write(2, msg.encode(errors="replace"))  # past pytest's capture: the job ends right after
        MPI.COMM_WORLD.Abort(1)
