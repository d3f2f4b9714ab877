"""The adjuster's controller on synthetic traces (a closed loop: the simulated link answers the
density the controller chose) and on a trace recorded over the emulated WAN."""
import json
import os
import random

import pytest

from stella_mpi.adjust import controller
from stella_mpi.adjust.controller import ROW_FIELDS, Controller, split_batch
from stella_mpi.adjust.settings import Adjuster

HERE = os.path.dirname(os.path.abspath(__file__))
# 2 clusters x 2 ranks; bytes per step and unit density like a 25M-parameter model's shard
BYTES_PER_DENSITY = 60e6
ELEMENTS = 7.5e6                                  # entries exchanged per step (8 bytes each when sent sparse)
THC_BYTES = {2: 0.385, 4: 0.671, 8: 1.147}       # wire bytes per entry of THC at 2 clusters


def rows(bw_bps, density, passes=1, compute=0.3, fixed=0.03, latency=5e-4, noise=0.0, rng=None,
         skew=0.05, batch=(16, 16, 16, 16), speed=(1, 1, 1, 1), kappa=1.0, bits=0, fixed_thc=None, kappa_thc=1.0,
         intra=(0.0, 0.0, 0.0, 0.0)):
    """One window of telemetry rows as the plumbing would gather them (the residual-to-gradient
    norm ratio ``kappa * sqrt((1 - d) / d)``, 0 when dense; on a THC rung of ``bits`` bits
    every entry at THC_BYTES[bits], the ratio ``kappa_thc / L``, the fixed cost ``fixed_thc``;
    ``intra``: each rank's seconds in its cluster's reductions per step)."""
    rng = rng or random.Random(0)

    def jit():
        return 1.0 + (rng.uniform(-noise, noise) if noise else 0.0)
    msgs = 4
    payload = ELEMENTS * THC_BYTES[bits] if bits else BYTES_PER_DENSITY * density
    if bits:
        density, fixed = 1.0, fixed if fixed_thc is None else fixed_thc
        ratio_sq = (kappa_thc / ((1 << (bits - 1)) - 1)) ** 2
    else:
        ratio_sq = kappa ** 2 * (1 - density) / density
    wire = msgs * latency + 8 * payload / bw_bps
    out = []
    comps = [compute * passes * batch[r] / 16 / speed[r] * jit() for r in range(4)]
    step = max(comps) + fixed + wire * jit()     # the slowest rank paces a synchronous step
    for r in range(4):
        comp = comps[r]
        exch = wire * jit() + (skew if r // 2 == 0 else 0.0)   # cluster 0 arrives early, waits
        vals = {"steps": 2, "step_s": step, "compute_s": comp, "idle_s": wire,
                "optimizer_s": 0.01, "cpu_s": 0.02, "exchange_s": exch, "engine_s": fixed + exch,
                "wan_bytes": payload, "wan_messages": msgs, "latency_s": latency * jit(),
                "batch": batch[r], "density": density, "passes": passes, "cluster": r // 2, "group": r % 2,
                "grad_sq": 2.0, "residual_sq": 2.0 * ratio_sq, "bits": bits, "elements": ELEMENTS,
                "intra_s": intra[r]}
        out.append([float(vals[k]) for k in ROW_FIELDS])
    return out


def run(ctrl, bws, noise=0.0, seed=1, **kw):
    """Closed loop over a bandwidth trace; returns the decisions."""
    rng = random.Random(seed)
    out = []
    for bw in bws:
        out.append(ctrl.observe(rows(bw, ctrl.density, ctrl.passes, noise=noise, rng=rng, bits=ctrl.bits, **kw)))
    return out


def settings(**kw):
    """The step-time objective's settings (the tests of the time-to-loss objective say so)."""
    base = dict(min_density=1e-3, max_density=0.1, objective="step_time")
    base.update(kw)
    return Adjuster(**base)


def test_ladder_and_budget():
    s = settings()
    levels = s.densities()
    assert levels[0] == 1e-3 and levels[-1] == 0.1 and list(levels) == sorted(levels)
    ctrl = Controller(s)
    d = run(ctrl, [500e6] * 6)[-1]
    # the chosen density's payload fits the budget, and the next level's would not (within the dead band)
    i = levels.index(d.density)
    assert 0 < i and i + 1 < len(levels)
    rung = ctrl.rungs.index((1, d.density, 0))
    assert ctrl._ratio(d.estimate, rung) <= 1 + s.hysteresis
    assert ctrl._ratio(d.estimate, rung + 1) > 1 - s.hysteresis


def test_monotone_in_bandwidth():
    bws = [10e6 * 1.5 ** i for i in range(16)]
    final = []
    for bw in bws:
        ctrl = Controller(settings())
        final.append(run(ctrl, [bw] * 8)[-1].density)
    assert final == sorted(final), final
    assert final[0] == 1e-3 and final[-1] == 0.1
    # one decision from the same state and history: never a higher density for less bandwidth
    for start in settings().densities():
        got = []
        for bw in bws:
            ctrl = Controller(settings(), density=start)
            got.append(ctrl.observe(rows(bw, start)).density)
        assert got == sorted(got), (start, got)


def test_stable_under_noisy_constant_bandwidth():
    levels = settings().densities()
    for bw in (60e6, 100e6, 250e6, 500e6):
        ref = run(Controller(settings()), [bw] * 10)[-1].density          # what a noiseless link gets
        ctrl = Controller(settings())
        decisions = run(ctrl, [bw] * 200, noise=0.25, seed=int(bw))    # +-25 % on every timing
        changes = [i for i, d in enumerate(decisions) if d.changed and i >= 5]
        assert len(changes) <= 1, (bw, changes)
        assert all(abs(levels.index(d.density) - levels.index(ref)) <= 1 for d in decisions[5:])


def test_single_outlier_is_ignored():
    ctrl = Controller(settings())
    run(ctrl, [500e6] * 6)
    before = ctrl.density
    d = ctrl.observe(rows(20e6, before))      # one window 25x slower
    assert not d.changed and d.density == before
    d = run(ctrl, [500e6] * 3)
    assert all(not x.changed for x in d)


def test_the_estimate_carries_the_slowest_ranks_seconds_in_its_clusters_reductions():
    """``intra_s``: per window the slowest rank's, over windows the median (one outlier window
    ignored, as every other field); rows recorded before the field existed read 0."""
    ctrl = Controller(settings(window=3))
    for slow in (0.020, 0.022, 0.5):   # the last window an outlier
        ctrl.observe(rows(500e6, ctrl.density, intra=(0.004, slow, 0.003, 0.001)))
    assert ctrl.estimate().intra_s == pytest.approx(0.022)
    old = Controller(settings())
    old.observe([r[:ROW_FIELDS.index("intra_s")] for r in rows(500e6, old.density, intra=(0.1,) * 4)])
    assert old.estimate().intra_s == 0.0


@pytest.mark.parametrize("window", [1, 3, 5])
def test_reacts_to_a_step_change_within_bound(window):
    s = settings(window=window)
    ctrl = Controller(s)
    trace = [500e6] * 20 + [100e6] * 20 + [500e6] * 20
    ds = [d.density for d in run(ctrl, trace, noise=0.05)]
    bound = window // 2 + 1       # windows until the median has moved
    high, low = ds[19], ds[39]
    levels = s.densities()
    assert low < high
    # down at once when the median moves; up one window later (two windows must agree), to
    # the level the dead band allows (within one level of where it came from)
    assert ds[20 + bound - 1] == low and ds[20 + bound - 2] == high, ds
    up = ds[40 + bound]
    assert up > low and levels.index(up) >= levels.index(high) - 1 and ds[40 + bound - 1] == low, ds
    assert len(set(ds[20 + bound:40])) == 1 and len(set(ds[41 + bound:])) <= 2


def test_accumulation_when_min_density_cannot_be_hidden():
    slow = [2e6] * 10
    plain = Controller(settings())
    d = run(plain, slow)[-1]
    assert d.density == 1e-3 and d.passes == 1 and "cannot hide" in d.reason
    acc = Controller(settings(allow_accumulation=True, max_backward_passes=8))
    d = run(acc, slow)[-1]
    assert d.density == 1e-3 and 1 < d.passes <= 8
    assert d.predicted_step_s <= 1.2 * d.passes * d.estimate.compute_s * 1.15
    # bandwidth back: accumulation is given up before density goes up
    d = run(acc, [500e6] * 10)
    assert d[-1].passes == 1 and d[-1].density > 1e-3
    assert all(x.passes == 1 or x.density == 1e-3 for x in d)


def test_overlap_hides_more_than_sync():
    a, b = Controller(settings()), Controller(settings(), overlap=True)
    ds, do = run(a, [100e6] * 6)[-1].density, run(b, [100e6] * 6)[-1].density
    assert do > ds


def test_batch_split_follows_throughput():
    s = settings(batch_split=True, global_batch=64)
    ctrl = Controller(s)
    speed = (2, 2, 1, 1)   # cluster 0 twice as fast
    batch = (16, 16, 16, 16)
    for _ in range(4):
        d = ctrl.observe(rows(500e6, ctrl.density, batch=batch, speed=speed))
        batch = d.batch
    assert sum(batch) == 64 and batch[0] == batch[1] and batch[2] == batch[3]
    assert abs(batch[0] / batch[2] - 2.0) < 0.2, batch
    # no churn once balanced
    d = ctrl.observe(rows(500e6, ctrl.density, batch=batch, speed=speed, noise=0.05))
    assert d.batch == batch


def test_split_batch_properties():
    assert split_batch(10, [1, 1], None) == (5, 5)
    assert sum(split_batch(101, [3, 1, 1], None)) == 101
    assert split_batch(4, [100, 1, 1, 1], None) == (1, 1, 1, 1)   # at least one each
    assert split_batch(20, [1.05, 1.0], (10, 10)) == (10, 10)       # small gain: keep
    with pytest.raises(ValueError):
        split_batch(2, [1, 1, 1], None)


@pytest.mark.parametrize("kw,match", [
    (dict(min_density=0.2, max_density=0.1), "larger than max_density"),
    (dict(min_density=0.0), "min_density"),
    (dict(max_density=1.5), "max_density"),
    (dict(target=0.5), "target"),
    (dict(batch_split=True), "global_batch"),
    (dict(hysteresis=0.7), "hysteresis"),
    (dict(objective="fastest"), "objective"),
    (dict(backlog_cost=-1), "backlog_cost"),
])
def test_bad_settings(kw, match):
    with pytest.raises(ValueError, match=match):
        settings(**kw)


def test_recorded_trace():
    """Rows gathered by the ranks over stellarun --wan with a 500 -> 100 -> 500 Mbit/s schedule
    (command in the file): replayed, the controller decides exactly what the ranks decided,
    and the density went both down and up."""
    with open(os.path.join(HERE, "..", "data", "adjuster_trace.json")) as f:
        trace = json.load(f)
    # recorded before there were objectives (its rows are shorter: no norms): the step-time one
    ctrl = Controller(Adjuster(**dict({"objective": "step_time"}, **trace["settings"])), overlap=trace["overlap"],
                      density=trace["start_density"])
    got = [ctrl.observe(w["rows"]).density for w in trace["windows"]]
    assert got == [w["decided_density"] for w in trace["windows"]]
    steps = list(zip(got, got[1:]))
    assert any(b < a for a, b in steps) and any(b > a for a, b in steps)


def ttl(**kw):
    """The time-to-loss objective (the default), from 0.1 % to dense."""
    base = dict(min_density=1e-3, max_density=1.0)
    base.update(kw)
    return Adjuster(**base)


def reference_choice(s, est, rungs):
    """The rung a plain reading of the documented rule picks: least
    step(d) * (1 + backlog_cost * kappa * sqrt((1 - d) / d)), and on a THC rung of b bits
    step(entries * bytes per entry) * (1 + backlog_cost * kappa_thc / L) with THC's fixed cost."""
    def score(p, d, b):
        payload = est.elements * THC_BYTES[b] if b else est.bytes_per_density * d
        fixed = est.fixed_thc_s if b and est.fixed_thc_s is not None else est.fixed_s
        step = p * est.compute_s + fixed + est.messages * est.latency_s + 8.0 * payload / est.bandwidth_bps
        backlog = est.backlog_kappa_thc / ((1 << (b - 1)) - 1) if b else est.backlog_kappa * ((1 - d) / d) ** 0.5
        return step / p * (1 + s.backlog_cost * backlog)
    return min(rungs, key=lambda r: score(*r))


def test_time_to_loss_is_the_default_and_spans_to_dense():
    s = Adjuster()
    assert s.objective == "time_to_loss" and s.max_density == 1.0 and s.densities()[-1] == 1.0


@pytest.mark.parametrize("bw", [20e6, 100e6, 1e9, 10e9])
def test_time_to_loss_picks_the_least_score(bw):
    s = ttl()
    ctrl = Controller(s)
    d = run(ctrl, [bw] * 12)[-1]
    assert (d.passes, d.density, d.bits) == reference_choice(s, d.estimate, ctrl.rungs) or \
        ctrl.score(d.estimate, ctrl.rungs.index((d.passes, d.density, d.bits))) <= \
        ctrl.score(d.estimate, ctrl.rungs.index(reference_choice(s, d.estimate, ctrl.rungs))) / (1 - s.hysteresis / 2)


def test_time_to_loss_dense_when_compute_dominates_sparse_when_the_link_is_slow():
    fast = run(Controller(ttl()), [10e9] * 12)[-1]
    assert fast.density == 1.0, fast
    slow = run(Controller(ttl()), [5e6] * 12)[-1]
    assert slow.density < 0.05, slow
    assert "backlog" in slow.reason


def test_time_to_loss_monotone_in_bandwidth_and_in_backlog():
    bws = [5e6 * 1.6 ** i for i in range(16)]
    got = [run(Controller(ttl()), [bw] * 10)[-1].density for bw in bws]
    assert got == sorted(got) and got[0] < got[-1], got
    # a larger measured backlog (kappa) never lowers the density chosen
    for bw in (50e6, 200e6):
        by_kappa = [run(Controller(ttl()), [bw] * 10, kappa=k)[-1].density for k in (0.25, 1.0, 4.0, 16.0)]
        assert by_kappa == sorted(by_kappa), (bw, by_kappa)
    # and the backlog is read from the rows: kappa fitted as measured
    ctrl = Controller(ttl())
    d = run(ctrl, [200e6] * 6, kappa=3.0)[-1]
    assert abs(d.estimate.backlog_kappa - 3.0) < 1e-6


def test_time_to_loss_stable_under_noise():
    for bw in (30e6, 150e6, 600e6):
        ctrl = Controller(ttl())
        decisions = run(ctrl, [bw] * 200, noise=0.25, seed=int(bw))
        changes = [i for i, d in enumerate(decisions) if d.changed and i >= 8]
        assert len(changes) <= 2, (bw, changes)


def test_time_to_loss_climbs_to_the_best_rung_half_a_decade_at_a_time():
    """From 1 % on a fast link the best rung (dense) is far: the controller climbs there, at
    most half a decade per decision, and stays (the backlog measured below dense is kept at the
    dense rung, where nothing is measured)."""
    s = ttl()
    ctrl = Controller(s, density=0.01)
    ds = [d.density for d in run(ctrl, [10e9] * 40, kappa=16.0)]
    assert ds[-1] == 1.0, ds
    levels = s.densities()
    for a, b in zip(ds, ds[1:]):
        assert levels.index(b) - levels.index(a) <= s.levels_per_decade // 2, ds
    first = ds.index(1.0)
    assert set(ds[first:]) == {1.0}, ds          # no oscillation once there
    assert ctrl.kappa == pytest.approx(16.0)


def thc_ladder(**kw):
    return Controller(ttl(thc_bits=(2, 4, 8), **kw), thc_bytes=THC_BYTES)


def test_thc_rungs_sit_between_sparse_and_dense():
    ctrl = thc_ladder()
    assert [r[2] for r in ctrl.rungs[-4:]] == [2, 4, 8, 0] and ctrl.rungs[-1] == (1, 1.0, 0)
    assert all(b == 0 and d < 1.0 for _, d, b in ctrl.rungs[:-4])
    with pytest.raises(ValueError, match="no wire cost"):
        Controller(ttl(thc_bits=(4,)))
    for bad in ((1,), (9,), (4, 4), (True,), 4, ("4",)):
        with pytest.raises(ValueError, match="thc_bits"):
            ttl(thc_bits=bad)
    assert ttl(thc_bits=[8, 2]).thc_bits == (2, 8)
    with pytest.raises(ValueError, match="time_to_loss"):
        ttl(thc_bits=(4,), objective="step_time")


@pytest.mark.parametrize("bw", [20e6, 100e6, 1e9, 10e9])
@pytest.mark.parametrize("compute", [0.3, 1.0])
def test_thc_rungs_least_score(bw, compute):
    """With THC rungs offered the choice is still the documented rule's least score."""
    s = ttl(thc_bits=(2, 4, 8))
    ctrl = Controller(s, thc_bytes=THC_BYTES)
    d = run(ctrl, [bw] * 16, compute=compute)[-1]
    best = reference_choice(s, d.estimate, ctrl.rungs)
    assert (d.passes, d.density, d.bits) == best or \
        ctrl.score(d.estimate, ctrl.rungs.index((d.passes, d.density, d.bits))) <= \
        ctrl.score(d.estimate, ctrl.rungs.index(best)) / (1 - s.hysteresis / 2)


def test_thc_where_compute_dominates_and_dense_bytes_still_cost_sparse_on_a_slow_link():
    """1 s of compute at 1 Gbit/s: dense's 60 MB cost 0.48 s, THC's 3 to 9 MB little, and its
    backlog is small: a THC rung. At 20 Mbit/s no rung that sends every entry pays: sparse."""
    fast = run(thc_ladder(), [1e9] * 30, compute=1.0)[-1]
    assert fast.bits in (2, 4, 8) and fast.density == 1.0, fast
    slow = run(thc_ladder(), [20e6] * 30)[-1]
    assert slow.bits == 0 and slow.density < 0.1, slow


def test_thc_rung_left_when_its_measured_cost_is_high():
    """THC's fixed cost is unknown until a THC rung runs (the sparse route's is assumed): when
    the rung then measures 1 s of quantization per step, the controller goes back to sparse and
    stays there, and the measured backlog of THC is kept."""
    ctrl = thc_ladder()
    ds = run(ctrl, [1e9] * 40, compute=1.0, fixed_thc=1.0, kappa_thc=2.0)
    bits = [d.bits for d in ds]
    assert any(bits), bits                                    # tried ...
    assert ds[-1].bits == 0 and not any(bits[-10:]), bits     # ... and left
    assert ctrl.kappa_thc == pytest.approx(2.0)
    assert ds[-1].estimate.fixed_thc_s == pytest.approx(1.0, rel=0.05)


def test_a_thc_rung_measured_slow_is_tried_again_after_a_doubling_wait():
    """THC_RETRY_WINDOWS windows off THC rungs, their measured fixed cost is forgotten (it may
    have been one noisy window): where THC would then win by more than the dead band it is tried
    once more, then after twice as long; each try costs a window or two."""
    ctrl = thc_ladder(backlog_cost=0.1)   # sparse's backlog weighs more: THC beats it at a sparse-like cost
    retry = controller.THC_RETRY_WINDOWS
    ds = run(ctrl, [1e9] * (5 * retry), compute=1.0, fixed_thc=1.0, kappa_thc=2.0)
    bits = [d.bits for d in ds]
    tried = [i for i in range(len(ds)) if bits[i] and (i == 0 or not bits[i - 1])]
    assert len(tried) == 3, bits                              # the first try, then two retries
    gaps = [b - a for a, b in zip(tried, tried[1:])]
    assert retry <= gaps[0] < retry + 10 and 2 * retry <= gaps[1] < 2 * retry + 10, gaps
    assert sum(1 for b in bits if b) <= 3 * 2, bits           # each try: left within two windows
    assert ds[-1].bits == 0 and ds[-1].estimate.fixed_thc_s == pytest.approx(1.0, rel=0.05)


def test_without_error_feedback_nothing_is_measured():
    """No residual below density 1 (error_feedback=False): no backlog measurement, so the prior
    kappa stays instead of sparsity looking free."""
    ctrl = Controller(ttl())
    d = run(ctrl, [200e6] * 6, kappa=0.0)[-1]
    assert d.estimate.backlog_kappa == 1.0


def test_rows_without_norms_still_decide():
    """Rows of the older 16 fields (no norms): no backlog measured, kappa stays 1."""
    ctrl = Controller(ttl())
    for _ in range(4):
        d = ctrl.observe([r[:16] for r in rows(200e6, ctrl.density)])
    assert d.estimate.backlog_kappa == 1.0


ADJUSTER_REFUSALS = r'''
import torch, stella_mpi as hvd
hvd.init()
model = torch.nn.Linear(4, 2)

def refused(match, **kw):
    try:
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=model.named_parameters(), **kw)
    except ValueError as e:
        assert match in str(e), (match, str(e))
    else:
        raise SystemExit("not refused: %r" % (kw,))

refused("hvd.Adjuster", compression=hvd.Compression.topk(density=0.01), adjuster={"min_density": 0.01})
refused("allow_accumulation", compression=hvd.Compression.topk(density=0.01), engine=hvd.CpuEngine(),
        adjuster=hvd.Adjuster(allow_accumulation=True))
# one cluster: the automatic route's adjuster has nothing to choose; the optimizer is Horovod's
for comp in (hvd.Compression.none, hvd.Compression.fp16):
    dense = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters(), compression=comp,
                                     adjuster=hvd.Adjuster())
    assert dense._route.kind == "dense" and dense.route == "dense", dense.route
try:
    hvd.Compression.topk(density=0.01).with_density(1.5)
except ValueError as e:
    assert "density" in str(e)
else:
    raise SystemExit("with_density(1.5) not refused")
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                               compression=hvd.Compression.topk(density=0.01), adjuster=hvd.Adjuster())
model(torch.ones(3, 4)).sum().backward()
opt.step()   # one process: nothing to adjust, nothing breaks
assert opt.adjust_decisions == [] and opt.local_batch_size() is None
hvd.shutdown()
print("OK")
'''


def test_optimizer_refuses_bad_adjuster_use():
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-c", ADJUSTER_REFUSALS], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(HERE)))
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr
