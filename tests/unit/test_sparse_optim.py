"""Sparse optimizer kernels (c_src/optim.c through stella_mpi.optim.sparse_optim).

Golden tests: at density 1.0 every mode equals torch.optim.SGD / Adam / AdamW step for step.
EXACT at densities 0.01-0.5 equals the dense torch optimizer fed the same sparse gradients
(zeros elsewhere); LAZY equals a numpy reference; edge cases and refusals.
"""
import numpy as np
import pytest
import torch

from stella_mpi.optim.sparse_optim import SparseAdam, SparseAdamW, SparseSGD

SGD_SETS = [
    dict(lr=0.1),
    dict(lr=0.05, momentum=0.9),
    dict(lr=0.05, momentum=0.9, dampening=0.5),
    dict(lr=0.05, momentum=0.9, nesterov=True),
    dict(lr=0.1, weight_decay=0.01),
    dict(lr=0.05, momentum=0.9, weight_decay=0.01),
    dict(lr=0.05, momentum=0.8, dampening=0.2, weight_decay=0.05, maximize=True),
    dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.02),
]
ADAM_SETS = [
    dict(lr=1e-2),
    dict(lr=1e-2, weight_decay=0.1),
    dict(lr=1e-2, amsgrad=True),
    dict(lr=3e-3, betas=(0.5, 0.9), eps=1e-3, maximize=True),
    dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.05, amsgrad=True),
]
ADAMW_SETS = [
    dict(lr=1e-2),
    dict(lr=1e-2, weight_decay=0.1, amsgrad=True),
    dict(lr=3e-3, betas=(0.6, 0.95), eps=1e-6, weight_decay=0.3, maximize=True),
]
CASES = ([(SparseSGD, torch.optim.SGD, h) for h in SGD_SETS] + [(SparseAdam, torch.optim.Adam, h) for h in ADAM_SETS]
         + [(SparseAdamW, torch.optim.AdamW, h) for h in ADAMW_SETS])
IDS = ["%s-%d" % (c[0].__name__, i) for i, c in enumerate(CASES)]
SHAPES = [(37, 29), (16,), (1,), (1000,)]  # sizes that are and are not multiples of 16

STATE_NAMES = {"momentum_buffer": "momentum_buffer", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq",
               "max_exp_avg_sq": "max_exp_avg_sq"}


def _params(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _compare_state(opt, ref, atol, rtol):
    sd = opt.state_dict(catch_up=True)
    for p, st in zip(ref.param_groups[0]["params"], sd["state"]):
        tst = ref.state[p]
        for name, t in st.items():
            if name == "last_step":
                assert int(t.min()) == sd["step"] == int(t.max())
                continue
            torch.testing.assert_close(t, tst[name], atol=atol, rtol=rtol, msg=lambda m: "%s: %s" % (name, m))


@pytest.mark.parametrize("mode", ["exact", "lazy"])
@pytest.mark.parametrize("cls,tcls,hp", CASES, ids=IDS)
def test_golden_density_one_matches_torch(cls, tcls, hp, mode):
    ours = _params(1)
    theirs = [p.clone().requires_grad_(True) for p in ours]
    opt = cls(ours, mode=mode, **hp)
    ref = tcls(theirs, foreach=False, **hp)
    g = torch.Generator().manual_seed(2)
    for step in range(25):
        grads = [torch.randn(p.shape, generator=g) for p in ours]
        opt.step([(torch.arange(p.numel(), dtype=torch.int32), gr.reshape(-1)) for p, gr in zip(ours, grads)])
        for t, gr in zip(theirs, grads):
            t.grad = gr.clone()
        ref.step()
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b.detach(), atol=2e-6, rtol=2e-5, msg=lambda m: "step %d: %s" % (step + 1, m))
    _compare_state(opt, ref, atol=2e-6, rtol=2e-5)


