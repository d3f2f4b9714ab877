"""The adjuster's choice between the synchronous route and local steps
(stella_mpi/adjust/mode_rule.py), with the controller's real scores: both modes in the
time-to-loss unit, hysteresis, and the predictions each mode makes of the other."""
import dataclasses
import math
import re

import pytest

from stella_mpi.adjust.controller import Controller, Estimate
from stella_mpi.adjust.local_steps_rule import best_scored, exchange_ratio
from stella_mpi.adjust.mode_rule import (BLOCKING, CALIBRATION, ModeRule, PseudoRung, Schedule, delay_for,
                                         fragment_exchanges, local_backlog_shape, local_step_time,
                                         scheduled_exchange)
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
    return ModeRule(settings, ctrl, 2, [one_rung(pseudo_bytes, pseudo_backlog)]), ctrl


def one_rung(per_entry=0.5, backlog=0.0, name="thc 4 bits", period=None):
    return PseudoRung(name, per_entry, lambda est, every: backlog, period)


def scored_every(r, est, step_s, exchange_s, rung=None):
    """The H the rule gives a blocking exchange of ``exchange_s``: the ladder's least score."""
    return best_scored(r.settings.local_steps, lambda h: r.local_score(est, step_s, exchange_s, h, rung))


def test_the_local_shape_is_zero_at_h1_and_grows_with_the_wait():
    assert local_backlog_shape(1, 2) == 0.0
    assert local_backlog_shape(3, 2) == pytest.approx(0.5)            # half held back, for 1 step
    assert local_backlog_shape(64, 4) == pytest.approx(0.75 * math.sqrt(31.5))
    # the same wait held back by the sparse route costs more: 1/d - 1 = (H - 1) / 2 at H = 3, d = 0.5
    assert local_backlog_shape(3, 2) < math.sqrt((1 - 0.5) / 0.5)


def test_a_slow_link_moves_to_local_steps_after_the_dead_band():
    s = Adjuster(modes=("sync", "local"), window=2, min_density=0.01, max_density=0.01)
    r, ctrl = rule(s)
    slow = estimate(20 * MBIT)   # 1 % top-k: 60 KB per step, 24 ms on the wire; THC 4 bits: 0.5 MB
    for _ in range(3):           # window (2) decisions first, then the first vote
        mode, why = r.after_sync(slow)
        assert mode == "sync" and why.startswith("steady"), why
    mode, why = r.after_sync(slow)   # the second vote running
    assert mode == "local" and why.startswith("local reaches the loss sooner: local steps H=64"), why
    assert r.predicted_every == 64 and r.mode == "local"
    # the prediction: 60 ms per local step; the exchange is the 1 % rung's wire time (2 ms of
    # latency and 24 ms for 60 KB) scaled to 0.5 MB, plus the latency: 219 ms, over 32 steps
    exchange = 0.002 + 0.5e6 / 60e3 * (0.002 + 8 * 60e3 / (20 * MBIT))
    assert r._predicted_exchange(slow) == pytest.approx(exchange)
    # H by time to loss: 3.4 ms of exchange per step at 64 against 6.8 at 32 outweighs the drift
    # of 32 more steps (kappa 1: 5.6 % of a step against 3.9 %); the step-time budget would stop at 32
    assert scored_every(r, slow, 0.060, exchange) == 64
    assert exchange_ratio(s.target, 0.060, exchange, 32) <= 1.0 < exchange_ratio(s.target, 0.060, exchange, 16)


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
    r._measured_local = True   # (a local phase was measured: the dead band applies; the first entry waives it)
    assert r.after_sync(slow)[0] == "sync"    # within the window: no vote
    assert r.after_sync(slow)[0] == "sync"    # vote 1
    assert r.after_sync(fast)[0] == "sync"    # the link is back: the vote is dropped
    assert r.after_sync(slow)[0] == "sync"    # vote 1 again
    assert r.after_sync(slow)[0] == "local"


def test_the_first_entry_waives_the_dead_band_until_a_local_phase_is_measured():
    """A local step is predicted with every wait of the synchronous step (an upper bound): the
    first entry needs two votes running but no dead band; once a local phase has been measured
    (after_local) the band applies, and a mode taken from a checkpoint or the root starts over."""
    s = Adjuster(modes=("sync", "local"), window=1, min_density=1.0, max_density=1.0)
    r, _ = rule(s, pseudo_backlog=0.5)
    fast = estimate(10000 * MBIT)   # local steps save less than the dead band
    assert r.after_sync(fast)[0] == "sync"    # within the window: no vote
    assert r.after_sync(fast)[0] == "sync"    # vote 1
    mode, why = r.after_sync(fast)
    assert mode == "local" and why.startswith("local reaches the loss sooner"), why
    r.after_local(0.060, 0.001, r.predicted_every)   # a local phase measured
    assert r._measured_local
    r.take("sync", fast)
    assert not r._measured_local                      # taken: starts over
    r2, _ = rule(s, pseudo_backlog=0.5)
    r2._measured_local = True
    assert all(r2.after_sync(fast)[0] == "sync" for _ in range(6))   # inside the band: stays


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
    for rate, want, every in ((20 * MBIT, 0.002 + 8 * 0.5e6 / (20 * MBIT) + 0.004, 64),
                              (1000 * MBIT, 0.002 + 0.004 + 0.004, 16)):
        ctrl = Controller(s, density=0.01)
        r = ModeRule(s, ctrl, 2, [one_rung()], link_bps=rate)
        est = dataclasses.replace(estimate(rate), cpu_s=0.004)
        assert r._predicted_exchange(est) == pytest.approx(want)
        assert local_step_time(est) == pytest.approx(0.056)   # compute 50 ms + fixed 10 ms - selection 4 ms
        r.after_sync(est)
        assert r.predicted_every == every == scored_every(r, est, 0.056, want)
    assert ModeRule(s, Controller(s, density=0.01), 2, [one_rung()], link_bps=20 * MBIT).predicted_every \
        is None


# ---------------- the pseudo-gradient's rung (Adjuster(pseudo_rungs=...), the automatic route's)

def rungs_of(compressors, nclusters=2, kappa_thc=1.0):
    """The rungs ModeSwitch builds from ``compressors``: their wire bytes per entry as the routes
    count them, the backlog as the controller counts it for the same synchronous rung."""
    from stella_mpi.optim.tuning import _backlog_of, _comp_name, payload_per_entry
    s = Adjuster(modes=("sync", "local"), window=1)
    ctrl = Controller(s, density=0.01)
    return [PseudoRung(_comp_name(c), payload_per_entry(c, nclusters), _backlog_of(ctrl, c)) for c in compressors]


