"""stellarun says on stderr what it waits for, once when the wait begins: the ranks starting
(how many, for how long at most), an elastic job short of hosts (and when it has them again);
--quiet leaves those lines out. (The emulated WAN's set-up line: tests/test_wan.py's jobs.)"""
import argparse
import sys

import pytest

from stellarun import cli, elastic, progress


@pytest.fixture(autouse=True)
def _loud():
    progress.QUIET = False
    yield
    progress.QUIET = False


def _args(**kw):
    base = dict(dry_run=False, verbose=False, start_timeout=None, timeout=None)
    base.update(kw)
    return argparse.Namespace(**base)


def test_the_start_up_wait_names_the_ranks_and_its_bound(capfd, monkeypatch):
    monkeypatch.delenv("STELLA_START_TIMEOUT", raising=False)
    monkeypatch.delenv("STELLA_TIMEOUT", raising=False)
    job = cli.counted(lambda status_dir: [sys.executable, "-c", "pass"], 4)   # an "mpirun" that ends at once
    assert cli.run_job(_args(timeout=60.0), job) == 0
    err = capfd.readouterr().err
    assert err.count("stellarun: waiting for 4 ranks to start (MPI_Init, hvd.init(); up to 60 s)") == 1, err
    assert progress.start_timeout(_args(start_timeout=15.0, timeout=60.0), {}) == 15.0
    assert progress.start_timeout(_args(), {"STELLA_TIMEOUT": "30"}) == 30.0
    assert progress.start_timeout(_args(), {}) == 120.0   # stella_mpi's default (base/config.py)


def test_quiet_leaves_the_lines_out(capfd):
    assert cli.parse(["--quiet", "-np", "2", "python", "t.py"]).quiet
    progress.QUIET = True
    assert cli.run_job(_args(), cli.counted(lambda status_dir: [sys.executable, "-c", "pass"], 2)) == 0
    assert "waiting" not in capfd.readouterr().err


def test_an_elastic_job_short_of_hosts_says_so_once(capfd, monkeypatch):
    args = argparse.Namespace(host_discovery_script=None, static_hosts=[("localhost", 2)], min_np=2, max_np=2, np=2,
                              cluster_labels={}, blacklist_cooldown_range=None, wan=None, elastic_timeout=30.0)
    driver = elastic.ElasticDriver(args, None, None)
    try:
        answers = [[("localhost", 1)]] * 3 + [[("localhost", 1), ("127.0.0.1", 1)]]
        monkeypatch.setattr(driver.discovery, "hosts", lambda: answers.pop(0))
        monkeypatch.setattr(elastic, "DISCOVERY_INTERVAL_S", 0.01)
        driver.cut_off["127.0.0.2"] = elastic.time.monotonic() + 60
        assert driver.wait_for_hosts() == [("localhost", 1), ("127.0.0.1", 1)]
    finally:
        elastic.shutil.rmtree(driver.base, ignore_errors=True)
    err = capfd.readouterr().err
    assert err.count("waiting for") == 1, err
    assert ("stellarun: elastic: waiting for a host to return: 1 of the 2 slots --min-np needs (hosts: localhost:1; "
            "left out: 127.0.0.2; up to 30 s)") in err
    assert "stellarun: elastic: 2 slots after 0 s; forming the job" in err
