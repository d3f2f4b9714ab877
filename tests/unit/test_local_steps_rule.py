"""The adjuster's choice of local steps H (stella_mpi/adjust/local_steps_rule.py): the smallest H
on the ladder whose amortized exchange fits the step-time budget, with hysteresis."""
import pytest

from stella_mpi.adjust.local_steps_rule import LocalStepsRule
from stella_mpi.adjust.settings import Adjuster


def rule(every=1, **kw):
    return LocalStepsRule(Adjuster(objective="step_time", target=kw.pop("target", 1.2), **kw), every)


def test_the_smallest_h_that_fits_the_budget():
    # 10 ms of compute per step, target 1.2: 2 ms per step for the exchange
    r = rule()
    assert r.observe(0.010, 0.030)[0] == 16          # 30 ms / 16 = 1.9 ms fits, / 8 = 3.75 ms does not
    r = rule()
    assert r.observe(0.010, 0.001)[0] == 1           # a fast link: synchronous every step
    r = rule(target=1.5)
    assert r.observe(0.010, 0.030)[0] == 8           # a looser budget: 5 ms per step


def test_nothing_fits_the_longest_period_and_says_so():
    r = rule()
    every, reason = r.observe(0.010, 10.0)
    assert every == 64 and reason.startswith("even the longest period on the ladder cannot hide the exchange")


def test_a_faster_link_lowers_h_only_after_two_decisions_and_within_the_dead_band():
    r = rule(every=16, window=1)
    assert r.observe(0.010, 0.030)[0] == 16          # fits (ratio 0.94): steady
    assert r.observe(0.010, 0.0035)[0] == 16         # 4 fits within 1 - 0.25 (0.44) ... once
    every, reason = r.observe(0.010, 0.0035)
    assert every == 4 and reason.startswith("the link allows more frequent exchanges")   # ... twice: down
    assert r.observe(0.010, 0.0035)[0] == 4          # 2 would be ratio 0.875: not within the dead band
    assert r.observe(0.010, 0.0095)[0] == 4          # ratio 1.19: within 1 + 0.25, stays
    every, reason = r.observe(0.010, 0.0110)         # ratio 1.375: over the budget, at once
    assert every == 8 and reason.startswith("the exchange exceeds the budget")


def test_a_current_h_off_the_ladder_is_kept_while_it_fits():
    r = rule(every=3, window=1)
    assert r.observe(0.010, 0.006)[0] == 3           # ratio 1.0 at H=3
    assert r.observe(0.010, 0.020)[0] == 16          # over: H >= 10 fits, the ladder's 16
    r = rule(every=100)
    assert r.observe(0.010, 10.0)[0] == 100          # nothing fits: never lower than it is


def test_the_medians_of_the_last_window_exchanges_decide():
    r = rule(every=1)                                # window 3 (the default)
    assert r.observe(0.010, 0.001)[0] == 1
    assert r.observe(0.010, 0.001)[0] == 1
    assert r.observe(0.010, 0.500)[0] == 1           # one slow exchange (a pause): the median is 1 ms
    every, reason = r.observe(0.010, 0.500)          # two of three: the link is slow now
    assert every == 64 and "exchange 500.0 ms" in reason


def test_the_ladder_is_validated():
    for bad in ((), (0, 2), (2, 2), (1.5,), (True,), "124"):
        with pytest.raises(ValueError, match="local_steps must be distinct integers >= 1"):
            Adjuster(local_steps=bad)
    assert Adjuster(local_steps=[8, 1, 2]).local_steps == (1, 2, 8)


def test_with_overlap_only_what_the_period_does_not_hide_counts():
    # 10 ms per step, 2 ms allowed; the boundary costs 1 ms besides, the wire 100 ms: 16 steps
    # (160 ms) hide the wire, 8 (80 ms) leave 20 ms to wait for; blocking, the same exchange needs 64
    r = rule()
    every, reason = r.observe(0.010, 0.001, 0.100)
    assert every == 16 and "(wire 100.0 ms, overlapped)" in reason
    assert rule().observe(0.010, 0.101)[0] == 64
    assert rule().observe(0.010, 0.001, 0.001)[0] == 1   # a fast wire: every step


def test_period_times_take_a_clusters_last_shard_and_the_earliest_cluster():
    from stella_mpi.adjust.local_steps_rule import period_times
    # rows: compute, exchange, wire (s), cluster
    # uneven clusters 2+1: rank 1 sends no shard (its wire is next to nothing) and waits for its
    # leader's wire inside the broadcast (its exchange is long): the leader's wire and exchange count
    assert period_times([[0.010, 0.002, 0.100, 0], [0.011, 0.090, 0.001, 0], [0.010, 0.003, 0.100, 1]]) == \
        (0.011, 0.002, 0.100)
    # equal clusters: shard 1 arrives later than shard 0 in both clusters; cluster 1 launched
    # later, so its ranks waited less for the other cluster
    assert period_times([[0.010, 0.030, 0.050, 0], [0.010, 0.002, 0.080, 0],
                         [0.012, 0.020, 0.040, 1], [0.012, 0.001, 0.070, 1]]) == (0.012, 0.001, 0.070)


