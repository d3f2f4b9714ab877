"""The records of how ranks ended: stella_mpi (comm/abort.py) and stellarun's rank supervisor
write the same format, stellarun reads both and reports the earliest, first cause of a rank
wins; the supervisor passes the rank's exit status on."""
import json
import os
import signal
import subprocess
import sys
import time

from mpi_launch import ROOT


def test_both_writers_agree_and_the_first_cause_of_a_rank_wins(tmp_path):
    from stellarun import status
    # stella_mpi's writer, in a child process (importing stella_mpi starts MPI)
    code = ("from stella_mpi.comm.abort import record_status\n"
            "record_status('deadline', 'rank 1 never came', rank=0, silent=[1, 3])\n"
            "record_status('collective', 'a later cause of the same rank', rank=0)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, STELLA_STATUS_DIR=str(tmp_path)))
    assert proc.returncode == 0, proc.stderr
    status.record(str(tmp_path), 2, "signal", "killed by signal 9 (SIGKILL)", pid=123)
    records = status.read_all(str(tmp_path))
    assert [r["rank"] for r in records] == [0, 2]
    assert all(set(r) - {"silent"} == set(status.FIELDS) for r in records)
    assert records[0]["silent"] == [1, 3] and "silent" not in records[1]   # who did not answer the deadline's
    with open(tmp_path / "rank0.json") as f:
        assert json.load(f)["detail"] == "rank 1 never came"
    line, code = status.report(records)
    assert line.startswith("rank 0 (host ") and "deadline: rank 1 never came" in line and "1 more rank" in line
    assert code == status.EXIT_CODES["deadline"]


def test_malformed_records_are_ignored(tmp_path):
    from stellarun import status
    (tmp_path / "rank5.json").write_text("{not json")
    (tmp_path / "rank6.json").write_text(json.dumps({"rank": 6, "cause": "made up"}))
    assert status.read_all(str(tmp_path)) == [] and status.report([]) == (None, 0)
    bad = {"rank": 7, "host": "h", "pid": 1, "time": 0.0, "cause": "deadline", "detail": "d", "silent": ["x", 2]}
    (tmp_path / "rank7.json").write_text(json.dumps(bad))
    assert [set(r) for r in status.read_all(str(tmp_path))] == [set(bad) - {"silent"}]   # a bad "silent" is dropped


def test_the_supervisor_records_a_signal_and_ends_the_same_way(tmp_path):
    env = dict(os.environ, STELLA_STATUS_DIR=str(tmp_path), PMI_RANK="4")
    killed = subprocess.run([sys.executable, "-m", "stellarun.rank", "--", sys.executable, "-c",
                             "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], cwd=ROOT, env=env, timeout=60)
    assert killed.returncode == -signal.SIGKILL
    rec = json.loads((tmp_path / "rank4.json").read_text())
    assert rec["cause"] == "signal" and "SIGKILL" in rec["detail"]
    ok = subprocess.run([sys.executable, "-m", "stellarun.rank", "--", sys.executable, "-c", "raise SystemExit(3)"],
                        cwd=ROOT, env=dict(env, PMI_RANK="5"), timeout=60)
    assert ok.returncode == 3 and json.loads((tmp_path / "rank5.json").read_text())["detail"] == "exited with code 3"
    fine = subprocess.run([sys.executable, "-m", "stellarun.rank", "--", sys.executable, "-c", "pass"],
                          cwd=ROOT, env=dict(env, PMI_RANK="7"), timeout=60)
    assert fine.returncode == 0 and not (tmp_path / "rank7.json").exists()


def test_the_rank_dies_with_its_supervisor(tmp_path):
    """A killed supervisor (its launcher went) takes its rank along: nothing keeps running."""
    pidfile = tmp_path / "child.pid"
    sup = subprocess.Popen([sys.executable, "-m", "stellarun.rank", "--", sys.executable, "-c",
                            "import os, time; open(%r, 'w').write(str(os.getpid())); time.sleep(60)" % str(pidfile)],
                           cwd=ROOT)
    try:
        for _ in range(200):
            if pidfile.exists() and pidfile.read_text():
                break
            time.sleep(0.05)
        child = int(pidfile.read_text())
        sup.kill()
        sup.wait()
        for _ in range(100):
            if not os.path.exists("/proc/%d" % child) or _state(child) == "Z":
                break
            time.sleep(0.05)
        assert not os.path.exists("/proc/%d" % child) or _state(child) == "Z"
    finally:
        if sup.poll() is None:
            sup.kill()


def _state(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_every_cause_stella_mpi_records_has_an_exit_code():
    """The causes written by stella_mpi (comm/abort.py's callers) are the ones stellarun maps."""
    import re
    from stellarun import status
    causes = set()
    for dirpath, _, files in os.walk(os.path.join(ROOT, "stella_mpi")):
        for f in files:
            if f.endswith(".py"):
                text = open(os.path.join(dirpath, f)).read()
                causes |= set(re.findall(r'cause="(\w+)"', text))
                causes |= set(re.findall(r'record_status\("(\w+)"', text))
                causes |= set(re.findall(r'return "(deadline|collective)" if', text))
    assert {"exception", "deadline", "signal"} <= causes, causes
    assert causes <= set(status.EXIT_CODES), causes - set(status.EXIT_CODES)
