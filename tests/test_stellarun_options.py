"""stellarun's horovodrun options: -H, --network-interface, --output-filename, --start-timeout,
--verbose, --config-file and the tunables, --dry-run's full command, and a clear error for an
mpirun that is not this environment's."""
import os
import stat
import subprocess
import sys
import time

import pytest

from mpi_launch import ROOT, mpirun_path

pytestmark = pytest.mark.mpi
STELLARUN = os.path.join(os.path.dirname(sys.executable), "stellarun")


def _stellarun(*args, env=None, timeout=120):
    if mpirun_path() is None or not os.path.exists(STELLARUN):
        pytest.skip("no mpirun or stellarun")
    full = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.run([STELLARUN] + list(args), cwd=ROOT, env=full, capture_output=True, text=True,
                          timeout=timeout)


def _genv(cmd_line):
    words = cmd_line.split()
    return {words[i + 1]: words[i + 2] for i, w in enumerate(words) if w == "-genv"}


def test_dry_run_shows_the_whole_command():
    proc = _stellarun("--dry-run", "-H", "nodeA:2,nodeB:2", "--network-interface", "eth1", "--output-filename",
                      "logs", "--start-timeout", "30", "--fusion-threshold-mb", "32", "--cycle-time-ms", "1",
                      "--cache-capacity", "512", "--timeline-filename", "tl.json", "--timeline-mark-cycles",
                      "--no-stall-check", "--log-level", "DEBUG", "python", "train.py")
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.strip()
    assert " -np 4 " in line and " -hosts nodeA:2,nodeB:2 " in line and " -iface eth1 " in line
    env = _genv(line)
    assert env["STELLA_OUTPUT_DIR"] == os.path.join(ROOT, "logs")
    assert env["STELLA_START_TIMEOUT"] == "30.0" and env["STELLA_GLOO_IFNAME"] == "eth1"
    assert env["HOROVOD_FUSION_THRESHOLD"] == str(32 << 20) and env["HOROVOD_CYCLE_TIME"] == "1.0"
    assert env["HOROVOD_CACHE_CAPACITY"] == "512" and env["HOROVOD_TIMELINE"] == os.path.join(ROOT, "tl.json")
    assert env["HOROVOD_TIMELINE_MARK_CYCLES"] == "1" and env["HOROVOD_STALL_CHECK_DISABLE"] == "1"
    assert env["HOROVOD_LOG_LEVEL"] == "debug"
    assert line.endswith("-m stellarun.rank -- python train.py")


