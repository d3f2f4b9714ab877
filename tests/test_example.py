"""The Horovod-style example trains on 4 ranks in 2 clusters (launched by stellarun) and
ends with identical parameters on every rank."""
import json
import os
import subprocess
import sys

import pytest

from mpi_launch import ROOT

pytestmark = pytest.mark.mpi


@pytest.mark.slow   # (the main job below runs the same script on 4 ranks in 2 clusters, twice, and asserts the same)
def test_example_trains_and_parameters_agree():
    stellarun = os.path.join(os.path.dirname(sys.executable), "stellarun")
    if not os.path.exists(stellarun):
        pytest.skip("stellarun is not installed in this environment")
    proc = subprocess.run([stellarun, "-np", "4", "--clusters", "2", "--timeout", "60", sys.executable,
                           "examples/train_horovod.py", "--steps", "40", "--log-every", "20"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "4 ranks in 2 clusters" in out
    assert "parameters identical on all 4 ranks: True" in out
    losses = [float(line.split("loss")[1].split()[0]) for line in out.splitlines() if line.startswith("step")]
    assert len(losses) == 2 and losses[-1] < 5.55  # below the uniform-guess loss ln(256)


def test_main_job_compares_at_equal_time_and_draws_the_plot(tmp_path):
    """The README's main job, short: the untouched script on the automatic route (which says so at
    its start: the clusters, the measured link, the route, how to get dense) and with
    --wan-route dense train for the same wall-clock; the summary gives the route the automatic run
    took, the held-out loss of each and the time each takes to reach dense's final loss; the plot
    is written, and no run prints c10d's hostname warnings."""
    plot = tmp_path / "main.png"
    proc = subprocess.run([sys.executable, "examples/wan_main_job.py", "--seconds", "3", "--hidden", "256",
                           "--eval-seconds", "1", "--log-every", "5", "--plot", str(plot)],
                          cwd=ROOT, capture_output=True, text=True, timeout=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    steps = [ln for ln in out.splitlines() if ln.startswith("step")]
    assert steps and all(" t " in ln and "ms/step" in ln and "WAN" in ln and "density" in ln for ln in steps)
    assert "3 s of training each" in out and "after 3 s of training: held-out loss" in out
    assert "time to loss" in out
    assert "automatic route across 2 clusters (2+2 ranks); link measured at" in out
    assert "STELLA_WAN_ROUTE=dense (stellarun --wan-route dense)" in out
    assert "the automatic route took:\n  from step 0: " in out
    written = [ln for ln in out.splitlines() if "loss against wall-clock: " in ln][-1].split(
        "loss against wall-clock: ")[-1]
    try:
        import matplotlib  # noqa: F401
        assert written == str(plot) and plot.stat().st_size > 1000 and plot.read_bytes()[:4] == b"\x89PNG"
    except ImportError:
        assert written.endswith(".csv") and os.path.exists(written)
    assert "hostname of the client socket" not in out
    # (each run: the example's own end line; the parameters agree on every rank, the loss is below
    # the uniform guess ln(256) = 5.55)
    ends = [ln for ln in out.splitlines() if ln.startswith("done: ")]
    assert len(ends) == 2 and all("parameters identical on all 4 ranks: True" in ln for ln in ends), ends
    assert all(float(ln.split("validation loss ")[1].split()[0]) < 5.55 for ln in ends), ends


@pytest.mark.slow   # (bench_parity's mid-run start; three short 4-rank runs and two refusals)
def test_a_saved_point_mid_run_is_where_the_next_run_starts(tmp_path):
    """--save-state writes each rank's model, inner state and data position; --load-state starts
    there: the next run's first held-out loss is the saved run's last, under local steps (each
    rank keeps its own inner state) and synchronously (the inner state averaged: the ranks'
    parameters still agree at the end). A missing file is refused, naming it, and so is a point
    written by another number of ranks."""
    stellarun = os.path.join(os.path.dirname(sys.executable), "stellarun")
    if not os.path.exists(stellarun):
        pytest.skip("stellarun is not installed in this environment")
    ck = str(tmp_path / "ck")

    def train(*args, ranks=4):
        out = tmp_path / "run.json"
        proc = subprocess.run([stellarun, "-np", str(ranks), "--clusters", "2", "--timeout", "60", sys.executable,
                               "examples/train_horovod.py", "--steps", "16", "--log-every", "16", "--hidden", "64",
                               "--optimizer", "sgd", "--lr", "0.05", "--json-out", str(out)] + list(args),
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        return proc, (json.loads(out.read_text()) if proc.returncode == 0 else None)

    proc, saved = train("--compression", "thc", "--local-steps", "8", "--outer", "nesterov", "--save-state", ck)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert sorted(os.listdir(tmp_path)) == ["ck.rank%d.pt" % r for r in range(4)] + ["run.json"]
    for args in (["--compression", "sparseloco", "--density", "0.03", "--local-steps", "8", "--outer", "sum"],
                 ["--compression", "none"]):
        proc, cont = train(*args, "--load-state", ck, "--eval-every", "8")
        assert proc.returncode == 0, (args, (proc.stdout + proc.stderr)[-4000:])
        assert cont["curve"][0]["validation_loss"] == pytest.approx(saved["validation_loss"], rel=1e-6), args
        assert cont["identical"], args
    proc, _ = train("--load-state", str(tmp_path / "nowhere"))
    assert proc.returncode != 0 and "--load-state: %s.rank" % (tmp_path / "nowhere") in proc.stdout + proc.stderr
    proc, _ = train("--load-state", ck, ranks=2)
    assert proc.returncode != 0 and "was written by 4 ranks, this run has 2" in proc.stdout + proc.stderr