def auto_rule(rate, window=1):
    from stella_mpi.optim.tuning import auto_pseudo_rungs
    s = Adjuster(modes=("sync", "local"), window=window, min_density=0.01, max_density=0.01)
    ctrl = Controller(s, density=0.01)
    return ModeRule(s, ctrl, 2, rungs_of(auto_pseudo_rungs()), link_bps=rate), s


def test_the_rung_entering_local_steps_follows_the_link():
    """Entering local steps the rule scores each rung at the H its exchange needs: THC 4 bits
    where the link carries it at a short H, SparseLoCo's 2-bit top-k where even H=64 cannot hide
    THC's half a byte per entry (2 Mbit/s: 2 s per exchange), its smaller H outweighing what it
    holds back."""
    chosen = {}
    for rate in (2 * MBIT, 1000 * MBIT):
        r, s = auto_rule(rate)
        est = dataclasses.replace(estimate(rate), cpu_s=0.004, backlog_kappa_thc=1.0)
        while r.mode == "sync":
            mode, why = r.after_sync(est)
        chosen[rate] = (r.rung.name, r.predicted_every)
        step = local_step_time(est)
        x = [r._predicted_exchange(est, i) for i in range(3)]
        want = min(range(3), key=lambda i: r.local_score(est, step, x[i], scored_every(r, est, step, x[i], i), i))
        assert r.pseudo_index == want, why
        assert r.predicted_every == scored_every(r, est, step, x[want], want)
        assert ("pseudo-gradient %s" % r.rung.name) in why, why
    assert chosen[1000 * MBIT][0] == "thc 4 bits"
    assert chosen[2 * MBIT][0].startswith("sparseloco"), chosen
    assert chosen[2 * MBIT][1] < 64      # THC would need more than the ladder's longest period


def test_sparse_rungs_are_charged_their_cost_from_scratch_entering_and_later_in_local_mode():
    """SPARSE_SUM_PERIOD (bench/results/parity_sparse_period_s15.json): the steps SparseLoCo's
    rungs need at H from the start of training over THC's at H = 32, 1.31-1.65. It is their
    entry_period: charged as local steps are entered from the synchronous route, in place of
    their backlog. On the byte LM's sizes (1.18M entries, 45 ms of compute, kappa 0.13) local
    steps are then entered through THC from 10 Mbit/s up, through SparseLoCo 3 % at 2 and
    5 Mbit/s; with the backlog alone, through SparseLoCo up to 100 Mbit/s (a run at 14 Mbit/s
    entered through it at H=8 and did 1.82x torchft's time to loss, where the runs entering
    through THC did 2.9-3.6x); with the schedules of fragments and a delay, THC's exchange hides
    behind 4 fragments with a delay of 4 at 5 Mbit/s too. In local mode they are charged
    SPARSE_SUM_LATER instead (parity_sparse_period_midrun_s16.json: from step 320 of THC,
    1.01-1.24 at 3 %, 1.24-1.75 at 1 %), below H = 8 rising as from scratch."""
    from stella_mpi import Compression
    from stella_mpi.optim.tuning import (SPARSE_SUM_LATER, SPARSE_SUM_PERIOD, _backlog_of, _comp_name,
                                         auto_outer_of, auto_pseudo_rungs, entry_period_of, later_period_of,
                                         payload_per_entry, period_cost_of, sparse_period_cost)
    assert set(SPARSE_SUM_LATER) == set(SPARSE_SUM_PERIOD)
    for density, table in SPARSE_SUM_PERIOD.items():
        assert all(c > 1.0 for _, c in table)
        comp = Compression.sparseloco(density=density, bits=2, feedback_decay=0.95)
        entry = entry_period_of(comp, auto_outer_of(comp, 2), False)
        assert [entry(h) for h, _ in table] == pytest.approx([c for _, c in table])
        assert entry(4) == pytest.approx(sparse_period_cost(density)(4))
        later = later_period_of(comp, auto_outer_of(comp, 2), False)
        assert [later(h) for h, _ in SPARSE_SUM_LATER[density]] == pytest.approx(
            [c for _, c in SPARSE_SUM_LATER[density]])
        # cheaper later in training, but for 1 % at H = 64 (1.75 against 1.65 from scratch)
        assert all(later(h) < entry(h) for h in (2, 4, 8, 16, 32)) and (later(64) < entry(64)) == (density > 0.01)
        assert later(2) > later(8) and later(2) / later(8) == pytest.approx(entry(2) / entry(8))
        for of in (entry_period_of, later_period_of):
            assert of(comp, auto_outer_of(comp, 2, adaptive=True), True) is None   # Adam: not measured
            assert of(comp, {"lr": 1.0, "momentum": 0.0}, False) is None          # averaged
    three, one = (later_period_of(Compression.sparseloco(density=d, bits=2, feedback_decay=0.95),
                                  auto_outer_of(Compression.sparseloco(d), 2), False) for d in (0.03, 0.01))
    assert min((2, 4, 8, 16, 32, 64), key=three) == 16 and min((2, 4, 8, 16, 32, 64), key=one) == 8
    summed = auto_outer_of(Compression.sparseloco(0.01), 2)
    for of in (entry_period_of, later_period_of):
        assert of(Compression.sparseloco(density=0.01, bits=4, feedback_decay=0.95), summed, False) is None
        assert of(Compression.sparseloco(density=0.02, bits=2, feedback_decay=0.95), summed, False) is None
    thc = Compression.thc(bits=4)
    assert entry_period_of(thc, auto_outer_of(thc, 2), False) is None and sparse_period_cost(0.02) is None
    assert later_period_of(thc, auto_outer_of(thc, 2), False) is None

    def auto_rungs(entry):   # as ModeSwitch builds the automatic route's under SGD
        ctrl = Controller(Adjuster(modes=("sync", "local")), density=0.01)
        return [PseudoRung(_comp_name(c), payload_per_entry(c, 2), _backlog_of(ctrl, c),
                           period_cost_of(auto_outer_of(c, 2), False),
                           entry_period_of(c, auto_outer_of(c, 2), False) if entry else None,
                           later_period_of(c, auto_outer_of(c, 2), False) if entry else None)
                for c in auto_pseudo_rungs()]

    for rate, now, streamed, before in ((2, "sparseloco 3 %", "sparseloco 3 %", "sparseloco"),
                                        (5, "sparseloco 3 %", "thc 4 bits", "sparseloco"),
                                        (10, "thc 4 bits", "thc 4 bits", "sparseloco"),
                                        (20, "thc 4 bits", "thc 4 bits", "sparseloco"),
                                        (100, "thc 4 bits", "thc 4 bits", "sparseloco"),
                                        (1000, "thc 4 bits", "thc 4 bits", "thc 4 bits")):
        for entry, want, schedules in ((True, now, False), (True, streamed, True), (False, before, False)):
            s = Adjuster(modes=("sync", "local"), window=1, min_density=0.01, max_density=0.01)
            r = ModeRule(s, Controller(s, density=0.01), 2, auto_rungs(entry), link_bps=rate * MBIT,
                         schedules=schedules)
            est = dataclasses.replace(estimate(rate * MBIT, kappa=0.13, elements=1.18e6, compute_s=0.045),
                                      cpu_s=0.004, backlog_kappa_thc=1.0)
            for _ in range(10):
                _, why = r.after_sync(est)
                if r.mode == "local":
                    break
            assert r.mode == "local" and r.rung.name.startswith(want), (rate, entry, schedules, why)
            if entry:   # against the backlog alone: more entering, more later at 1 % (not at 3 %, H = 16)
                plain = ModeRule(s, Controller(s, density=0.01), 2, auto_rungs(False), link_bps=rate * MBIT)
                for i in range(3):
                    for h in (8, 16, 64):
                        entering = r.local_score(est, 0.05, 0.1, h, i, entering=True)
                        was = plain.local_score(est, 0.05, 0.1, h, i, entering=True)
                        assert entering == was if i == 0 else entering > 1.25 * was   # (THC: no entry cost)
                        later = r.local_score(est, 0.05, 0.1, h, i)
                        was = plain.local_score(est, 0.05, 0.1, h, i)
                        one = r.pseudo[i].name.startswith("sparseloco 1 %")
                        assert later == was if i == 0 else later > 1.15 * was if one else later > 0.97 * was, (
                            r.pseudo[i].name, h, later / was)