def _sparse_grads(rng, n, density, block=False):
    k = max(1, int(n * density))
    if block:
        nb = (n + 15) // 16
        blocks = np.sort(rng.choice(nb, size=max(1, k // 16), replace=False))
        idx = (blocks[:, None] * 16 + np.arange(16)).reshape(-1)
        idx = idx[idx < n]
    else:
        idx = np.sort(rng.choice(n, size=k, replace=False))
    return idx.astype(np.int32), rng.standard_normal(idx.size).astype(np.float32)


@pytest.mark.parametrize("density", [0.01, 0.05, 0.2, 0.5])
@pytest.mark.parametrize("cls,tcls,hp", CASES, ids=IDS)
def test_exact_equals_dense_torch_fed_sparse(cls, tcls, hp, density):
    n, steps = 3000, 60
    rng = np.random.default_rng(int(density * 1000))
    ours = [torch.from_numpy(rng.standard_normal(n).astype(np.float32)), torch.randn(7)]
    theirs = [p.clone().requires_grad_(True) for p in ours]
    opt = cls(ours, mode="exact", **hp)
    ref = tcls(theirs, foreach=False, **hp)
    for step in range(steps):
        idx, val = _sparse_grads(rng, n, density, block=step % 2 == 1)
        dense = np.zeros(n, np.float32)
        dense[idx] = val
        second = None if step % 3 else (np.array([2], np.int32), np.array([0.5], np.float32))
        opt.step([(idx, val), second])
        theirs[0].grad = torch.from_numpy(dense)
        d2 = torch.zeros(7)
        if second is not None:
            d2[2] = 0.5
        theirs[1].grad = d2
        ref.step()
        if step == steps // 2:  # a catch-up in the middle changes nothing
            opt.catch_up()
    opt.catch_up()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b.detach(), atol=2e-5, rtol=2e-4)
    _compare_state(opt, ref, atol=2e-5, rtol=2e-4)


@pytest.mark.parametrize("cls,tcls,hp", [CASES[5], CASES[9], CASES[13]], ids=["sgd", "adam", "adamw"])
def test_exact_lr_change_catches_up_under_old_lr(cls, tcls, hp):
    n = 2000
    rng = np.random.default_rng(5)
    p = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    t = p.clone().requires_grad_(True)
    opt, ref = cls([p], mode="exact", **hp), tcls([t], foreach=False, **hp)
    for step in range(40):
        if step in (10, 25):
            opt.lr = opt.lr * 0.5
            ref.param_groups[0]["lr"] *= 0.5
        idx, val = _sparse_grads(rng, n, 0.02)
        opt.step([(idx, val)])
        d = np.zeros(n, np.float32)
        d[idx] = val
        t.grad = torch.from_numpy(d)
        ref.step()
    opt.catch_up()
    torch.testing.assert_close(p, t.detach(), atol=2e-5, rtol=2e-4)


def _lazy_reference(kind, hp, p, steps):
    """numpy LAZY: listed coordinates take one step of the rule; others stay."""
    p = p.astype(np.float64).copy()
    n = p.size
    b1, b2, b3 = np.zeros(n), np.zeros(n), np.zeros(n)
    for t, (idx, val) in enumerate(steps, start=1):
        g = val.astype(np.float64) * (-1 if hp.get("maximize") else 1)
        pi = p[idx]
        if kind == "sgd":
            wd, mu, damp = hp.get("weight_decay", 0), hp.get("momentum", 0), hp.get("dampening", 0)
            d = g + wd * pi
            if mu:
                b1[idx] = d if t == 1 else b1[idx] * mu + (1 - damp) * d
                upd = d + mu * b1[idx] if hp.get("nesterov") else b1[idx]
            else:
                upd = d
            p[idx] = pi - hp["lr"] * upd
        else:
            beta1, beta2 = hp.get("betas", (0.9, 0.999))
            lr, eps, wd = hp["lr"], hp.get("eps", 1e-8), hp.get("weight_decay", 0 if kind == "adam" else 1e-2)
            if kind == "adamw":
                pi = pi * (1 - lr * wd)
            else:
                g = g + wd * pi
            b1[idx] = beta1 * b1[idx] + (1 - beta1) * g
            b2[idx] = beta2 * b2[idx] + (1 - beta2) * g * g
            v = b2[idx]
            if hp.get("amsgrad"):
                b3[idx] = np.maximum(b3[idx], v)
                v = b3[idx]
            denom = np.sqrt(v) / np.sqrt(1 - beta2 ** t) + eps
            p[idx] = pi - lr / (1 - beta1 ** t) * b1[idx] / denom
    return p


@pytest.mark.parametrize("cls,tcls,hp", CASES, ids=IDS)
def test_lazy_matches_numpy_reference(cls, tcls, hp):
    kind = {SparseSGD: "sgd", SparseAdam: "adam", SparseAdamW: "adamw"}[cls]
    n = 777
    rng = np.random.default_rng(3)
    p0 = rng.standard_normal(n).astype(np.float32)
    steps = [_sparse_grads(rng, n, 0.1) for _ in range(30)]
    p = torch.from_numpy(p0.copy())
    opt = cls([p], mode="lazy", **hp)
    for idx, val in steps:
        opt.step([(idx, val)])
    want = _lazy_reference(kind, hp, p0, steps)
    np.testing.assert_allclose(p.numpy(), want, rtol=1e-4, atol=1e-5)
    touched = np.unique(np.concatenate([s[0] for s in steps]))
    untouched = np.setdiff1d(np.arange(n), touched)
    assert np.array_equal(p.numpy()[untouched], p0[untouched])


@pytest.mark.parametrize("mode", ["exact", "lazy"])
def test_empty_and_single_entries(mode):
    p = torch.randn(17)
    before = p.clone()
    opt = SparseAdam([p], lr=0.1, mode=mode)
    opt.step([None])
    opt.step([(np.zeros(0, np.int32), np.zeros(0, np.float32))])
    opt.catch_up()
    assert torch.equal(p, before)  # zero gradients, zero moments: nothing moves
    opt.step([(np.array([16], np.int32), np.array([2.0], np.float32))])
    assert opt.step_count == 3
    changed = torch.nonzero(p != before).reshape(-1).tolist()
    assert changed == [16]


def test_nan_inf_gradients_propagate_like_torch():
    n = 64
    p = torch.randn(n)
    t = p.clone().requires_grad_(True)
    opt, ref = SparseSGD([p], lr=0.1, momentum=0.9), torch.optim.SGD([t], lr=0.1, momentum=0.9, foreach=False)
    for step in range(5):
        idx = np.array([1, 2, 3, 40], np.int32)
        val = np.array([np.nan, np.inf, -np.inf, 1.0], np.float32) if step == 1 else np.ones(4, np.float32)
        opt.step([(idx, val)])
        d = torch.zeros(n)
        d[torch.from_numpy(idx).long()] = torch.from_numpy(val)
        t.grad = d
        ref.step()
    opt.catch_up()
    torch.testing.assert_close(p, t.detach(), equal_nan=True)


@pytest.mark.parametrize("idx,msg", [
    ([3, 1, 5], "strictly ascending; position 1 holds 1 after 3"),
    ([1, 1, 5], "strictly ascending"),
    ([1, 2, 100], "index 100 at position 2 is out of range for a parameter of 100 elements"),
])
@pytest.mark.parametrize("mode", ["exact", "lazy"])
def test_bad_lists_are_refused_and_change_nothing(idx, msg, mode):
    a, b = torch.randn(50), torch.randn(100)
    keep = [a.clone(), b.clone()]
    opt = SparseAdam([a, b], lr=0.1, mode=mode)
    good = (np.array([0, 1], np.int32), np.ones(2, np.float32))
    with pytest.raises(ValueError, match=msg):
        opt.step([good, (np.array(idx, np.int32), np.ones(3, np.float32))])
    assert opt.step_count == 0
    assert torch.equal(a, keep[0]) and torch.equal(b, keep[1])


def test_argument_checks():
    p = torch.randn(10)
    with pytest.raises(ValueError, match="float32"):
        SparseSGD([torch.zeros(3, dtype=torch.float64)])
    with pytest.raises(ValueError, match="contiguous"):
        SparseSGD([torch.zeros(4, 4).t()])
    with pytest.raises(ValueError, match="mode"):
        SparseSGD([p], mode="eager")
    with pytest.raises(ValueError, match="invalid hyper-parameters"):
        SparseSGD([p], lr=0.1, nesterov=True)  # nesterov needs momentum
    with pytest.raises(ValueError, match="invalid hyper-parameters"):
        SparseAdam([p], betas=(1.0, 0.9))
    opt = SparseSGD([p], lr=0.1)
    with pytest.raises(ValueError, match="2 gradients for 1 parameters"):
        opt.step([None, None])
    with pytest.raises(ValueError, match="3 indices but 2 values"):
        opt.step([(np.arange(3, dtype=np.int32), np.ones(2, np.float32))])
    with pytest.raises(TypeError, match="float32"):
        opt.step([(np.arange(3, dtype=np.int32), np.ones(3, np.float64))])
    with pytest.raises(TypeError, match="unknown hyper-parameter"):
        opt.set_hparams(betas=(0.9, 0.99))
    # int64 indices are accepted (converted)
    opt.step([(torch.arange(3), torch.ones(3))])
    assert opt.step_count == 1


@pytest.mark.parametrize("cls,hp", [(SparseSGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
                                    (SparseAdamW, dict(lr=0.01, amsgrad=True))])
@pytest.mark.parametrize("mode", ["exact", "lazy"])
def test_state_dict_roundtrip(cls, hp, mode, tmp_path):
    rng = np.random.default_rng(9)
    steps = [_sparse_grads(rng, 500, 0.05) for _ in range(20)]
    p0 = torch.randn(500)
    a = p0.clone()
    opt = cls([a], mode=mode, **hp)
    for s in steps[:10]:
        opt.step([s])
    sd = opt.state_dict(catch_up=False)
    torch.save(sd, tmp_path / "opt.pt")
    saved_param = a.clone()
    for s in steps[10:]:
        opt.step([s])
    opt.catch_up()
    b = saved_param.clone()
    opt2 = cls([b], mode=mode, lr=123.0)
    opt2.load_state_dict(torch.load(tmp_path / "opt.pt"))
    assert opt2.step_count == 10 and opt2.lr == hp["lr"]
    for s in steps[10:]:
        opt2.step([s])
    opt2.catch_up()
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="cannot be loaded"):
        SparseAdam([torch.randn(500)]).load_state_dict(sd)


@pytest.mark.parametrize("cls,tcls,hp", CASES, ids=IDS)
def test_lookahead_is_the_next_step_with_a_zero_gradient(cls, tcls, hp):
    """lookahead() (the CPU engine's stale prediction): the weights after one more torch step
    with a zero gradient, leaving the parameters and state untouched."""
    rng = np.random.default_rng(3)
    n = 500
    ours = [torch.from_numpy(rng.standard_normal(n).astype(np.float32))]
    theirs = [p.clone().requires_grad_(True) for p in ours]
    opt = cls(ours, mode="exact", **hp)
    ref = tcls(theirs, foreach=False, **hp)
    with pytest.raises(ValueError, match="at least one step"):
        opt.lookahead()
    for step in range(5):
        idx, val = _sparse_grads(rng, n, 0.1)
        dense = np.zeros(n, np.float32)
        dense[idx] = val
        opt.step([(idx, val)])            # unlisted coordinates lag: lookahead catches them up
        theirs[0].grad = torch.from_numpy(dense)
        ref.step()
    out = torch.empty(n)
    assert opt.lookahead([out])[0] is out
    torch.testing.assert_close(ours[0], theirs[0].detach(), atol=2e-5, rtol=2e-4)  # caught up, not moved on
    before = {k: v.clone() for k, v in opt.state_dict(catch_up=False)["state"][0].items()}
    theirs[0].grad = torch.zeros(n)
    ref.step()
    torch.testing.assert_close(out, theirs[0].detach(), atol=2e-5, rtol=2e-4)
    again = opt.lookahead(caught_up=True)[0]     # nothing moved: the same prediction, the same state
    torch.testing.assert_close(again, out, atol=0, rtol=0)
    for k, v in opt.state_dict(catch_up=False)["state"][0].items():
        torch.testing.assert_close(v, before[k], atol=0, rtol=0)
    assert opt.step_count == 5
    with pytest.raises(ValueError, match="exact"):
        cls([torch.zeros(4)], mode="lazy", **hp).lookahead()
