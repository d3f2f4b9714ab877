"""Elastic training on this machine (stellarun --elastic, hvd.elastic): two pretend hosts
(``localhost`` and ``127.0.0.1``, one cluster each) found by a discovery script the test edits.
A host is revoked (left out of discovery, its workers SIGKILLed at a random step): training goes
on with the other host's ranks, losing at most the steps since the last commit; the host comes
back and its ranks rejoin; at the end every rank holds the same parameters and nothing is left
behind."""
import glob
import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest

import elastic_harness as eh
from mpi_launch import ROOT, mpirun_path

pytestmark = pytest.mark.mpi
COMMIT_EVERY = 5


def _wait(cond, timeout, what, log):
    got = eh.wait(cond, timeout, poll=0.2)
    if not got:
        pytest.fail("%s within %.0f s\n%s" % (what, timeout, eh.read(log)[-4000:]))
    return got


@pytest.fixture
def hosts(tmp_path):
    if mpirun_path() is None:
        pytest.skip("no mpirun (pip install mpich)")
    return eh.discovery(tmp_path, [("localhost", 2), ("127.0.0.1", 2)])


def _launch(tmp_path, script, steps, engine="sync"):
    route = ["--route", "fragments"] if engine == "fragments" else ["--engine", engine]
    return eh.launch(tmp_path, script, 4, steps, train_args=["--commit-every", str(COMMIT_EVERY),
                                                              "--step-sleep", "0.05"] + route)


@pytest.mark.parametrize("engine", ["sync", pytest.param("cpu", marks=pytest.mark.slow),
                                    pytest.param("fragments", marks=pytest.mark.slow)])
def test_revoked_host_is_survived_and_rejoins(tmp_path, hosts, engine):
    """(engine="cpu": its state is sharded over the ranks, so only the root's load holds the
    commit, and the resume syncs that; a state_dict() there is collective and stalled it.
    "fragments": local steps in two fragments with a delay, through SparseLoCo; every
    fragment's outer state and anchor travel in the commit.)"""
    listing, script = hosts
    before = set(glob.glob("/tmp/stella-elastic-*"))
    proc, log, out, f = _launch(tmp_path, script, steps=120, engine=engine)
    _progress, _workers = eh.progress, eh.workers
    try:
        kill_at = random.Random().randint(12, 30)
        _wait(lambda: any(s >= kill_at and n == 4 for s, n, _ in _progress(log)), 120, "4 ranks reach step %d" % kill_at,
              log)
        # revoke 127.0.0.1: gone from discovery, its workers killed without warning
        eh.write_hosts(listing, [("localhost", 2)])
        victims = _workers("127.0.0.1")
        assert len(victims) == 2, victims
        killed_at = max(s for s, _, _ in _progress(log))
        t_kill = time.time()
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        resumed = _wait(lambda: [(s, t) for s, n, t in _progress(log) if n == 2], 30,
                        "training goes on with the 2 surviving ranks", log)
        first_step, first_t = resumed[0]
        resumed_from = first_step - 1          # rolled back to the last commit ...
        assert resumed_from % COMMIT_EVERY == 0, (first_step, killed_at)
        assert killed_at - COMMIT_EVERY <= resumed_from <= killed_at + 1, (first_step, killed_at)
        assert first_t - t_kill < 30           # ... and going on within 30 s
        # the host comes back: its ranks rejoin at the next commit
        eh.write_hosts(listing, [("localhost", 2), ("127.0.0.1", 2)])
        t_back = time.time()
        rejoined = _wait(lambda: [(s, t) for s, n, t in _progress(log) if n == 4 and t > t_back], 90,
                         "the returning host's ranks rejoin", log)
        assert rejoined[0][1] - t_back < 90
    finally:
        rc = eh.finish(proc, f)
    text = eh.read(log)
    assert rc == 0, text[-4000:]
    with open(out) as fh:
        result = json.load(fh)
    assert result == {**result, "steps": 120, "size": 4, "identical": True}, result
    assert "host 127.0.0.1 left (revoked)" in text
    assert not _workers("localhost") and not _workers("127.0.0.1")
    assert set(glob.glob("/tmp/stella-elastic-*")) <= before


