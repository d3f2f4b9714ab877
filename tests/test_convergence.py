"""Convergence with the sparse cross-cluster route: a byte-level language model on Python's
standard-library sources, 4 ranks in 2 clusters, the same seeds and steps for each run, against
dense training with Horovod's exact numerics (``stellarun --wan-route dense``).

Every case here is in the long tier (``scripts/run_long_tests.sh``, -m slow: the default
run's 10 minutes; the default run trains both routes in tests/test_example.py), each with its
defaults only (this release's: momentum correction for SGD, the density warm-up, cache-aware
singles 0.7; the CPU engine's 150 synchronous steps first and stale prediction):
``Compression.cacheaware(density=0.01)`` within 2 % of dense's final held-out loss, the CPU
engine at staleness 1 with top-k within 3 %, local steps every 8 steps with 4-bit THC
pseudo-gradients within 2 %; and: ``topk`` within 2 %, the
previous release's defaults (no correction, no warm-up, blocks only), DiLoCo's outer Nesterov,
top-k pseudo-gradients, and error feedback on and off. The four-seed figures are bench/bench_parity.py's. Longer versions of the
same comparison: examples/train_horovod.py with more --steps, or bench/bench_time_to_loss.py
(time to a target loss over an emulated WAN)."""
import json
import os
import subprocess
import sys

import pytest

from mpi_launch import ROOT

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

STEPS = 500


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """Dense training: the baseline of every comparison here (trained once per run)."""
    return _train(tmp_path_factory.mktemp("dense"), "dense", route="dense")


def _train(tmp_path, tag, *extra, route="auto"):
    out = tmp_path / ("%s.json" % tag)
    stellarun = os.path.join(os.path.dirname(sys.executable), "stellarun")
    if not os.path.exists(stellarun):
        pytest.skip("stellarun is not installed")
    cmd = [stellarun, "-np", "4", "--clusters", "2", "--timeout", "120", "--wan-route", route, sys.executable,
           "examples/train_horovod.py",
           "--steps", str(STEPS), "--log-every", str(STEPS), "--optimizer", "sgd", "--lr", "0.05",
           "--json-out", str(out)] + list(extra)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = json.loads(out.read_text())
    assert result["identical"]
    return result


@pytest.mark.slow   # (the default run keeps local steps with THC, the automatic route's mode; bench_parity measures this)
def test_cacheaware_with_its_defaults_matches_dense(tmp_path, dense):
    """``Compression.cacheaware(density=0.01)`` with no other option: momentum correction (SGD
    with momentum), the density warm-up and the largest single entries beside fewer blocks
    (singles 0.7) are on by default. Measured over four seeds (bench/bench_parity.py --variants
    dense cacheaware): +1.4, +0.5, +0.6, +1.6 %."""
    ca = _train(tmp_path, "ca", "--compression", "cacheaware", "--density", "0.01")
    d, a = dense["validation_loss"], ca["validation_loss"]
    print("validation loss after %d steps: dense %.4f; cache-aware 1%% with its defaults %.4f (%+.1f%%)"
          % (STEPS, d, a, 100 * (a / d - 1)))
    assert a <= 1.02 * d      # measured +1.4 %
    assert ca["wan_bytes_sent_per_step"] < 0.05 * dense["wan_bytes_sent_per_step"]


@pytest.mark.slow   # (the default run keeps its time; top-k is measured beside cache-aware by bench_parity)
def test_topk_with_its_defaults_matches_dense(tmp_path, dense):
    """``Compression.topk(density=0.01)`` with its defaults (momentum correction, warm-up), -m slow.
    Measured over four seeds (bench/bench_parity.py --variants dense topk): -0.3, +0.9, +0.3, +0.8 %."""
    tk = _train(tmp_path, "tk", "--compression", "topk", "--density", "0.01")
    d, k = dense["validation_loss"], tk["validation_loss"]
    print("validation loss after %d steps: dense %.4f; top-k 1%% with its defaults %.4f (%+.1f%%)"
          % (STEPS, d, k, 100 * (k / d - 1)))
    assert k <= 1.02 * d      # measured -0.3 %
    assert tk["wan_bytes_sent_per_step"] < 0.05 * dense["wan_bytes_sent_per_step"]


