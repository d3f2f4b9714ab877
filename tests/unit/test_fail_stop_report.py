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


def test_records_from_another_host_travel_as_marker_lines_and_leave_the_output():
    """A rank on another host prints its record as one stderr line (stella_mpi's writer with
    STELLA_STATUS_EMIT, or its supervisor's); stellarun takes those lines out of mpirun's stderr,
    in whatever chunks they arrive, and reports them with its own host's records."""
    from stellarun import status
    shown = []
    f = status.MarkerFilter(shown.append)
    rec = {"rank": 3, "host": "far", "pid": 9, "time": 2.0, "cause": "exception", "detail": "boom"}
    data = b"rank 3 says hello\n" + status.marker_line(rec) + b"progress 50%\r" + b"stellarun-stat" + b"us: {bad\n" + \
        b"tail without newline"
    for i in range(0, len(data), 7):   # split anywhere, as pipes do
        f.feed(data[i:i + 7])
    f.close()
    assert f.records == [rec]
    assert b"".join(shown) == b"rank 3 says hello\nprogress 50%\rstellarun-status: {bad\ntail without newline"
    here = {"rank": 3, "host": "here", "pid": 1, "time": 5.0, "cause": "signal", "detail": "killed"}
    other = {"rank": 1, "host": "here", "pid": 2, "time": 3.0, "cause": "deadline", "detail": "late"}
    assert status.merged([here, other], f.records) == [rec, other]   # the first of each rank, earliest first


def test_stella_mpis_writer_emits_the_marker_line(tmp_path):
    from stellarun import status
    code = ("from stella_mpi.comm.abort import record_status\n"
            "record_status('exception', 'a bug', rank=1)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, timeout=120,
                          env=dict(os.environ, STELLA_STATUS_DIR=str(tmp_path), STELLA_STATUS_EMIT="1"))
    f = status.MarkerFilter(lambda data: None)
    f.feed(proc.stderr)
    f.close()
    assert [(r["rank"], r["cause"], r["detail"]) for r in f.records] == [(1, "exception", "a bug")]