@pytest.mark.slow
def test_a_failing_host_still_listed_is_blacklisted_and_the_job_goes_on(tmp_path, hosts):
    """A rank that dies while its host is still listed: the host is blacklisted (for good, no
    cooldown given) and the job finishes on the other host."""
    listing, script = hosts
    proc, log, out, f = _launch(tmp_path, script, steps=40)
    try:
        _wait(lambda: any(s >= 8 for s, _, _ in eh.progress(log)), 120, "step 8", log)
        os.kill(eh.workers("127.0.0.1")[0], signal.SIGKILL)
    finally:
        rc = eh.finish(proc, f)
    text = eh.read(log)
    assert rc == 0, text[-4000:]
    assert "host 127.0.0.1 failed; blacklisted for good" in text
    with open(out) as fh:
        result = json.load(fh)
    assert result["steps"] == 40 and result["size"] == 2 and result["identical"]


@pytest.mark.slow
def test_a_script_error_ends_the_elastic_job(tmp_path, hosts):
    """An uncaught exception is the script's own bug, not a lost host: no reset loop."""
    listing, script = hosts
    proc, log, out, f = eh.launch(tmp_path, script, 4, 40, train_args=["--raise-at", "3"])
    rc = eh.finish(proc, f, timeout=120)
    text = eh.read(log)
    assert rc == 10, text[-3000:]
    assert "raised an exception (not a lost host)" in text and "a bug in the training script" in text
    assert "reset 1" not in text


def test_a_failure_on_another_host_is_reported_by_the_launching_host(tmp_path, monkeypatch):
    """Every rank acts as on a host other than stellarun's (STELLARUN_PRETEND_REMOTE): its status
    directory is its supervisor's own, so its record reaches stellarun only as a marker line on
    mpirun's stderr. stellarun still reports the exception (and does not take it for a lost
    host), shows no marker line, and every status directory is gone afterwards."""
    if mpirun_path() is None:
        pytest.skip("no mpirun (pip install mpich)")
    listing, script = eh.discovery(tmp_path, [("localhost", 1), ("127.0.0.1", 1)])
    monkeypatch.setenv("STELLARUN_PRETEND_REMOTE", "localhost,127.0.0.1")
    before = set(glob.glob("/tmp/stellarun-status-*"))
    proc, log, out, f = eh.launch(tmp_path, script, 2, 20, train_args=["--raise-at", "3"])
    rc = eh.finish(proc, f, timeout=120)
    text = eh.read(log)
    assert rc == 10, text[-3000:]
    assert re.search(r"stellarun: rank 0 \(host [^,]+, pid \d+\) failed first: exception: .*a bug in the training "
                     r"script", text), text[-3000:]
    assert "raised an exception (not a lost host)" in text and "reset 1" not in text, text[-3000:]
    assert "stellarun-status:" not in text
    from stellarun import status
    assert set(glob.glob("/tmp/stellarun-status-*")) - before <= {d for d in glob.glob("/tmp/stellarun-status-*")
                                                                  if status.launcher_alive(d)}   # (another job's)
    # each pretend host's janitor cleans up after the job and ends
    assert eh.wait(lambda: not _janitors(), 30), "a janitor is still running"


def _janitors():
    found = []
    for path in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(path, "rb") as f:
                cmd = f.read().split(b"\0")
        except OSError:
            continue
        if b"stellarun.rank" in cmd and b"--janitor" in cmd:
            found.append(path)
    return found