def test_another_rungs_steps_under_a_schedule_carry_its_own_exchange_in_flight():
    """in_flight_scaled: what this rung's exchange in flight added over the cycle's median step
    is scaled by the payloads' ratio for another rung (at most 1: a larger payload is charged
    this one's, no more); so are the overhead's slowdown and the fit's per-exchange term. On the
    20 Mbit/s scenario of the byte LM (THC's delayed fragments measured 94 ms per step, 196 ms
    blocked, against a median step of 61 ms) SparseLoCo 3 % then scores 30 % below what it
    scored at THC's 94 ms."""
    from stella_mpi.adjust.mode_rule import in_flight_scaled
    from stella_mpi.optim.tuning import auto_pseudo_rungs
    step, overhead, fit = in_flight_scaled(0.094, 0.061, (0.1, 0.02), (0.05, 0.4), 0.1)
    assert (step, *overhead, *fit) == pytest.approx((0.061 + 0.0033, 0.1, 0.002, 0.05, 0.04))
    assert in_flight_scaled(0.094, 0.061, None, None, 3.0) == (pytest.approx(0.094), None, None)
    assert in_flight_scaled(0.094, None, None, None, 0.1)[0] == 0.094      # no median measured
    assert in_flight_scaled(0.050, 0.061, None, None, 0.1)[0] == 0.050     # the median above: nothing added
    est = dataclasses.replace(estimate(10 * MBIT, kappa=0.13, elements=1.18e6, compute_s=0.045), cpu_s=0.005,
                              backlog_kappa_thc=1.0)

    def scheduled(steady, blocking_first):
        """The rule's reason after a period of THC's delayed fragments, with the cycle's median
        ``steady`` (``blocking_first``: a blocking exchange measured before, the rule's base)."""
        s = Adjuster(modes=("sync", "local"), window=1, min_density=0.01, max_density=0.01)
        r = ModeRule(s, Controller(s, density=0.01), 2, rungs_of(auto_pseudo_rungs()), link_bps=10 * MBIT,
                     schedules=True)
        r.take("local", est, schedule=None if blocking_first else Schedule(2, 4))
        if blocking_first:
            r.after_local(0.070, 0.9, 32)
            assert r.base is not None
        return r.after_local(0.094, 0.196, 32, wire_s=0.9, schedule=Schedule(2, 4), steady_s=steady)[1]

    scores = {}
    for steady in (None, 0.061):
        why = scheduled(steady, False)
        sparse = float(re.findall(r"0\.\d+", why.split("sparseloco 3 %")[-1])[-1])   # (the last option)
        scores[steady] = (float(re.search(r"local (0\.\d+)", why).group(1)), sparse)
        assert ("(median 61.0)" in why) == (steady is not None), why
    (thc, slc_then), (thc_now, slc_now) = scores[None], scores[0.061]
    assert thc == thc_now and slc_now < 0.75 * slc_then and slc_now < thc, scores
    # where a blocking exchange's step stands for the step (the rule's ``base``), nothing was in
    # flight beside it: the median does not move it
    whys = [scheduled(steady, True).split("sparseloco 1 %")[-1] for steady in (None, 0.061)]
    assert whys[0] == whys[1], whys


def test_in_local_mode_a_slow_exchange_moves_to_a_smaller_rung():
    """THC's exchange measured at 2 s (the link fell to 2 Mbit/s): SparseLoCo's, predicted from it
    by the payloads' ratio, wins; after the dead band (two votes) the rule takes it, mode still
    local, at the H it predicts, and forgets the step times THC's exchanges in flight gave."""
    r, s = auto_rule(1000 * MBIT)
    est = dataclasses.replace(estimate(1000 * MBIT), cpu_s=0.004, backlog_kappa_thc=1.0)
    while r.mode == "sync":
        r.after_sync(est)
    assert r.rung.name == "thc 4 bits"
    r.paced = {2: 0.060, 4: 0.058}   # as THC's exchange in flight slowed the steps (a delayed schedule)
    slow = 0.002 + 0.004 + 8 * 0.5e6 / (2 * MBIT)   # THC's 0.5 MB per exchange at 2 Mbit/s
    outcomes = [r.after_local(0.056, slow, 64) for _ in range(3)]
    assert [m for m, _ in outcomes] == ["local"] * 3
    assert outcomes[1][1].startswith("steady") and "sparseloco" in outcomes[1][1]
    assert outcomes[2][1].startswith("local steps through sparseloco"), outcomes[2][1]
    assert r.rung.name.startswith("sparseloco") and r.mode == "local"
    assert r.paced == {}   # SparseLoCo's exchange slows the steps by its own work: measured again
    moved = slow - 0.002 - 0.004
    thc = r.pseudo[0].payload_per_entry   # (about 0.5 bytes per entry between two clusters)
    x = 0.006 + moved * r.rung.payload_per_entry / thc
    assert r.predicted_every == scored_every(r, r.sync_estimate, 0.056, x, r.pseudo_index)


def test_a_rung_inside_the_dead_band_is_not_taken():
    """Two rungs of the same cost but for a little payload: the other one never wins by h/2."""
    s = Adjuster(modes=("sync", "local"), window=1, min_density=1.0, max_density=1.0, backlog_cost=0.0)
    ctrl = Controller(s, density=1.0)
    r = ModeRule(s, ctrl, 2, [one_rung(0.50, name="a"), one_rung(0.45, name="b")], link_bps=100 * MBIT)
    r.take("local", estimate(100 * MBIT))
    for _ in range(6):
        mode, why = r.after_local(0.056, 0.05, 8)
        assert mode == "local" and r.rung.name == "a", why