def test_config_file_and_the_command_line_winning(tmp_path):
    cfg = tmp_path / "hvd.yaml"
    cfg.write_text("# as horovodrun reads it\nparams:\n  fusion_threshold_mb: 16  # MiB\n  cycle_time_ms: 5\n"
                   "  hierarchical_allreduce: true\ntimeline:\n  filename: /tmp/x.json\n  mark_cycles: yes\n"
                   "stall_check:\n  enabled: false\n  shutdown_time_seconds: 30\nlogging:\n  level: INFO\n")
    proc = _stellarun("--dry-run", "-np", "2", "--config-file", str(cfg), "--cycle-time-ms", "2", "python", "t.py")
    assert proc.returncode == 0, proc.stderr
    env = _genv(proc.stdout)
    assert env["HOROVOD_FUSION_THRESHOLD"] == str(16 << 20) and env["HOROVOD_CYCLE_TIME"] == "2.0"
    assert env["HOROVOD_TIMELINE"] == "/tmp/x.json" and env["HOROVOD_TIMELINE_MARK_CYCLES"] == "1"
    assert env["HOROVOD_STALL_CHECK_DISABLE"] == "1" and env["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] == "30.0"
    cfg.write_text('timeline:\n  filename: "/tmp/run #1.json"   # a quoted hash stays\n')
    import shlex
    line = _stellarun("--dry-run", "-np", "2", "--config-file", str(cfg), "python", "t.py").stdout
    words = shlex.split(line)
    assert words[words.index("HOROVOD_TIMELINE") + 1] == "/tmp/run #1.json"
    cfg.write_text('{"timeline": {"filename": "/tmp/y.json"}}')
    assert _genv(_stellarun("--dry-run", "-np", "2", "--config-file", str(cfg), "python", "t.py").stdout)[
        "HOROVOD_TIMELINE"] == "/tmp/y.json"


@pytest.mark.parametrize("text,says", [
    ("params:\n  fusion_mb: 1\n", "unknown setting params.fusion_mb"),
    ("autotune:\n  enabled: true\n", "unknown section 'autotune'"),
    ("params\n", "expected 'key: value'"),
    ("  cycle_time_ms: 1\n", "belongs to no section"),
    ("params:\n  fusion_threshold_mb: 32MB\n", "params.fusion_threshold_mb must be a number of MiB, not '32MB'"),
    ("logging:\n  level: LOUD\n", "logging.level must be one of"),
])
def test_config_file_errors_name_the_line(tmp_path, text, says):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    proc = _stellarun("-np", "2", "--config-file", str(cfg), "python", "t.py")
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr


def test_usage_errors():
    proc = _stellarun("-H", "nodeA:x", "python", "t.py")
    assert proc.returncode == 2 and "-H expects host:slots" in proc.stderr
    proc = _stellarun("-np", "2", "-H", "a:1,b:1", "-f", "hosts", "python", "t.py")
    assert proc.returncode == 2 and "not both" in proc.stderr


def _fake_mpirun(tmp_path, version_text):
    path = tmp_path / "mpirun"
    path.write_text("#!/bin/sh\ncat <<'EOF'\n%s\nEOF\n" % version_text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


@pytest.mark.parametrize("text,what", [
    ("mpirun (Open MPI) 4.1.4\n\nReport bugs to http://www.open-mpi.org/community/help/", "Open MPI's launcher"),
    ("HYDRA build details:\n    Version:                                 4.0.2\n", "MPICH 4.0.2's hydra"),
])
def test_an_mpirun_of_another_mpi_gets_a_clear_message(tmp_path, text, what):
    own = os.path.join(os.path.dirname(sys.executable), "mpirun")
    if not os.path.exists(own):
        pytest.skip("this environment has no mpirun of its own")
    proc = _stellarun("-np", "2", "--mpirun", _fake_mpirun(tmp_path, text), "python", "t.py")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert what in proc.stderr and "Use %s" % own in proc.stderr and "PMI" in proc.stderr


def test_the_environments_own_mpirun_passes_the_check(tmp_path):
    own = os.path.join(os.path.dirname(sys.executable), "mpirun")
    if not os.path.exists(own):
        pytest.skip("this environment has no mpirun of its own")
    link = tmp_path / "mpirun"
    link.symlink_to(own)
    proc = _stellarun("--dry-run", "-np", "2", "--mpirun", str(link), "python", "t.py")
    assert proc.returncode == 0, proc.stderr


def test_output_filename_keeps_each_ranks_output(tmp_path):
    out = tmp_path / "logs"
    proc = _stellarun("-np", "2", "--output-filename", str(out), "--verbose", sys.executable, "-c",
                      "import sys, stella_mpi as hvd, torch; hvd.init(); "
                      "print('out of %d' % hvd.rank()); print('err of %d' % hvd.rank(), file=sys.stderr); hvd.shutdown()")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "stellarun: " in proc.stdout and "mpirun" in proc.stdout          # --verbose: the command
    for r in (0, 1):
        assert (out / ("rank.%d" % r) / "stdout").read_text().strip() == "out of %d" % r
        assert (out / ("rank.%d" % r) / "stderr").read_text().strip() == "err of %d" % r
        assert "out of %d" % r in proc.stdout and "err of %d" % r in proc.stderr   # and still on the console


def test_start_timeout_bounds_start_up_only():
    """A rank that never reaches MPI_Init ends the job after --start-timeout, not STELLA_TIMEOUT."""
    t0 = time.monotonic()
    proc = _stellarun("-np", "2", "--timeout", "100", "--start-timeout", "4", sys.executable,
                      "tests/scripts/faulty_rank.py", "late_import")
    took = time.monotonic() - t0
    assert proc.returncode == 12, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "STELLA_START_TIMEOUT" in proc.stdout + proc.stderr
    assert took < 60, took