@pytest.mark.slow
def test_a_link_outage_longer_than_the_timeout_cuts_a_cluster_off_and_it_rejoins(tmp_path, hosts):
    """--elastic --wan: the link goes down for longer than STELLA_TIMEOUT. The cluster on the far
    side of rank 0 is cut off and the other goes on from the last commit; once the link is back
    and the retry time has passed, the cut-off cluster rejoins; the job ends with identical
    parameters on 4 ranks and its namespaces removed."""
    text, log, out = _outage(tmp_path, hosts, 600, "12:down,40:100mbit", 300)
    down = float(re.search(r"WAN link down \(t=12 s, unix time ([0-9.]+)\)", text).group(1))
    up = float(re.search(r"the link is up again \(t=40 s, unix time ([0-9.]+)\)", text).group(1))
    assert "cluster b (host 127.0.0.1) was cut off" in text and "blacklisted" not in text, text[-4000:]
    steps = eh.progress(log)
    before = max((s for s, n, t in steps if n == 4 and t < down), default=0)   # 0: the link went down in start-up
    alone = [(s, t) for s, n, t in steps if n == 2]
    assert alone and alone[0][1] - down < 8 + 30, text[-4000:]   # the timeout, then going on within 30 s
    resumed_from = alone[0][0] - 1
    assert resumed_from % COMMIT_EVERY == 0 and before - COMMIT_EVERY <= resumed_from <= before, (alone[0], before)
    rejoined = [t for s, n, t in steps if n == 4 and t > up]
    assert rejoined and rejoined[0] - up < 90, text[-4000:]
    with open(out) as fh:
        result = json.load(fh)
    assert result == {**result, "steps": 600, "size": 4, "identical": True}, result


@pytest.mark.slow
def test_a_cluster_retried_while_the_link_is_still_down_is_cut_off_again(tmp_path, hosts):
    """The retry time (here --blacklist-cooldown-range 5 5) passes while the link is still down:
    the cut-off cluster is let back in, the start-up's deadline (hvd.init's first collective)
    finds its ranks silent again, and it is cut off again, never blacklisted; the survivors go on
    from their last commit each time; once the link is back it rejoins for good."""
    text, log, out = _outage(tmp_path, hosts, 900, "12:down,50:100mbit", 400, ["--blacklist-cooldown-range", "5", "5"])
    up = float(re.search(r"the link is up again \(t=50 s, unix time ([0-9.]+)\)", text).group(1))
    cuts = re.findall(r"cluster b \(host 127\.0\.0\.1\) was cut off", text)
    assert len(cuts) >= 2 and "blacklisted" not in text, text[-6000:]
    steps = eh.progress(log)
    rejoined = [t for s, n, t in steps if n == 4 and t > up]
    assert rejoined and rejoined[0] - up < 90, text[-4000:]
    with open(out) as fh:
        result = json.load(fh)
    assert result == {**result, "steps": 900, "size": 4, "identical": True}, result


def _outage(tmp_path, hosts, steps, schedule, timeout, extra=()):
    """Run an elastic job of 4 ranks in 2 clusters for ``steps`` over an emulated 100 Mbit/s link
    with ``schedule`` (its outage), STELLA_TIMEOUT 8 s and commits every COMMIT_EVERY steps; it
    must end with exit 0 and leave nothing behind. Returns (log text, log path, result path)."""
    from stellarun import wan
    ok, why = wan.namespaces_available()
    if not ok:
        pytest.skip("network namespaces unavailable here: %s" % why)
    listing, script = hosts
    proc, log, out, f = eh.launch(tmp_path, script, 4, steps,
                                  extra=["--wan", "100mbit", "--wan-schedule", schedule, "--timeout", "8"] + list(extra),
                                  train_args=["--commit-every", str(COMMIT_EVERY), "--step-sleep", "0.1"])
    try:
        rc = eh.finish(proc, f, timeout=timeout)
    finally:
        if not f.closed:
            f.close()
    text = eh.read(log)
    assert rc == 0, text[-4000:]
    assert wan.leftovers(proc.pid) == [] and not eh.workers()
    return text, log, out


def test_without_elastic_a_killed_rank_ends_the_job_naming_it(tmp_path):
    """Not elastic: as before, the job ends and says which rank."""
    if mpirun_path() is None:
        pytest.skip("no mpirun")
    log = tmp_path / "job.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(eh.STELLARUN + ["-np", "2", "--clusters", "2", "--timeout", "30", sys.executable, eh.SCRIPT,
                                                "--steps", "400", "--step-sleep", "0.05"],
                                stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        try:
            _wait(lambda: any(s >= 5 for s, _, _ in eh.progress(log)), 60, "step 5", log)
            t0 = time.time()
            os.kill(eh.workers()[-1], signal.SIGKILL)
            rc = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert rc != 0 and time.time() - t0 < 30
    assert re.search(r"rank \d \(host .*\) failed first", eh.read(log))