def test_pseudo_rungs_are_validated():
    from stella_mpi import Compression
    ok = Adjuster(pseudo_rungs=[Compression.thc(bits=4), Compression.sparseloco(0.01)])
    assert isinstance(ok.pseudo_rungs, tuple) and len(ok.pseudo_rungs) == 2
    with pytest.raises(ValueError, match="THC or sparse"):
        Adjuster(pseudo_rungs=(Compression.fp16,))
    with pytest.raises(ValueError, match="coefficients"):
        Adjuster(pseudo_rungs=(Compression.dct(0.01),))
    with pytest.raises(ValueError, match="same compression twice"):
        Adjuster(pseudo_rungs=(Compression.sparseloco(0.01), Compression.sparseloco(0.01)))
    with pytest.raises(ValueError, match="tuple"):
        Adjuster(pseudo_rungs=Compression.sparseloco(0.01))


def test_a_checkpoint_names_its_rung():
    from stella_mpi.optim.tuning import checked_mode
    rungs = ["thc 4 bits", "sparseloco 1 % 2 bits decay 0.95"]
    assert checked_mode({"mode": "local", "sync_estimate": None, "pseudo": rungs[1]}, rungs) == ("local", None, 1)
    assert checked_mode({"mode": "sync", "sync_estimate": None}, rungs) == ("sync", None, None)   # (before the rungs)
    with pytest.raises(ValueError, match="'topk 1 %' which is not one of|not one of this optimizer's rungs"):
        checked_mode({"mode": "local", "sync_estimate": None, "pseudo": "topk 1 %"}, rungs)


def test_a_checkpoint_names_its_replicas():
    from stella_mpi.optim.tuning import checked_inner
    assert checked_inner({"mode": "local", "sync_estimate": None}, True) == "cluster"   # (before the choice)
    assert checked_inner({"mode": "local", "inner": "rank"}, True) == "rank"
    assert checked_inner({"mode": "sync", "inner": "cluster"}, False) == "cluster"
    with pytest.raises(ValueError, match="inner must be one of cluster, rank, got 'node'"):
        checked_inner({"mode": "local", "inner": "node"}, True)
    with pytest.raises(ValueError, match="local steps are the user's .*load it into the automatic route"):
        checked_inner({"mode": "local", "inner": "rank"}, False)


def test_the_automatic_route_steps_a_sparse_rung_by_the_clusters_sum():
    """bench/bench_parity.py (4 seeds, SparseLoCo 1 %): averaging halves an entry one cluster sent
    (+4.6 %), Nesterov's momentum over error feedback overshoots (+16 %), the sum is level (+0.15 %)."""
    from stella_mpi import Compression
    from stella_mpi.optim.tuning import auto_outer_of, auto_pseudo_rungs
    thc, sparse1, sparse3 = auto_pseudo_rungs()
    assert auto_outer_of(thc, 2) == {"lr": 0.7, "momentum": 0.9, "nesterov": True}
    assert auto_outer_of(sparse1, 3) == auto_outer_of(sparse3, 3) == {"lr": 3.0, "momentum": 0.0, "nesterov": False}
    assert auto_outer_of(Compression.topk(0.01), 2)["lr"] == 2.0
    assert auto_outer_of(sparse1, 2, adaptive=True) == auto_outer_of(sparse1, 2)   # the inner optimizer aside


def test_the_automatic_route_averages_thc_pseudo_gradients_under_an_adam_family_optimizer():
    """bench/results/outer_step_31_s10.json: with Adam inside, averaging ended 12-19 % below DiLoCo's
    Nesterov at equal steps in 10 of 10 pairs; with SGD inside, Nesterov stays."""
    import torch
    from stella_mpi.optim.tuning import adaptive_inner, auto_outer_of, auto_pseudo_rungs
    params = [torch.nn.Parameter(torch.zeros(3))]
    for cls in (torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adamax):
        assert adaptive_inner(cls(params, lr=1e-3)), cls
    for opt in (torch.optim.SGD(params, lr=0.1, momentum=0.9), torch.optim.RMSprop(params), torch.optim.Adagrad(params)):
        assert not adaptive_inner(opt), opt
    thc = auto_pseudo_rungs()[0]
    assert auto_outer_of(thc, 2, adaptive=True) == {"lr": 1.0, "momentum": 0.0, "nesterov": False}
    assert auto_outer_of(thc, 2, adaptive=False) == {"lr": 0.7, "momentum": 0.9, "nesterov": True}


def test_a_sparse_pseudo_gradient_holds_back_least_at_h8():
    """The synchronous sparse shape on its own scale (not the run's kappa), times
    sparse_pseudo_factor(H): 1 at H = 8, 8/H below (its residual decays at every exchange),
    sqrt(H/8) above (an entry waits 1/d exchanges of H steps); THC's does not depend on H."""
    from stella_mpi import Compression
    from stella_mpi.optim.tuning import PSEUDO_SPARSE_KAPPA, pseudo_backlog, sparse_pseudo_factor
    s = Adjuster(modes=("sync", "local"))
    ctrl = Controller(s, density=0.01)
    est = dataclasses.replace(estimate(100 * MBIT, kappa=0.5), backlog_kappa_thc=1.0)
    sparse, thc = Compression.sparseloco(0.01), Compression.thc(bits=4)
    sync = PSEUDO_SPARSE_KAPPA * math.sqrt(99)
    for kappa in (0.1, 0.5, 2.0):   # whatever the synchronous route measured
        assert pseudo_backlog(ctrl, dataclasses.replace(est, backlog_kappa=kappa), sparse, 8) == pytest.approx(sync)
    assert [sparse_pseudo_factor(h) for h in (1, 2, 8, 32, 64)] == pytest.approx([8, 4, 1, 2, math.sqrt(8)])
    assert min(range(1, 200), key=sparse_pseudo_factor) == 8
    assert pseudo_backlog(ctrl, est, sparse, 8) == pytest.approx(sync)
    assert pseudo_backlog(ctrl, est, sparse, 2) == pytest.approx(4 * sync)
    assert pseudo_backlog(ctrl, est, sparse, 32) == pytest.approx(2 * sync)
    assert pseudo_backlog(ctrl, est, thc, 2) == pseudo_backlog(ctrl, est, thc, 64) == pytest.approx(1.0 / 7)
    assert pseudo_backlog(ctrl, est, Compression.fp16, 8) == 0.0