@pytest.mark.slow   # (the default run's time; bench/bench_parity.py measures it over seeds)
def test_cpu_engine_at_staleness_one_with_its_defaults_within_three_percent(tmp_path, dense):
    """The CPU engine overlapping its update with the next step (``hvd.CpuEngine()``: staleness
    1, its first 150 steps synchronous in place of the density warm-up, stale prediction) with
    ``Compression.topk(0.01)``'s defaults (momentum correction): a stale update costs most while
    the loss falls fastest. Measured over four seeds (bench/bench_parity.py --variants dense
    cpu1:topk): +1.5, +0.6, +0.7, +0.8 %; with cache-aware 1 % (cpu1) +3.1, +2.1, +1.5, +2.0 %."""
    cpu = _train(tmp_path, "cpu1", "--compression", "topk", "--density", "0.01", "--engine", "cpu",
                 "--staleness", "1")
    d, c = dense["validation_loss"], cpu["validation_loss"]
    print("validation loss after %d steps: dense %.4f; CPU engine with its defaults, top-k 1%% %.4f (%+.1f%%)"
          % (STEPS, d, c, 100 * (c / d - 1)))
    assert c <= 1.03 * d      # measured +1.5 %


@pytest.mark.slow   # (the hook reduces as the optimizer's route does: tests/mpi/test_ddp.py; that route's 1 % above)
def test_ddp_hook_at_one_percent_matches_dense(tmp_path, dense):
    """torch's DDP with stella's hook (examples/train_ddp.py: the same model, data and seeds,
    SGD with momentum wrapped by ddp.wrap_optimizer for DGC's momentum correction) at cache-aware
    1 %, within the Horovod path's 2 % of dense. Measured on this seed: +0.95 % (without momentum
    correction +3.1 %; the Horovod path +1.4 %)."""
    out = tmp_path / "ddp.json"
    stellarun = os.path.join(os.path.dirname(sys.executable), "stellarun")
    cmd = [stellarun, "-np", "4", "--clusters", "2", "--timeout", "120", sys.executable, "examples/train_ddp.py",
           "--steps", str(STEPS), "--log-every", str(STEPS), "--lr", "0.05", "--compression", "cacheaware",
           "--density", "0.01", "--json-out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    hook = json.loads(out.read_text())
    assert hook["identical"] and hook["steps"] == STEPS
    d, h = dense["validation_loss"], hook["validation_loss"]
    print("validation loss after %d steps: dense %.4f; DDP hook, cache-aware 1%% %.4f (%+.1f%%)"
          % (STEPS, d, h, 100 * (h / d - 1)))
    assert h <= 1.02 * d      # measured +0.95 %
    assert hook["wan_bytes_sent_per_step"] < 0.05 * dense["wan_bytes_sent_per_step"]


def test_local_steps_with_thc_pseudo_gradients_match_dense(tmp_path, dense):
    """Issue 14's modes at equal steps: local steps (model averaging every 8 steps) with the
    pseudo-gradient in 4-bit THC, the mode the switching adjuster moves to on this model. Measured
    over four seeds (bench/bench_parity.py --variants dense local8+thc4): -0.3 % mean; -1.0 % on
    this seed."""
    thc = _train(tmp_path, "local8thc4", "--compression", "thc", "--bits", "4", "--local-steps", "8")
    d, t = dense["validation_loss"], thc["validation_loss"]
    print("validation loss after %d steps: dense %.4f; local 8 + THC 4 bits %.4f (%+.1f%%)"
          % (STEPS, d, t, 100 * (t / d - 1)))
    assert t <= 1.02 * d      # measured -1.0 %
    assert thc["wan_bytes_sent_per_step"] < 0.25 * dense["wan_bytes_sent_per_step"]


@pytest.mark.slow
def test_outer_nesterov_and_sparse_pseudo_gradients_gaps(tmp_path, dense):
    """DiLoCo's outer Nesterov every 8 steps (outer lr 0.7, momentum 0.9: DiLoCo's, tuned for
    AdamW inner steps, not for this SGD) and model averaging with top-k 1 % pseudo-gradients
    (-m slow). Measured on this seed: +7.7 % and +1.8 %."""
    diloco = _train(tmp_path, "diloco8", "--compression", "none", "--local-steps", "8", "--outer", "nesterov")
    topk = _train(tmp_path, "local8topk", "--compression", "topk", "--density", "0.01", "--local-steps", "8")
    d, n, k = dense["validation_loss"], diloco["validation_loss"], topk["validation_loss"]
    print("validation loss after %d steps: dense %.4f; DiLoCo 8 %.4f (%+.1f%%); local 8 + top-k 1%% %.4f (%+.1f%%)"
          % (STEPS, d, n, 100 * (n / d - 1), k, 100 * (k / d - 1)))
    assert n <= 1.10 * d      # measured +7.7 %
    assert k <= 1.03 * d      # measured +1.8 %


@pytest.mark.slow
def test_the_previous_releases_defaults_fall_short(tmp_path, dense):
    """What the defaults replace (-m slow): cache-aware blocks alone without momentum correction
    or warm-up (the previous default), measured +6.1 % on this seed; top-k 1 % with momentum
    correction alone +0.2 %; blocks with correction and warm-up +4.2 % (+3.4 to +6.2 % over four
    seeds)."""
    plain = ("--momentum-correction", "off", "--density-warmup", "0")
    blocks = _train(tmp_path, "blocks", "--compression", "cacheaware", "--density", "0.01", "--singles", "0", *plain)
    mc = _train(tmp_path, "mc", "--compression", "topk", "--density", "0.01", "--momentum-correction", "on",
                "--density-warmup", "0")
    d, b, m = dense["validation_loss"], blocks["validation_loss"], mc["validation_loss"]
    print("validation loss after %d steps: dense %.4f; cache-aware blocks 1%% alone %.4f (%+.1f%%); top-k 1%% + MC "
          "%.4f (%+.1f%%)" % (STEPS, d, b, 100 * (b / d - 1), m, 100 * (m / d - 1)))
    assert b >= 1.03 * d      # the gap the defaults close
    assert m <= 1.02 * d


@pytest.mark.slow
def test_sparse_one_percent_with_error_feedback_matches_dense(tmp_path, dense):
    """Error feedback alone (no correction, no warm-up), without it, and on the CPU engine at
    staleness 0 and 1 (no synchronous steps first) (-m slow)."""
    plain = ("--momentum-correction", "off", "--density-warmup", "0")
    ef = _train(tmp_path, "ef", "--compression", "topk", "--density", "0.01", *plain)
    no_ef = _train(tmp_path, "noef", "--compression", "topk", "--density", "0.01", "--no-error-feedback", *plain)
    cpu = _train(tmp_path, "cpu", "--compression", "topk", "--density", "0.01", "--engine", "cpu",
                 "--staleness", "0", *plain)
    stale = _train(tmp_path, "cpu1", "--compression", "topk", "--density", "0.01", "--engine", "cpu",
                   "--staleness", "1", "--staleness-warmup", "0", *plain)
    d, e, n, c = dense["validation_loss"], ef["validation_loss"], no_ef["validation_loss"], cpu["validation_loss"]
    s = stale["validation_loss"]
    print("validation loss after %d steps: dense %.4f, 1%% + EF %.4f (%+.1f%%), 1%% no EF %.4f (%+.1f%%), "
          "1%% + EF on the CPU engine: staleness 0 %.4f (%+.1f%%), staleness 1 %.4f (%+.1f%%)"
          % (STEPS, d, e, 100 * (e / d - 1), n, 100 * (n / d - 1), c, 100 * (c / d - 1), s, 100 * (s / d - 1)))
    assert e <= 1.05 * d
    assert c <= 1.05 * d
    assert s <= 1.05 * d
    assert n >= e * 1.03, "without error feedback the loss should be measurably worse"
    assert ef["wan_bytes_sent_per_step"] < 0.05 * dense["wan_bytes_sent_per_step"]