# ---------------- H by time to loss (the automatic route and Adjuster(modes=...): ``score`` set)

def scored_rule(every, score, **kw):
    r = LocalStepsRule(Adjuster(modes=("sync", "local"), window=1, **kw), every)
    r.score = score
    return r


def test_with_a_score_h_is_the_ladder_least_score_after_two_decisions():
    # time per step with the exchange amortized, times a period cost least at 32 (an outer
    # Nesterov's): at 10 ms per step and 30 ms of exchange, 32 beats 16 (1.9 ms a step) by its cost
    from stella_mpi.optim.tuning import outer_period_cost

    def score(compute_s, blocked_s, every):
        return (compute_s + blocked_s / every) * outer_period_cost(every)
    r = scored_rule(16, score)
    every, why = r.observe(0.010, 0.030)
    assert every == 16 and why.startswith("steady") and "H=32 " in why, why   # one decision: not yet
    every, why = r.observe(0.010, 0.030)
    assert every == 32 and why.startswith("H=32 reaches the loss sooner"), why
    assert r.observe(0.010, 0.030)[0] == 32
    # a link 100 times slower: 3 s per exchange, 64 amortizes it best
    assert [r.observe(0.010, 3.0)[0] for _ in range(2)] == [32, 64]


def test_with_a_score_another_h_within_the_dead_band_is_not_taken():
    # two H within 1 - h/2 of each other: the current one stays however often the other wins
    r = scored_rule(8, lambda c, x, h: 1.0 if h == 8 else 0.95 if h == 16 else 2.0)
    for _ in range(5):
        assert r.observe(0.010, 0.010)[0] == 8
    # a vote for 16, then one for 4, then 16 again: never two running for the same H
    table = {}
    r = scored_rule(8, lambda c, x, h: table.get(h, 2.0))
    for better in (16, 4, 16):
        table.clear()
        table.update({8: 1.0, better: 0.5})
        assert r.observe(0.010, 0.010)[0] == 8
    assert r.observe(0.010, 0.010)[0] == 16   # (16 twice running)


def test_with_overlap_the_scored_period_counts_only_the_wire_it_does_not_hide():
    seen = {}

    def score(compute_s, blocked_s, every):
        seen[every] = blocked_s
        return compute_s + blocked_s / every
    scored_rule(8, score).observe(0.010, 0.001, 0.100)
    assert seen[8] == pytest.approx(0.021) and seen[16] == pytest.approx(0.001)


def test_averaging_under_adam_costs_little_up_to_h16_and_a_period_cost_follows_the_outer_step():
    """OUTER_AVERAGE_PERIOD (bench/results/outer_period_31_adam_s11.json): level up to H = 16,
    16 % more steps at 32, 19 % at 64; period_cost_of picks the table by the outer step."""
    from stella_mpi.optim.tuning import (OUTER_AVERAGE_PERIOD, average_period_cost, outer_period_cost,
                                         period_cost_of)
    for h, c in OUTER_AVERAGE_PERIOD:
        assert average_period_cost(h) == pytest.approx(c)
    assert average_period_cost(1) == pytest.approx(1.0) and average_period_cost(8) == pytest.approx(1.0)
    assert 1.0 < average_period_cost(24) < average_period_cost(32) < average_period_cost(64) < average_period_cost(128)
    nesterov, average, summed = ({"lr": 0.7, "momentum": 0.9, "nesterov": True}, {"lr": 1.0, "momentum": 0.0},
                                 {"lr": 2.0, "momentum": 0.0})
    assert period_cost_of(nesterov, False) is period_cost_of(nesterov, True) is outer_period_cost
    assert period_cost_of(average, True) is average_period_cost
    assert period_cost_of(average, False) is None and period_cost_of(summed, True) is None


def test_the_outer_period_cost_is_least_at_32_and_follows_the_measured_points():
    from stella_mpi.optim.tuning import OUTER_MOMENTUM_PERIOD, outer_period_cost
    for h, c in OUTER_MOMENTUM_PERIOD:
        assert outer_period_cost(h) == pytest.approx(c)
    assert min(range(1, 257), key=outer_period_cost) == 32
    assert outer_period_cost(2) > outer_period_cost(3) > outer_period_cost(4)          # between points, in log H
    assert outer_period_cost(1) > outer_period_cost(2) and outer_period_cost(128) > outer_period_cost(64)   # extrapolated
