"""The adjuster over the emulated WAN with a rate schedule (500 -> 100 -> 500 Mbit/s): real
ranks, a real model; every rank takes the same decisions at the same steps, and the density
does move. Skips where network namespaces are not allowed."""
import json
import os
import subprocess
import sys

import pytest

from mpi_launch import ROOT
from test_wan import needs_netns

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


@needs_netns
def test_all_ranks_switch_at_the_same_step(tmp_path):
    exe = os.path.join(os.path.dirname(sys.executable), "stellarun")
    dec = str(tmp_path / "dec")
    cmd = [exe, "-np", "4", "--clusters", "2", "--wan", "500mbit", "--wan-schedule", "6:100mbit,14:500mbit",
           "--timeout", "240", sys.executable, "bench/e2e_train.py", "--mode", "adapt:cacheaware",
           "--workload", "lm", "--hidden", "2048", "--steps", "120", "--objective", "step_time", "--target", "1.3",
           "--density", "0.1",
           "--out", str(tmp_path / "run.json"), "--decisions-out", dec]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "WAN rate now 100 Mbit/s" in out and "WAN rate now 500 Mbit/s" in out
    ranks = []
    for r in range(4):
        with open("%s.rank%d" % (dec, r)) as f:
            ranks.append(json.load(f)["decisions"])
    assert all(d == ranks[0] for d in ranks[1:]), "ranks decided differently"
    densities = [d for _, d, _, _ in ranks[0]]
    assert len(ranks[0]) >= 10 and len(set(densities)) >= 2, ranks[0]
    # what each step ran with (hvd.stats) matches the decision in effect, on rank 0
    with open(tmp_path / "run.json") as f:
        records = json.load(f)["records"]
    in_effect = {s: d for s, d, _, _ in ranks[0]}
    current, by_step = None, {}
    for rec in records:
        current = in_effect.get(rec["step"] - 1, current)
        by_step[rec["step"]] = rec["density"]   # (the start's before the first decision)
        if current is not None:
            assert rec["density"] == pytest.approx(current), rec
    for rec in records:
        # and the exchange really sent the density in effect (not just the controller reporting
        # itself). Cache-aware sends the bytes of top-k at the density, and entries per byte vary
        # with its blocks and singles (0.80x to 1.17x of it measured here); hvd.stats is a
        # telemetry window's, and a decision reaches the route up to a window before the step
        # it is logged for: so within 3 steps either way
        near = {by_step.get(rec["step"] + k) for k in range(-3, 4)} - {None}
        if near:
            assert any(0.6 * d <= rec["sent_density"] <= 1.6 * d for d in near), (rec, sorted(near))


@needs_netns
def test_the_switching_optimizer_moves_every_rank_at_the_same_step(tmp_path):
    """hvd.Adjuster(modes=("sync", "local")) over the emulated WAN (1 Gbit/s, then 20 Mbit/s from
    6 s): the byte LM starts on the sparse route and the adjuster moves it to local steps with
    THC pseudo-gradients (on this model they win at every rate: README); every rank switches at
    the same step, and each step ran on the route in effect."""
    exe = os.path.join(os.path.dirname(sys.executable), "stellarun")
    dec = str(tmp_path / "dec")
    cmd = [exe, "-np", "4", "--clusters", "2", "--wan", "1gbit", "--wan-schedule", "6:20mbit",
           "--timeout", "240", sys.executable, "bench/e2e_train.py", "--mode", "switch:cacheaware",
           "--workload", "lm", "--hidden", "1024", "--steps", "100000", "--time-budget", "25", "--density", "0.01",
           "--bits", "4", "--min-density", "0.001", "--max-density", "0.1",
           "--out", str(tmp_path / "run.json"), "--decisions-out", dec]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "WAN rate now 20 Mbit/s" in out
    ranks = []
    for r in range(4):
        with open("%s.rank%d" % (dec, r)) as f:
            ranks.append(json.load(f)["mode_switches"])
    assert all(s == ranks[0] for s in ranks[1:]), ranks
    assert ranks[0] and ranks[0][0][1] == "local", ranks[0]
    with open(tmp_path / "run.json") as f:
        records = json.load(f)["records"]
    route, switches = "sync", dict(ranks[0])
    for rec in records:   # a record's route is the one of the next step: a switch at step s shows from record s
        route = switches.get(rec["step"], route)
        assert rec["route"] == route, (rec["step"], rec["route"], ranks[0])
