"""The gradient routes' own rules, without any rank: DGC's density warm-up (and its cap under
the adjuster's step-time budget), the budget itself, and the check of a checkpoint's momentum
correction state against the optimizer's parameters."""
import math

import pytest
import torch

from stella_mpi.adjust.controller import Controller, Estimate
from stella_mpi.adjust.settings import Adjuster
from stella_mpi.compression import Compression
from stella_mpi.optim.momentum_correction import MomentumCorrectionState
from stella_mpi.optim.routes.sync import WARMUP_START, density_warmup


def test_the_warm_up_falls_geometrically_to_the_compressors_density():
    comp = Compression.cacheaware(density=0.01)
    densities = [density_warmup(comp, t, 50).density for t in range(60)]
    assert densities[0] == pytest.approx(WARMUP_START)
    assert densities[25] == pytest.approx(math.sqrt(WARMUP_START * 0.01))   # half way, geometrically
    assert all(a > b for a, b in zip(densities[:50], densities[1:50]))
    assert densities[50:] == [0.01] * 10 and density_warmup(comp, 50, 50) is comp
    assert density_warmup(comp, 0, 0) is comp                                 # no warm-up
    # the copy keeps the compressor's settings and selection state, only the density moves
    warm = density_warmup(comp, 10, 50)
    assert warm.singles == comp.singles and warm._states is comp._states


def test_the_warm_up_stays_under_the_cap_and_above_the_density():
    comp = Compression.topk(density=0.01)
    assert density_warmup(comp, 0, 50, cap=0.05).density == 0.05     # the adjuster's budget
    assert density_warmup(comp, 0, 50, cap=0.01) is comp                # no room: no warm-up
    assert density_warmup(comp.with_density(0.5), 0, 50).density == 0.5   # above 25 %: as it is
    thc = Compression.thc(bits=4)
    assert density_warmup(thc, 0, 50) is thc                            # thc sends every entry


def _estimate(bandwidth_bps, compute_s=0.05):
    return Estimate(compute_s=compute_s, fixed_s=0.01, latency_s=0.001, messages=2.0, bytes_per_density=6e6,
                    bandwidth_bps=bandwidth_bps, wan_bandwidth_bps=bandwidth_bps, step_s=0.06)


def test_the_budget_is_the_densest_rung_the_step_time_target_allows():
    """(target - 1) x compute = 10 ms for the payload: at 100 Mbit/s that is 125 KB, 2 % of the
    6 MB a full density would send; at 1 Gbit/s 20 %; and never below the current density."""
    s = Adjuster(target=1.2, min_density=1e-3, max_density=1.0)
    ctrl = Controller(s, density=0.01)
    at_100 = ctrl.budget_density(_estimate(100e6))
    assert 0.01 <= at_100 <= 0.125e6 / 6e6 * 1.0001
    at_1g = ctrl.budget_density(_estimate(1e9))
    assert at_100 < at_1g <= 1.25e6 / 6e6 * 1.0001
    assert ctrl.budget_density(_estimate(1e5)) == 0.01   # nothing fits: the current density


def test_a_momentum_correction_state_must_fit_the_parameters():
    model = torch.nn.Linear(3, 2)
    params = dict(model.named_parameters())
    mc = MomentumCorrectionState()
    good = {"masking": False, "velocity": {"weight": torch.zeros(2, 3)}}
    mc.check(good, params)
    with pytest.raises(ValueError, match="a velocity of parameter 'body.weight', which this optimizer does not hold"):
        mc.check({"velocity": {"body.weight": torch.zeros(2, 3)}}, params)
    with pytest.raises(ValueError, match=r"the velocity of parameter 'bias' has shape \[3\], the parameter \[2\]"):
        mc.check({"velocity": {"bias": torch.zeros(3)}}, params)
    with pytest.raises(ValueError, match="expected"):
        mc.check(["velocity"], params)
