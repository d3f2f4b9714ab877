"""The adjuster's choice between the synchronous route and local steps
(stella_mpi/adjust/mode_rule.py), with the controller's real scores: both modes in the
time-to-loss unit, hysteresis, and the predictions each mode makes of the other."""
import dataclasses
import math

import pytest

from stella_mpi.adjust.controller import Controller, Estimate
from stella_mpi.adjust.local_steps_rule import smallest_fitting
from stella_mpi.adjust.mode_rule import ModeRule, local_backlog_shape, local_step_time
from stella_mpi.adjust.settings import Adjuster

MBIT = 1e6


def estimate(bandwidth_bps, compute_s=0.050, fixed_s=0.010, kappa=1.0, elements=1e6):
    """A synchronous estimate: 1M entries per shard, top-k's 6 bytes per sent entry."""
    return Estimate(compute_s=compute_s, fixed_s=fixed_s, latency_s=0.001, messages=2.0,
                    bytes_per_density=6.0 * elements, bandwidth_bps=bandwidth_bps, wan_bandwidth_bps=bandwidth_bps,
                    step_s=compute_s + fixed_s, backlog_kappa=kappa, elements=elements)


def rule(settings, pseudo_bytes=0.5, pseudo_backlog=0.0, density=0.01):
    """A ModeRule over the controller at ``density``; the pseudo-gradient costs ``pseudo_bytes``
    per entry (THC 4 bits between two clusters is about that) and holds ``pseudo_backlog`` back."""
    ctrl = Controller(settings, density=density)
    return ModeRule(settings, ctrl, 2, pseudo_bytes, lambda est: pseudo_backlog), ctrl


def test_the_local_shape_is_zero_at_h1_and_grows_with_the_wait():
    assert local_backlog_shape(1, 2) == 0.0
    assert local_backlog_shape(3, 2) == pytest.approx(0.5)            # half held back, for 1 step
    assert local_backlog_shape(64, 4) == pytest.approx(0.75 * math.sqrt(31.5))
    # the same wait held back by the sparse route costs more: 1/d - 1 = (H - 1) / 2 at H = 3, d = 0.5
    assert local_backlog_shape(3, 2) < math.sqrt((1 - 0.5) / 0.5)


def test_smallest_fitting_is_the_smallest_h_that_fits():
    assert smallest_fitting((1, 2, 4, 8, 16), 1.2, 0.010, 0.030) == 16     # 30 ms / 16 fits 2 ms
    assert smallest_fitting((1, 2, 4, 8, 16), 1.2, 0.010, 0.001) == 1
    assert smallest_fitting((1, 4), 1.2, 0.010, 10.0) == 4                  # none fits: the largest
    # overlap: 100 ms on the wire; 8 steps of 10 ms leave 20 ms of it to wait for, 16 hide it all
    assert smallest_fitting((1, 2, 4, 8, 16), 1.2, 0.010, 0.002, wire_s=0.100) == 16
    assert smallest_fitting((1, 2, 4, 8, 16), 1.2, 0.010, 0.001, wire_s=0.080) == 8   # 80 ms: 8 hide it


def test_a_slow_link_moves_to_local_steps_after_the_dead_band():
    s = Adjuster(modes=("sync", "local"), window=2, min_density=0.01, max_density=0.01)
    r, ctrl = rule(s)
    slow = estimate(20 * MBIT)   # 1 % top-k: 60 KB per step, 24 ms on the wire; THC 4 bits: 0.5 MB
    for _ in range(3):           # window (2) decisions first, then the first vote
        mode, why = r.after_sync(slow)
        assert mode == "sync" and why.startswith("steady"), why
    mode, why = r.after_sync(slow)   # the second vote running
    assert mode == "local" and why.startswith("local reaches the loss sooner: local steps H=32"), why
    assert r.predicted_every == 32 and r.mode == "local"
    # the prediction: 60 ms per local step; the exchange is the 1 % rung's wire time (2 ms of
    # latency and 24 ms for 60 KB) scaled to 0.5 MB, plus the latency: 219 ms, over 32 steps
    exchange = 0.002 + 0.5e6 / 60e3 * (0.002 + 8 * 60e3 / (20 * MBIT))
    assert r._predicted_exchange(slow) == pytest.approx(exchange)
    assert smallest_fitting(s.local_steps, s.target, 0.060, exchange) == 32


