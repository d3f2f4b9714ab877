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


@pytest.fixture(autouse=True)
def dense_wan_route(request, monkeypatch):
    """These suites compare against single-process references of Horovod's dense numerics, in
    one- and two-cluster layouts alike: STELLA_WAN_ROUTE=dense, unless a test is marked
    ``auto_route`` (it tests the automatic route itself)."""
    if request.node.get_closest_marker("auto_route") is None:
        monkeypatch.setenv("STELLA_WAN_ROUTE", "dense")
    else:
        monkeypatch.delenv("STELLA_WAN_ROUTE", raising=False)


def pytest_configure(config):
    config.addinivalue_line("markers", "auto_route: runs with STELLA_WAN_ROUTE unset (the automatic route)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        from mpi4py import MPI
        msg = "\nrank %d: %s FAILED:\n%s\n" % (MPI.COMM_WORLD.Get_rank(), item.nodeid, report.longreprtext)
        os.write(2, msg.encode(errors="replace"))  # past pytest's capture: the job ends right after
        MPI.COMM_WORLD.Abort(1)