def test_a_rule_needs_a_pseudo_rung():
    s = Adjuster(modes=("sync", "local"))
    with pytest.raises(ValueError, match="at least one pseudo-gradient rung"):
        ModeRule(s, Controller(s, density=0.01), 2, [])


# ---------------- the schedule of local steps: fragments and a delay (Streaming DiLoCo's)

def test_a_schedule_blocks_on_what_its_delay_does_not_hide():
    # 120 ms of wire, 20 ms of encoding, 1 ms latency, 30 ms steps
    assert scheduled_exchange(0.020, 0.120, 0.001, 0.030, BLOCKING) == pytest.approx(0.140)
    # one fragment in flight for 2 steps hides 60 ms of the 140
    assert scheduled_exchange(0.020, 0.120, 0.001, 0.030, Schedule(1, 2)) == pytest.approx(0.080)
    # 4 fragments of 1 step each hide 4 x 30 ms of 143 (the latency paid 3 more times)
    assert scheduled_exchange(0.020, 0.120, 0.001, 0.030, Schedule(4, 1)) == pytest.approx(0.023)
    # 2 fragments of 3 steps hide 180 ms: the wire and the encoding and decoding beside it
    assert scheduled_exchange(0.020, 0.120, 0.001, 0.030, Schedule(2, 3)) == pytest.approx(0.0)
    assert scheduled_exchange(0.020, 0.120, 0.001, 0.020, Schedule(2, 3)) == pytest.approx(0.021)
    # the delay that hides one fragment's wire, at least 1, below H/F and at most max_delay
    assert delay_for(16, 1, 8, 0.120, 0.001, 0.030) == 4
    assert delay_for(16, 4, 8, 0.120, 0.001, 0.030) == 2     # 123 ms / 4 = 31 ms: just over a step
    assert delay_for(8, 2, 8, 0.120, 0.001, 0.030) == 3     # 61 ms would need 3 steps; 8/2 - 1 = 3
    assert delay_for(8, 4, 8, 0.120, 0.001, 0.030) == 1     # 8/4 - 1
    assert delay_for(64, 1, 2, 0.120, 0.001, 0.030) == 2     # max_delay
    assert delay_for(16, 1, 8, 1e-6, 0.0, 0.030) == 1
    # the H200's fragments of 2 (100 Mbit/s): 9.4 ms of wire and 11 ms of encoding and decoding
    # each, 8 ms steps: the wire alone asks for 2 steps, the whole exchange for 3
    assert delay_for(16, 2, 8, 0.0188, 0.0, 0.008) == 2
    assert delay_for(16, 2, 8, 0.0188, 0.0, 0.008, cpu_s=0.022) == 3
    assert local_backlog_shape(9, 2, delay=0) == pytest.approx(0.5 * 2.0)


def test_the_delay_hides_the_largest_fragment_of_an_uneven_cut():
    """The byte LM's balanced cut into 4 (whole parameters: two 1024 x 1024 matrices) holds 45 %,
    0 %, 44 % and 11 % of the entries. Its exchange of 450 ms of wire at 65 ms steps: the
    largest fragment takes 202 ms, so delay 4 hides it where 1/F each asked for 2; at delay 2
    two landings block 70 ms each (measured at 100 Mbit/s: 124 ms steps at 2 of the 4 landings,
    60-65 ms elsewhere), where 1/F each predicted none."""
    import torch
    from stella_mpi.optim.fragments import fragment_shares
    model = torch.nn.Sequential(torch.nn.Embedding(32, 256), torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024),
                                torch.nn.Linear(1024, 256))
    shares = fragment_shares(list(model.named_parameters()), 4)
    assert len(shares) == 4 and sum(shares) == pytest.approx(1.0)
    assert [round(x, 2) for x in shares] == [0.45, 0.0, 0.44, 0.11], shares
    assert fragment_shares(list(model.named_parameters()), 1) == (1.0,)
    lm = (0.446, 0.001, 0.442, 0.111)
    exchanges = fragment_exchanges(0.0, 0.451, 0.001, 4, lm)
    assert sum(exchanges) == pytest.approx(0.451 + 3 * 0.001, rel=1e-3) and max(exchanges) == pytest.approx(0.2017)
    assert fragment_exchanges(0.0, 0.451, 0.001, 4) == pytest.approx([0.1135] * 4)
    assert delay_for(32, 4, 8, 0.451, 0.001, 0.065) == 2
    assert delay_for(32, 4, 8, 0.451, 0.001, 0.065, shares=lm) == 4
    assert scheduled_exchange(0.0, 0.451, 0.001, 0.065, Schedule(4, 2)) == 0.0
    assert scheduled_exchange(0.0, 0.451, 0.001, 0.065, Schedule(4, 2), lm) == pytest.approx(0.0717 + 0.0699)
    assert scheduled_exchange(0.0, 0.451, 0.001, 0.065, Schedule(4, 4), lm) == 0.0
    # equal shares give the aggregate form back
    for sched in (Schedule(2, 1), Schedule(4, 1), Schedule(2, 3)):
        assert scheduled_exchange(0.02, 0.12, 0.001, 0.03, sched, (1 / sched.fragments,) * sched.fragments) == \
            pytest.approx(scheduled_exchange(0.02, 0.12, 0.001, 0.03, sched))
    assert local_backlog_shape(9, 2, delay=5) == pytest.approx(0.5 * 3.0)


def scheduled_rule(schedules=True, **kw):
    s = Adjuster(modes=("sync", "local"), window=1, min_density=0.01, max_density=0.01, **kw)
    ctrl = Controller(s, density=0.01)
    r = ModeRule(s, ctrl, 2, [one_rung(0.5)], link_bps=100 * MBIT, schedules=schedules)
    r.take("local", dataclasses.replace(estimate(100 * MBIT), cpu_s=0.002))
    return r, s


def test_local_steps_enter_with_the_schedule_the_prediction_scores_best():
    """2 s of exchange at 2 Mbit/s against 60 ms steps: with schedules offered, local steps start
    with fragments in flight beside the steps, the delay below H/F; without, blocking."""
    s = Adjuster(modes=("sync", "local"), window=1, min_density=0.01, max_density=0.01)
    est = dataclasses.replace(estimate(2 * MBIT), cpu_s=0.002)
    for schedules in (True, False):
        r = ModeRule(s, Controller(s, density=0.01), 2, [one_rung(0.5)], link_bps=2 * MBIT, schedules=schedules)
        while r.mode == "sync":
            _, why = r.after_sync(est)
        sched, every = r.predicted_schedule, r.predicted_every
        if schedules:
            assert sched.delay >= 1 and every % sched.fragments == 0 and sched.delay < every // sched.fragments, why
            assert "delay %d" % sched.delay in why, why
        else:
            assert sched == BLOCKING, why