def test_a_fast_link_stays_synchronous_when_local_steps_hold_more_back():
    s = Adjuster(modes=("sync", "local"), window=1, min_density=0.01, max_density=0.01, backlog_cost=0.05)
    # the pseudo-gradient's THC holds back as much as 1 % top-k (kappa * sqrt(99)): at 1 Gbit/s
    # local steps gain little time and add their own wait
    r, ctrl = rule(s, pseudo_backlog=math.sqrt(99))
    for _ in range(6):
        mode, why = r.after_sync(estimate(1000 * MBIT))
        assert mode == "sync", why


def test_one_vote_is_not_enough_and_a_steady_decision_resets_it():
    s = Adjuster(modes=("sync", "local"), window=1, min_density=1.0, max_density=1.0)
    r, _ = rule(s, pseudo_backlog=0.5)
    # dense synchronous steps: 6 MB per step, 2.4 s at 20 Mbit/s, 5 ms at 10 Gbit/s (where local
    # steps save less than the dead band)
    fast, slow = estimate(10000 * MBIT), estimate(20 * MBIT)
    assert r.after_sync(slow)[0] == "sync"    # within the window: no vote
    assert r.after_sync(slow)[0] == "sync"    # vote 1
    assert r.after_sync(fast)[0] == "sync"    # the link is back: the vote is dropped
    assert r.after_sync(slow)[0] == "sync"    # vote 1 again
    assert r.after_sync(slow)[0] == "local"


def test_local_mode_measures_the_link_and_returns_when_sync_is_cheaper():
    """In local mode the link is measured by the pseudo-gradient's exchange and put into the
    last synchronous estimate: a fast exchange predicts a cheap synchronous step. Here the
    synchronous rung is dense (nothing held back) and the backlog costs much (0.5), so at
    10 Gbit/s the dense step wins over local steps of H=4."""
    s = Adjuster(modes=("sync", "local"), window=1, min_density=1.0, max_density=1.0, backlog_cost=0.5)
    r, ctrl = rule(s)
    slow = estimate(2 * MBIT)
    while r.mode == "sync":
        r.after_sync(slow)
    est = r.sync_estimate
    exchange = 8 * est.elements * 0.5 / 1e10 + est.messages * est.latency_s   # 0.5 MB at 10 Gbit/s
    mode, why = r.after_local(0.060, exchange, 4)
    assert mode == "local" and "link 10000 Mbit/s" in why, why
    mode, why = r.after_local(0.060, exchange, 4)
    assert mode == "local", why                       # the first vote (the window is 1 decision)
    mode, why = r.after_local(0.060, exchange, 4)
    assert mode == "sync" and why.startswith("sync reaches the loss sooner"), why
    # the same at 100 Mbit/s: the dense step would take 0.48 s more, local steps stay
    r2, _ = rule(s)
    while r2.mode == "sync":
        r2.after_sync(slow)
    exchange = 8 * est.elements * 0.5 / 1e8 + est.messages * est.latency_s
    for _ in range(5):
        assert r2.after_local(0.060, exchange, 4)[0] == "local"


def test_with_overlap_only_the_wire_beyond_the_period_blocks():
    s = Adjuster(modes=("sync", "local"), window=1, min_density=0.01, max_density=0.01)
    r, _ = rule(s)
    r.sync_estimate = estimate(20 * MBIT)
    r.mode = "local"
    # 0.2 s on the wire hidden behind 8 steps of 60 ms: the step pays the 5 ms boundary only
    hidden = r.local_score(r.sync_estimate, 0.060, 0.005, 8)
    _, why = r.after_local(0.060, 0.005, 8, wire_s=0.2)
    assert "local %.3f" % hidden in why, why
    _, why = r.after_local(0.060, 0.005, 2, wire_s=0.2)    # 2 steps hide 120 ms of it: 80 ms left
    assert "local %.3f" % r.local_score(r.sync_estimate, 0.060, 0.085, 2) in why, why


