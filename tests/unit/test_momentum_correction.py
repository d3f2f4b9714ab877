"""Momentum correction (optim/momentum_correction.py) against a numpy reference: the velocity and
what is sent, with weight decay, dampening and nesterov; masking; a refused step's roll-back."""
import numpy as np
import pytest
import torch

from stella_mpi.optim.momentum_correction import MomentumCorrectionState, plain_sgd_step


def _reference(grads, w, m, damp, wd, nesterov):
    u = None
    sent = []
    for g in grads:
        g = g + wd * w
        u = g.copy() if u is None else m * u + (1 - damp) * g   # torch's SGD: the first buffer is g
        sent.append(g + m * u if nesterov else u.copy())
    return sent, u


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("wd,damp", [(0.0, 0.0), (1e-2, 0.0), (0.0, 0.3)])
def test_velocity_and_sent_match_numpy(nesterov, wd, damp):
    rng = np.random.default_rng(0)
    w = rng.standard_normal(50).astype(np.float64)
    grads = [rng.standard_normal(50) for _ in range(5)]
    want, u_want = _reference(grads, w, 0.9, damp, wd, nesterov)
    st = MomentumCorrectionState()
    group = {"momentum": 0.9, "dampening": damp, "weight_decay": wd, "nesterov": nesterov}
    param = torch.tensor(w)
    for g, s in zip(grads, want):
        t = torch.tensor(g)
        st.transform("w", param, t, group)
        np.testing.assert_allclose(t.numpy(), s, rtol=1e-12, atol=1e-12)
        st.applied("w", t)
    np.testing.assert_allclose(st.velocity["w"].numpy(), u_want, rtol=1e-12)


@pytest.mark.parametrize("nesterov,damp", [(False, 0.0), (False, 0.5), (True, 0.0)])
def test_applied_with_plain_sgd_is_torchs_momentum_sgd(nesterov, damp):
    """One process, everything sent: the velocity applied by SGD without momentum is torch's
    momentum SGD, dampening and weight decay included (torch starts its buffer at the gradient)."""
    torch.manual_seed(0)
    grads = [torch.randn(20, dtype=torch.float64) for _ in range(4)]
    ref = torch.nn.Parameter(torch.randn(20, dtype=torch.float64))
    mine = torch.nn.Parameter(ref.detach().clone())
    ref_opt = torch.optim.SGD([ref], lr=0.1, momentum=0.9, dampening=damp, weight_decay=0.01, nesterov=nesterov)
    opt = torch.optim.SGD([mine], lr=0.1, momentum=0.9, dampening=damp, weight_decay=0.01, nesterov=nesterov)
    st = MomentumCorrectionState()
    for g in grads:
        ref.grad = g.clone()
        ref_opt.step()
        mine.grad = g.clone()
        st.transform("w", mine, mine.grad, opt.param_groups[0])
        st.applied("w")
        plain_sgd_step(opt.step, opt.param_groups)
    torch.testing.assert_close(mine.detach(), ref.detach(), rtol=1e-12, atol=1e-12)


def test_masking_zeroes_the_velocity_where_the_result_came_back():
    st = MomentumCorrectionState(masking=True)
    group = {"momentum": 0.5}
    g = torch.tensor([1.0, 2.0, 3.0, 4.0])
    st.transform("w", torch.zeros(4), g.clone(), group)
    st.applied("w", torch.tensor([0.0, 5.0, 0.0, -1.0]))
    assert st.velocity["w"].tolist() == [1.0, 0.0, 3.0, 0.0]
    plain = MomentumCorrectionState(masking=False)
    plain.transform("w", torch.zeros(4), g.clone(), group)
    plain.applied("w", torch.tensor([0.0, 5.0, 0.0, -1.0]))
    assert plain.velocity["w"].tolist() == [1.0, 2.0, 3.0, 4.0]


def test_a_refused_step_rolls_the_velocity_back():
    st = MomentumCorrectionState()
    group = {"momentum": 0.9}
    st.transform("w", torch.zeros(3), torch.ones(3), group)
    st.applied("w", torch.ones(3))
    before = st.velocity["w"].clone()
    bad = torch.tensor([1.0, float("nan"), 1.0])
    st.transform("w", torch.zeros(3), bad, group)
    assert not bool(torch.isfinite(st.velocity["w"]).all())
    st.refused("w")
    assert torch.equal(st.velocity["w"], before)
    # a first step refused leaves no velocity at all
    st.transform("v", torch.zeros(2), torch.tensor([float("inf"), 0.0]), group)
    st.refused("v")
    assert "v" not in st.velocity


def test_a_refused_step_drops_the_later_steps_backups_too():
    """The CPU engine tags backups by step: refusing step 1 restores the velocity before it, and
    step 2 (which carried step 1's values) has nothing left to restore."""
    st = MomentumCorrectionState()
    group = {"momentum": 0.5}
    st.transform("b", torch.zeros(2), torch.ones(2), group, tag=0)
    st.applied("b", tag=0)
    before = st.velocity["b"].clone()
    st.transform("b", torch.zeros(2), torch.tensor([float("nan"), 1.0]), group, tag=1)
    st.transform("b", torch.zeros(2), torch.ones(2), group, tag=2)
    st.refused("b", tag=1)
    assert torch.equal(st.velocity["b"], before)
    st.refused("b", tag=2)
    assert torch.equal(st.velocity["b"], before)


def test_state_dict_round_trip():
    st = MomentumCorrectionState(masking=True)
    st.transform("w", torch.zeros(3), torch.ones(3), {"momentum": 0.9})
    other = MomentumCorrectionState()
    other.load_state_dict(st.state_dict())
    assert other.masking and torch.equal(other.velocity["w"], st.velocity["w"])


def test_plain_sgd_step_restores_the_groups():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.5, momentum=0.9, weight_decay=0.1, nesterov=True)
    p.grad = torch.ones(3)
    plain_sgd_step(opt.step, opt.param_groups)
    assert torch.allclose(p.detach(), torch.full((3,), 0.5))   # w - lr * g, nothing else
    g = opt.param_groups[0]
    assert (g["momentum"], g["weight_decay"], g["nesterov"]) == (0.9, 0.1, True)