def test_a_long_blocking_exchange_moves_to_a_delayed_schedule_after_the_dead_band():
    """0.5 MB at 100 Mbit/s: 40 ms of wire per exchange against 10 ms steps, measured blocking
    at H=8 (5 ms a step more): the rule predicts the wire hidden behind inner steps and, two
    votes later, takes a schedule with a delay (mode still local), at an H that is a multiple
    of its F with room for the delay; without schedules it never does."""
    r, s = scheduled_rule()
    blocking = 0.002 + 0.002 + 8 * 0.5e6 / (100 * MBIT)   # latency (2 messages), encoding, the wire
    outcomes = [r.after_local(0.010, blocking, 8) for _ in range(3)]
    assert [m for m, _ in outcomes] == ["local"] * 3
    assert outcomes[1][1].startswith("steady") and "delay" in outcomes[1][1], outcomes[1][1]
    assert "fragments" in outcomes[2][1] or "delayed" in outcomes[2][1], outcomes[2][1]
    sched, every = r.predicted_schedule, r.predicted_every
    assert sched.delay >= 1 and every % sched.fragments == 0 and sched.delay < every // sched.fragments
    assert sched.delay <= s.max_delay
    off, _ = scheduled_rule(schedules=False)
    for _ in range(4):
        off.after_local(0.010, blocking, 8)
    assert off.predicted_schedule == BLOCKING
    nodelay, _ = scheduled_rule(max_delay=0)
    for _ in range(4):
        nodelay.after_local(0.010, blocking, 8)
    assert nodelay.predicted_schedule == BLOCKING


def test_the_schedule_entered_from_a_prediction_is_corrected_by_the_measured_exchange():
    """Local steps enter with a schedule the prediction hides the whole exchange behind (one
    fragment, delay 1, at 100 Mbit/s); measured, it blocks 150 ms a period of 300 ms of
    exchange. Another schedule of the rung then scores about 6 % lower: inside the dead band
    (12.5 %), above the calibration's 3 %. Right after entering, two decisions running take it,
    with no wait for the window; the same measurements in a phase not entered from a prediction
    (a checkpoint's take) change nothing, nor after the calibration's decisions are spent."""
    s = Adjuster(modes=("sync", "local"), window=3, min_density=0.01, max_density=0.01)
    est = dataclasses.replace(estimate(100 * MBIT, compute_s=0.050, fixed_s=0.010), cpu_s=0.002)
    from stella_mpi.optim.tuning import outer_period_cost   # (the automatic route's THC rung's)

    def entered():
        r = ModeRule(s, Controller(s, density=0.01), 2, [one_rung(0.5, period=outer_period_cost)], link_bps=100 * MBIT,
                     schedules=True)
        while r.mode == "sync":
            _, why = r.after_sync(est)
        assert r.predicted_schedule == Schedule(1, 1) and r.predicted_every == 32, why
        r.link_bps = None   # (the link as the delayed exchange reads it: no probe bounds it from below)
        return r

    r = entered()
    first = r.predicted_schedule
    outcomes = [r.after_local(0.060, 0.150, 32, wire_s=0.300, schedule=first) for _ in range(2)]
    assert outcomes[0][1].startswith("steady"), outcomes[0][1]
    mode, why = outcomes[1]
    assert mode == "local" and why.startswith("the measured exchange calls for another schedule"), why
    assert r.predicted_schedule.fragments > 1 and r.predicted_schedule.delay >= 1, r.predicted_schedule
    assert r.predicted_every == 32 and r._calibrating == 0
    # the gain is inside the dead band: without the calibration the rule stays
    for prepare in ("take", "spent"):
        r = entered()
        if prepare == "take":
            r.take("local", r.sync_estimate, schedule=first)
        else:
            for _ in range(CALIBRATION):   # the calibration's decisions, measured as predicted
                r.after_local(0.058, 0.0, 32, wire_s=0.040, schedule=first)
            assert r.predicted_schedule == first
        for _ in range(6):
            mode, why = r.after_local(0.060, 0.150, 32, wire_s=0.300, schedule=first)
            assert mode == "local" and why.startswith("steady"), (prepare, why)
        assert r.predicted_schedule == first


def test_a_schedule_that_blocks_beyond_the_model_goes_back_and_is_remembered():
    """A delayed phase measured blocking 400 ms a period where the model predicts 2 ms (its
    landings wait for an exchange slower than the steps it ran beside): that excess, per
    landing, is charged to every delayed schedule, so the blocking exchange wins back; once
    blocking again, the delayed kind keeps its excess: the rule does not go straight back."""
    r, s = scheduled_rule()
    est = r.sync_estimate
    now = Schedule(2, 3)
    r.predicted_schedule = now
    wire = 0.002 + 8 * 0.5e6 / (100 * MBIT)
    outcomes = [r.after_local(0.010, 0.400, 8, wire_s=2 * wire, schedule=now) for _ in range(3)]
    assert outcomes[2][1].startswith("local steps through thc 4 bits reach"), outcomes[2][1]
    assert r.predicted_schedule == BLOCKING
    # 400 ms per period, less what the model predicts at the probed link (nothing: 3 steps hide
    # each fragment's 23 ms), per landing
    assert r.overheads[(2, True)][0] == pytest.approx(0.2)
    blocking = 0.002 + 0.002 + 8 * 0.5e6 / (100 * MBIT)
    for _ in range(4):
        mode, why = r.after_local(0.010, blocking, r.predicted_every)
        assert mode == "local" and r.predicted_schedule in (BLOCKING, Schedule(1, r.predicted_schedule.delay)) \
            and r.predicted_schedule.fragments != 2, why
    assert est is r.sync_estimate


def test_the_schedule_settings_are_validated():
    for bad in ((), (0,), (1, 1), (True,), (1.5,), "4"):
        with pytest.raises(ValueError, match="fragments must be distinct integers >= 1"):
            Adjuster(fragments=bad)
    # (the ladders share one check: THC's bits are the bounded one, and may be empty)
    for bad in ((1,), (9,), (4, 4), (True,), "4"):
        with pytest.raises(ValueError, match=r"thc_bits must be distinct integers in \[2, 8\]"):
            Adjuster(thc_bits=bad)
    assert Adjuster(thc_bits=(8, 2)).thc_bits == (2, 8)
    for bad in (-1, 1.5, True, None):
        with pytest.raises(ValueError, match="max_delay must be an int >= 0"):
            Adjuster(max_delay=bad)
    assert Adjuster(fragments=[4, 1]).fragments == (1, 4)