def test_the_modes_setting_is_validated():
    assert Adjuster(modes=("local", "sync")).modes == ("sync", "local")
    assert Adjuster().modes == ()
    for bad in (("sync",), ("sync", "fast"), "sync", ("sync", "local", "local")):
        with pytest.raises(ValueError, match="modes must be"):
            Adjuster(modes=bad)
    with pytest.raises(ValueError, match="time-to-loss objective"):
        Adjuster(modes=("sync", "local"), objective="step_time")


def test_an_absurd_bandwidth_from_small_payloads_does_not_make_the_exchange_free():
    """The controller fits its bandwidth from the sparse payloads (some KB), which can put it off
    by orders of magnitude; the pseudo-gradient's exchange (some MB) is predicted from the
    current rung's whole wire time instead, scaled by the payloads' ratio."""
    s = Adjuster(modes=("sync", "local"), min_density=0.01, max_density=0.01)
    r, _ = rule(s)
    absurd = estimate(1e14)   # 60 KB "in 5 ns": the rung's wire time is its 2 ms of latency
    assert r._predicted_exchange(absurd) == pytest.approx(0.002 + 0.5e6 / 60e3 * 0.002, rel=1e-5)


def test_a_rule_without_a_synchronous_estimate_goes_back_to_measure_it():
    """A checkpoint saved in local mode without the synchronous estimate: after the dead band the
    rule returns to the synchronous route (to measure it) instead of staying local for good."""
    s = Adjuster(modes=("sync", "local"), window=1, min_density=0.01, max_density=0.01)
    r, _ = rule(s)
    r.take("local")
    modes = [r.after_local(0.060, 0.010, 4)[0] for _ in range(3)]
    assert modes == ["local", "local", "sync"]
    assert r.mode == "sync"


def test_take_restores_the_estimate_and_restarts_the_dead_band():
    s = Adjuster(modes=("sync", "local"), window=1, min_density=0.01, max_density=0.01)
    r, _ = rule(s)
    for _ in range(3):
        r.after_sync(estimate(20 * MBIT))
    saved = r.saved_estimate()
    assert isinstance(saved, dict)
    r2, _ = rule(s)
    r2.take("local", Estimate(**saved))
    assert r2.sync_estimate == r.sync_estimate and r2.mode == "local" and r2._held == 0 and r2._votes == 0


def test_with_the_measured_link_the_exchange_follows_the_link():
    """The link probe's bandwidth (one pair of shard owners, measured with MB payloads) replaces
    the rung-scaled guess: the pseudo-gradient's payload at that rate, plus the messages'
    latency and the sparse route's CPU work per step (``cpu_s``, which a local step does not
    pay), so H follows the link (the guess predicted about the same exchange at every rate on
    the byte LM)."""
    s = Adjuster(modes=("sync", "local"), window=1)
    for rate, want, every in ((20 * MBIT, 0.002 + 8 * 0.5e6 / (20 * MBIT) + 0.004, 32),
                              (1000 * MBIT, 0.002 + 0.004 + 0.004, 1)):
        ctrl = Controller(s, density=0.01)
        r = ModeRule(s, ctrl, 2, 0.5, lambda est: 0.0, link_bps=rate)
        est = dataclasses.replace(estimate(rate), cpu_s=0.004)
        assert r._predicted_exchange(est) == pytest.approx(want)
        assert local_step_time(est) == pytest.approx(0.056)   # compute 50 ms + fixed 10 ms - selection 4 ms
        r.after_sync(est)
        assert r.predicted_every == every == smallest_fitting(s.local_steps, s.target, 0.056, want)
    assert ModeRule(s, Controller(s, density=0.01), 2, 0.5, lambda est: 0.0, link_bps=20 * MBIT).predicted_every \
        is None
