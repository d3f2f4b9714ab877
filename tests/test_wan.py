"""stellarun --wan: cross-cluster traffic really crosses a shaped link, the rate schedule
applies, and nothing is left behind (also when a rank fails). Skips where network
namespaces are not allowed."""
import os
import re
import subprocess
import sys

import pytest

from mpi_launch import ROOT

pytestmark = pytest.mark.mpi


def _available():
    from stella_mpi.wan import namespaces_available
    return namespaces_available()


ok, why = _available()
needs_netns = pytest.mark.skipif(not ok, reason="network namespaces unavailable here: %s" % why)


def _stellarun(*args, timeout=180):
    exe = os.path.join(os.path.dirname(sys.executable), "stellarun")
    return subprocess.run([exe] + list(args), cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _rates(out, what):
    return [float(m.group(1)) for m in re.finditer(r"%s at \d+ s: ([0-9.]+) Mbit/s" % what, out)]


@needs_netns
def test_cross_cluster_traffic_is_shaped_and_cleaned_up():
    from stella_mpi.wan import leftovers
    proc = _stellarun("-np", "4", "--clusters", "2", "--wan", "100mbit", sys.executable, "tests/scripts/wan_probe.py", "6")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "network namespaces" in out
    cross, intra = _rates(out, "cross"), _rates(out, "intra")
    assert cross and 50 < cross[0] < 110, out
    assert intra and intra[0] > 2 * cross[0], out
    assert "rank 0 shares memory with 2 ranks" in out   # its cluster, not the whole machine
    assert leftovers() == []


@needs_netns
def test_rate_schedule_changes_the_link():
    proc = _stellarun("-np", "2", "--clusters", "2", "--wan", "400mbit", "--wan-schedule", "2:50mbit",
                      sys.executable, "tests/scripts/wan_probe.py", "4", "0,4")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    cross = _rates(out, "cross")
    assert len(cross) == 2 and cross[1] < 0.5 * cross[0], out
    assert "WAN rate now 50 Mbit/s" in out


@needs_netns
def test_cleanup_after_a_failing_rank():
    from stella_mpi.wan import leftovers
    proc = _stellarun("-np", "4", "--clusters", "2", "--wan", "100mbit", "--timeout", "20", sys.executable,
                      "tests/scripts/faulty_rank.py", "raise")
    assert proc.returncode != 0
    assert leftovers() == []


def test_dry_run_builds_one_mpmd_part_per_cluster():
    proc = _stellarun("-np", "5", "--clusters", "2", "--wan", "1gbit", "--dry-run", "python", "x.py")
    assert proc.returncode == 0, proc.stderr
    cmd = proc.stdout
    assert cmd.count(" : ") == 1 and "STELLA_CLUSTER wan0" in cmd and "STELLA_CLUSTER wan1" in cmd
    assert "-n 3" in cmd and "-n 2" in cmd
    if ok:   # one pretend host per cluster, so MPICH keeps intra-cluster traffic on shared memory
        assert "-launcher fork -hosts stella-wan0:3,stella-wan1:2" in cmd


def test_bad_rates_are_refused():
    from stella_mpi.wan import parse_rate, parse_schedule
    assert parse_rate("100mbit") == 100e6 and parse_rate("1gbit") == 1e9
    with pytest.raises(ValueError, match="rate"):
        parse_rate("fast")
    with pytest.raises(ValueError, match="ascend"):
        parse_schedule("60:100mbit,10:1gbit")