def test_a_schedule_whose_steps_run_slower_is_charged_for_them_and_left():
    """The blocking exchange measured at 10 ms a step; under 2 fragments with a delay the
    landings block little, but the steps take 20 ms (the exchange in flight shares the
    collective thread with the cluster's reductions): the 8 x 10 ms per period is that
    schedule's overhead (10 ms a step), every option is scored at the blocking step (plus its
    kind's slowdown), and the rule goes back; a checkpoint's take() forgets what was measured."""
    r, s = scheduled_rule()
    blocking = 0.002 + 0.002 + 8 * 0.5e6 / (100 * MBIT)
    r.after_local(0.010, blocking, 8)
    assert r.base[0] == 0.010
    now = Schedule(2, 3)
    r.predicted_schedule = now
    wire = 0.002 + 8 * 0.5e6 / (100 * MBIT)
    outcomes = []
    while r.predicted_schedule == now and len(outcomes) < 3:
        outcomes.append(r.after_local(0.020, 0.004, 8, wire_s=2 * wire, schedule=now))
    assert outcomes[-1][1].startswith("local steps through thc 4 bits reach"), outcomes
    # the link as the blocking exchange measured it (0.5 MB in 40 ms beyond the latency and the
    # 2 ms of encoding), not as the schedule's wire
    assert "link 100 Mbit/s measured by the blocking exchange" in outcomes[-1][1], outcomes[-1][1]
    assert r.predicted_schedule == BLOCKING
    assert r.overheads[(2, True)][1] == pytest.approx(0.010)   # a step 10 ms slower than the blocking one
    assert r.base[0] == 0.010   # (kept: measured under the blocking schedule only)
    r.take("local", r.sync_estimate)
    assert r.overheads == {} and r.base is None


def test_two_other_options_best_in_turn_are_taken_at_the_second_decision():
    """Two other rungs, each far below the one in force and within a hair of each other, best in
    turn: the dead band's two decisions running count for leaving, whichever of them wins each
    time, and the second decision's best is taken (counted per option, the votes never met)."""
    turn = {"a": False}
    a = PseudoRung("a", 0.05, lambda est, every: 0.0 if turn["a"] else 0.2)
    b = PseudoRung("b", 0.05, lambda est, every: 0.2 if turn["a"] else 0.0)
    s = Adjuster(modes=("sync", "local"), window=1, min_density=0.01, max_density=0.01)
    r = ModeRule(s, Controller(s, density=0.01), 2, [one_rung(0.5), a, b], link_bps=20 * MBIT)
    r.take("local", dataclasses.replace(estimate(20 * MBIT), cpu_s=0.002))
    blocked = 0.002 + 0.002 + 8 * 0.5e6 / (20 * MBIT)   # THC's 0.5 MB at 20 Mbit/s: 200 ms a period
    outcomes = []
    for _ in range(3):   # the window's decision (b best), then a, then b
        outcomes.append(r.after_local(0.010, blocked, 8))
        turn["a"] = not turn["a"]
    assert [why.startswith("steady") for _, why in outcomes] == [True, True, False], outcomes
    assert outcomes[2][1].startswith("local steps through b reach the loss sooner"), outcomes[2][1]
    assert r.pseudo_index == 2 and r.mode == "local"


def test_a_vote_for_sync_after_one_for_local_steps_starts_the_count_over():
    """Leaving for another local option and going back to sync are two sides: one decision for
    each takes neither; the second running for sync takes it."""
    turn = {"sync": False}
    a = PseudoRung("a", 0.05, lambda est, every: 0.0)
    s = Adjuster(modes=("sync", "local"), window=1, min_density=0.01, max_density=0.01)
    r = ModeRule(s, Controller(s, density=0.01), 2, [one_rung(0.5), a], link_bps=20 * MBIT)
    r.take("local", dataclasses.replace(estimate(20 * MBIT), cpu_s=0.002))
    r.sync_score = lambda est: 0.001 if turn["sync"] else 1.0   # far below every option, or far above
    blocked = 0.002 + 0.002 + 8 * 0.5e6 / (20 * MBIT)
    outcomes = []
    for sync in (False, False, True, True):   # the window's decision; local (a); sync; sync again
        turn["sync"] = sync
        outcomes.append(r.after_local(0.010, blocked, 8))
    assert [why.startswith("steady") for _, why in outcomes] == [True, True, True, False], outcomes
    assert outcomes[3][0] == "sync" and r.mode == "sync" and r.pseudo_index == 0


def test_replicas_taken_in_local_steps_recalibrate_a_predicted_schedule():
    """take(recalibrate=True) in local steps with schedules: the first measured decisions may
    correct the schedule in force, as after entering; a checkpoint's take, sync, or a rule without
    schedules does not."""
    r, _ = scheduled_rule()
    r.take("local", recalibrate=True)
    assert r._calibrating == CALIBRATION
    r.take("local")
    assert r._calibrating == 0
    r.take("sync", recalibrate=True)
    assert r._calibrating == 0
    plain, _ = scheduled_rule(schedules=False)
    plain.take("local", recalibrate=True)
    assert plain._calibrating == 0


def test_a_delayed_exchange_entered_without_a_blocking_one_reads_the_link_no_slower_than_the_probe():
    """Local steps entered under a delayed schedule measure no blocking exchange: the wire's time
    of a fragment in flight holds its wait for cores shared with the steps, so it bounds the
    link's rate from below only. Read at 10 Mbit/s on a link probed at 100 Mbit/s, the probe's
    rate is the link (a sparser rung's smaller payload does not look ten times cheaper); read
    faster than the probe, the reading is the link."""
    r, s = scheduled_rule()
    now = Schedule(2, 3)
    r.predicted_schedule = now
    moved = 8 * 0.5e6 / (100 * MBIT)   # 0.5 MB at 100 Mbit/s: 40 ms beyond the latency and the encoding
    latency = 2 * 0.001
    _, why = r.after_local(0.010, 0.004, 8, wire_s=2 * latency + 0.002 + 10 * moved, schedule=now)
    assert r.base is None
    assert re.search(r"link 100 Mbit/s as probed before the first step \(a delayed exchange's wire read 10 Mbit/s\)", why), why
    _, why = r.after_local(0.010, 0.004, 8, wire_s=2 * latency + 0.002 + moved / 4, schedule=now)
    assert "link 400 Mbit/s measured by the exchange of local steps" in why, why
    r.link_bps = None   # (no probe: the user's modes) the reading as it is
    _, why = r.after_local(0.010, 0.004, 8, wire_s=2 * latency + 0.002 + 10 * moved, schedule=now)
    assert "link 10 Mbit/s measured by the exchange of local steps" in why, why


def test_delayed_options_are_scored_at_the_step_fitted_over_the_measured_periods():
    """An exchange in flight slows the steps beside it once per period: measured under a
    delayed schedule at 111 ms a step at H=2 and 99 ms at H=4 (no blocking phase), the fit
    gives 87 ms with no exchange in flight and 48 ms per exchange, so a delayed option at H=16
    is scored at 90 ms, not at H=4's 99: the best other schedule is a long period, about 10 %
    below the one in force, where scored at the measured step a short one led by 2 %. One H
    alone, or steps no slower at the shorter H, fit nothing; a checkpoint's take() forgets."""
    from stella_mpi.adjust.mode_rule import inflight_fit
    from stella_mpi.optim.tuning import average_period_cost   # (averaging under Adam: flat to H=16)
    assert inflight_fit({2: 0.111}) is None and inflight_fit({2: 0.090, 4: 0.095}) is None
    base, per_exchange = inflight_fit({2: 0.111, 4: 0.099})
    assert base == pytest.approx(0.087) and per_exchange == pytest.approx(0.048)
    s = Adjuster(modes=("sync", "local"), window=1, min_density=0.01, max_density=0.01)
    est = dataclasses.replace(estimate(1000 * MBIT, compute_s=0.040, fixed_s=0.040, elements=1.2e6), cpu_s=0.009)
    r = ModeRule(s, Controller(s, density=0.01), 2, [one_rung(0.5, period=average_period_cost)],
                 link_bps=1000 * MBIT, schedules=True)
    while r.mode == "sync":
        r.after_sync(est)
    r.after_local(0.111, 0.010, 2, wire_s=0.10, schedule=Schedule(1, 1))
    _, why = r.after_local(0.099, 0.010, 4, wire_s=0.12, schedule=Schedule(1, 1))
    assert r.paced == {2: 0.111, 4: 0.099}
    now = float(re.search(r"local ([0-9.]+), sync", why).group(1))
    other = re.search(r"thc 4 bits H=(\d+)[a-z0-9, ]* ([0-9.]+)$", why)
    assert int(other.group(1)) >= 16 and float(other.group(2)) < 0.92 * now, why
    r.take("local", r.sync_estimate)
    assert r.paced == {}


def test_schedules_are_offered_where_no_inner_step_waits_on_the_collective_thread():
    from types import SimpleNamespace
    from stella_mpi.optim.outer_sync import LocalSteps
    from stella_mpi.optim.tuning import schedules_fit
    ones, twos, uneven = (SimpleNamespace(cluster_members=m) for m in ([[0], [1]], [[0, 1], [2, 3]], [[0, 2], [1]]))
    ls = LocalSteps(every=8)
    assert schedules_fit(ls, ones) and not schedules_fit(ls, twos) and not schedules_fit(ls, uneven)
    # clusters of several ranks whose inner steps all reduce on their ClusterChannel
    assert schedules_fit(ls, twos, off_thread=True) and schedules_fit(ls, uneven, off_thread=True)
    import torch
    instance = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)   # (one outer for the whole model)
    for own in (LocalSteps(every=8, fragments=2), LocalSteps(every=8, delay=1), LocalSteps(every=8, overlap=True),
                LocalSteps(every=8, pace="time"), LocalSteps(every=8, outer=instance)):
        assert not schedules_fit(own, ones) and not schedules_fit(own, twos, off_thread=True)


def test_an_outer_nesterov_rung_is_given_its_best_period_unless_the_link_needs_longer():
    """The automatic route's THC rung steps by DiLoCo's Nesterov, whose cost per period
    (optim/tuning.py's outer_period_cost, measured) is least at H = 32. With the drift this rule
    charges alone (kappa 0.13, as the byte LM measured), the least score is the ladder's longest
    period at every rate; with the outer step's cost it is 32 from 20 Mbit/s to 1 Gbit/s, and 64
    where the exchange (2 s at 2 Mbit/s) outweighs it."""
    from stella_mpi import Compression
    from stella_mpi.optim.tuning import _backlog_of, outer_period_cost, payload_per_entry
    s = Adjuster(modes=("sync", "local"), window=1, min_density=0.01, max_density=0.01)
    thc = Compression.thc(bits=4)
    for rate, want in ((1000 * MBIT, 32), (100 * MBIT, 32), (20 * MBIT, 32), (2 * MBIT, 64)):
        for period, every in ((outer_period_cost, want), (None, 64)):
            ctrl = Controller(s, density=0.01)
            r = ModeRule(s, ctrl, 2, [PseudoRung("thc 4 bits", payload_per_entry(thc, 2), _backlog_of(ctrl, thc),
                                                 period)], link_bps=rate)
            _, why = r.after_sync(dataclasses.replace(estimate(rate, kappa=0.13), cpu_s=0.004, backlog_kappa_thc=1.0))
            assert r.predicted_every == every, (rate, why)


def test_entering_local_steps_predicts_a_steps_wall_time_with_its_exchange():
    """after_sync keeps a local step's predicted wall time under the option it scored best: the
    step (local_step_time) and the seconds its exchange blocks a period, over H."""
    r, _ = rule(Adjuster())
    est = estimate(20 * MBIT)
    r.after_sync(est)
    every = r.predicted_every
    blocked = r._predicted_exchange(est)   # (one rung, blocking: the whole exchange blocks)
    assert r.predicted_step_s == pytest.approx(local_step_time(est) + blocked / every)
    assert r.predicted_step_s > local_step_time(est)


@pytest.mark.parametrize("intra_s,step_s,chooses,inner,expect", [
    (0.010, 0.080, True, "cluster", 0.125),    # at the dead band's share (hysteresis 0.25 / 2): taken
    (0.009, 0.080, True, "cluster", None),     # below it: the first period measures
    (0.0, 0.080, True, "cluster", None),       # nothing reduced inside the clusters (one rank each)
    (0.040, 0.080, False, "cluster", None),    # the user's own local steps: replicas are theirs
    (0.040, 0.080, True, "rank", None),        # each rank a replica already
    (0.040, None, True, "cluster", None),      # no prediction (no synchronous decision yet)
    (0.040, 0.0, True, "cluster", None),
])
def test_each_rank_is_a_replica_from_the_entry_where_the_clusters_reductions_take_the_dead_bands_share(
        intra_s, step_s, chooses, inner, expect):
    """ModeSwitch._predicted_inner_share: the slowest rank's seconds in its cluster's reductions
    in the synchronous steps (Estimate.intra_s) over a local step's predicted wall time
    (ModeRule.predicted_step_s), where the automatic route chooses the replicas and each cluster
    is one still; at half the hysteresis or more (the share _choose_inner asks of the measured
    one), the share, else None."""
    from types import SimpleNamespace
    from stella_mpi.optim.tuning import ModeSwitch
    r, _ = rule(Adjuster())
    r.sync_estimate = dataclasses.replace(estimate(100 * MBIT), intra_s=intra_s)
    r.predicted_step_s = step_s
    switch = SimpleNamespace(chooses_inner=chooses, inner=inner, rule=r)
    share = ModeSwitch._predicted_inner_share(switch)
    assert share == (None if expect is None else pytest.approx(expect))
    r.sync_estimate = None
    assert ModeSwitch._predicted_inner_share(switch) is None
