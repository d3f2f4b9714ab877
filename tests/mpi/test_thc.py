"""The homomorphic cross-cluster route (Compression.thc): bit for bit against a pipeline every
rank recomputes from all ranks' inputs, the same result on every rank, the rounding bound,
error feedback's mass balance, NaN handling, training through DistributedOptimizer and local
steps, and the options THC refuses."""
import numpy as np
import pytest
import torch

import stella_mpi as hvd
from stella_mpi.comm.buffers import split_counts
from stella_mpi.compression import TensorContext, THCCompressor
from stella_mpi.core import state
from stella_mpi.comm.sparse_exchange import residual_key
from stella_mpi.base.errors import NonFiniteGradientError


def _exact_input(rank, n, seed):
    """Multiples of 1/64 in [-16, 16]: sums over a few ranks are exact in float32, so the
    reference's cluster sums equal the route's bit for bit whatever the reduction order."""
    g = torch.Generator().manual_seed(7919 * (rank + 1) + seed)
    return torch.randint(-1024, 1025, (n,), generator=g).float() / 64


def _gather(x):
    return [t for t in hvd.allgather(x.unsqueeze(0))]


def _same_everywhere(t):
    got = hvd.allgather(t.unsqueeze(0))
    for r in range(hvd.size()):
        assert torch.equal(got[r], got[0]), "rank %d differs" % r


def _reference(inputs, comp, name, step, seed, op_scale):
    """What the route computes on the first step (no residual yet), from every rank's input."""
    topo = hvd.global_process_set.topology
    n = inputs[0].numel()
    shards = []
    for members in topo.cluster_members:
        total = sum(inputs[r] for r in members)
        shards.append(list(torch.split(total, split_counts(n, len(members)))) if topo.uniform_clusters else [total])
    kind = "shard" if topo.uniform_clusters else "leader"
    out = []
    for s in range(len(shards[0])):
        key = "%s#shard%d" % (name, s) if kind == "shard" else name
        ctx = TensorContext(name=key, step=step, shape=(shards[0][s].numel(),), seed=seed)
        works = [comp.begin(shards[c][s].clone(), ctx) for c in range(len(shards))]
        scales = np.maximum.reduce([w.absmax for w in works])   # one per block, the largest of any cluster
        words = sum(comp.quantize(w, scales, len(works), c) for c, w in enumerate(works))
        out.append(comp.finish(works[0], words, len(works), scales) * op_scale)
    return torch.cat(out)


def _multi_cluster():
    return hvd.global_process_set.topology.num_clusters > 1


@pytest.mark.parametrize("bits,rotation,rounding", [(2, True, "nearest"), (8, False, "nearest"),
                                                    (4, True, "stochastic"), (2, False, "stochastic")])
def test_thc_equals_the_reference_pipeline_bit_for_bit(bits, rotation, rounding):
    """Also stochastic rounding: each cluster's shard owner draws from its own key (its position
    among the clusters), which the reference reproduces."""
    n = 3000
    name = "thc.ref.%d.%s.%s" % (bits, rotation, rounding)
    x = _exact_input(hvd.rank(), n, seed=bits)
    comp = hvd.Compression.thc(bits=bits, rotation=rotation, block_log2=7, rounding=rounding)
    got = hvd.allreduce(x, compression=comp, name=name, op=hvd.Average)
    _same_everywhere(got)
    inputs = _gather(x)
    if not _multi_cluster():   # one cluster: no WAN, the dense average
        torch.testing.assert_close(got, sum(inputs) / hvd.size())
        return
    want = _reference(inputs, THCCompressor(bits=bits, rotation=rotation, block_log2=7, rounding=rounding), name, 0,
                      state.current().config.seed, 1.0 / hvd.size())
    assert torch.equal(got, want)
    # and within the rounding bound of the true average: each cluster's levels are off by less
    # than one step (scale / L) per entry in the rotated domain; the scale is at most the largest
    # cluster sum's |entry| (no rotation) or its norm (an entry of a rotated block)
    topo = hvd.global_process_set.topology
    sums = [sum(inputs[r] for r in members) for members in topo.cluster_members]
    exact = sum(inputs) / hvd.size()
    if rotation:
        bound = len(sums) * max(float(c.norm()) for c in sums) / comp.levels() * n ** 0.5 / hvd.size()
        assert float((got - exact).norm()) <= bound
    else:
        bound = len(sums) * max(float(c.abs().max()) for c in sums) / comp.levels() / hvd.size()
        assert float((got - exact).abs().max()) <= bound * (1 + 1e-5)


def test_thc_error_feedback_keeps_the_mass():
    """Sum of what was sent over steps + what is left in the residuals == sum of the inputs:
    with a constant input, the average over steps converges to the true average."""
    n = 2000
    x = _exact_input(hvd.rank(), n, seed=77)
    comp = hvd.Compression.thc(bits=2)
    total = torch.zeros(n)
    steps = 25
    for _ in range(steps):
        total += hvd.allreduce(x, compression=comp, name="thc.ef", op=hvd.Sum)
    exact = hvd.allreduce(x, name="thc.ef.ref", op=hvd.Sum)
    if not _multi_cluster():
        torch.testing.assert_close(total / steps, exact)
        return
    memory = state.current().sparse_memory
    topo = hvd.global_process_set.topology
    kind = "shard" if topo.uniform_clusters else "leader"
    key = residual_key("thc.ef", kind, topo)
    res = memory.get(key)
    if kind == "shard" or topo.cluster_rank == 0:   # (between clusters of unequal size, the leaders select)
        assert res is not None and torch.isfinite(res).all()
    # the residuals of every cluster, put back where their shard lies, close the balance exactly
    # (up to float rounding of the accumulation)
    mine = torch.zeros(n)
    if kind == "shard":
        counts = split_counts(n, topo.cluster_size)
        start = sum(counts[:topo.cluster_rank])
        mine[start:start + counts[topo.cluster_rank]] = res
    elif topo.cluster_rank == 0:
        mine = res.clone()
    left = hvd.allreduce(mine, name="thc.ef.left", op=hvd.Sum)
    torch.testing.assert_close(total + left, exact * steps, rtol=1e-4, atol=1e-3)
    one_step_err = float((hvd.allreduce(x, compression=hvd.Compression.thc(bits=2, error_feedback=False),
                                        name="thc.noef", op=hvd.Sum) - exact).abs().mean())
    assert float((total / steps - exact).abs().mean()) < one_step_err / 5


def test_thc_nan_is_refused_everywhere_and_leaves_no_nan_behind():
    n = 500
    comp = hvd.Compression.thc(bits=4)
    x = _exact_input(hvd.rank(), n, seed=5)
    hvd.allreduce(x, compression=comp, name="thc.nan")
    bad = x.clone()
    if hvd.rank() == hvd.size() - 1:
        bad[7] = float("nan")
    with pytest.raises(NonFiniteGradientError):
        hvd.allreduce(bad, compression=comp, name="thc.nan")
    for k in state.current().sparse_memory.names():
        if k.startswith("thc.nan"):
            assert torch.isfinite(state.current().sparse_memory.get(k)).all()
    after = hvd.allreduce(x, compression=comp, name="thc.nan")   # the ranks stay usable
    _same_everywhere(after)


def test_thc_near_the_float32_limit():
    """One entry of 3e38 on one rank: its sum fits in float32, and so does every value on the
    way (the rotation normalizes before its butterflies), so the result is finite. The same entry
    on every rank: the sum overflows, refused on every rank alike; the residual stays finite and
    the same name goes on."""
    n = 4096
    comp = hvd.Compression.thc(bits=4)
    x = _exact_input(hvd.rank(), n, seed=9)
    big = x.clone()
    big[100] = 3e38 if hvd.rank() == 0 else 0.0
    out = hvd.allreduce(big, compression=comp, name="thc.big", op=hvd.Sum)
    assert torch.isfinite(out).all() and float(out[100]) == pytest.approx(3e38, rel=0.02)
    _same_everywhere(out)
    big[100] = 3e38
    if _multi_cluster():
        with pytest.raises(NonFiniteGradientError, match="THC sum"):
            hvd.allreduce(big, compression=comp, name="thc.overflow", op=hvd.Sum)
    for k in state.current().sparse_memory.names():
        if k.startswith("thc.overflow"):
            assert torch.isfinite(state.current().sparse_memory.get(k)).all(), k
    after = hvd.allreduce(x, compression=comp, name="thc.overflow")
    _same_everywhere(after)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(24, 12, generator=g), torch.randint(0, 3, (24,), generator=g)


def _train(steps, after_step=None, **kwargs):
    """``steps`` steps of SGD through DistributedOptimizer(**kwargs); ``after_step(opt)`` after
    each. The parameters must end the same on every rank."""
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2),
                                   named_parameters=model.named_parameters(), **kwargs)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        x, y = _batch(hvd.rank(), step % 4)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if after_step is not None:
            after_step(opt)
    for p in model.parameters():
        _same_everywhere(p.detach())
    return model, losses


def _crosses():
    """Whether this rank takes the cross-cluster step (between clusters of unequal size only the
    leaders do)."""
    topo = hvd.global_process_set.topology
    return _multi_cluster() and (topo.uniform_clusters or topo.cluster_rank == 0)


def _counting(comp):
    """The compressor, its quantize() counting calls (the route really went through it)."""
    calls = []
    quantize = comp.quantize

    def counted(*args, **kwargs):
        calls.append(1)
        return quantize(*args, **kwargs)
    comp.quantize = counted
    return comp, calls


def test_thc_trains_through_distributed_optimizer():
    dense, dense_losses = _train(20)
    comp, calls = _counting(hvd.Compression.thc(bits=4))
    model, losses = _train(20, compression=comp)
    assert (len(calls) >= 20) == _crosses()
    assert losses[-1] < losses[0]
    assert abs(losses[-1] - dense_losses[-1]) < 0.02 * dense_losses[-1]   # (30 steps measured 1.0549 vs dense 1.0552)


def test_thc_carries_the_pseudo_gradient_of_local_steps():
    comp, calls = _counting(hvd.Compression.thc(bits=8))
    model, losses = _train(12, compression=comp, local_steps=hvd.LocalSteps(every=3))
    assert losses[-1] < losses[0]
    assert (len(calls) >= 4) == _crosses()   # 12 steps / 3: four exchanges of the pseudo-gradient


def test_adjuster_moves_to_a_thc_rung_on_every_rank_at_the_same_step():
    """hvd.Adjuster(thc_bits=...): a backlog cost so high that the sparse rung's backlog (about
    10 at 1 %) outweighs any step time makes the THC rung (backlog ~1/7) the least score. Every
    rank switches at the same step, the exchange then sends every entry, training goes on with
    the same parameters everywhere (checked by _train)."""
    ran, opts = [], []

    def record(opt):
        last = hvd.stats()["last_step"]
        ran.append((last.get("adjust_bits"), last["density"]))
        opts[:] = [opt]
    _, losses = _train(24, after_step=record, compression=hvd.Compression.cacheaware(density=0.01),
                       adjuster=hvd.Adjuster(min_density=0.01, max_density=0.01, thc_bits=(4,), backlog_cost=1000.0,
                                             interval=1, window=1))
    decisions = [(s, d.density, d.bits) for s, d in opts[0].adjust_decisions]
    assert all(d == decisions for d in hvd.allgather_object(decisions))
    if not _multi_cluster():   # one cluster: nothing crosses, nothing to adjust
        assert decisions == []
        return
    switch = [s for s, _, b in decisions if b == 4]
    assert switch, decisions
    assert losses[-1] < losses[0] and all(torch.isfinite(torch.tensor(losses)))
    if _crosses():   # the steps after the switch sent every entry (THC), the ones before 1 %
        assert ran[-1] == (4, 1.0), ran
        # (the first step's counters also hold what earlier tests sent since their last step)
        assert ran[1][0] == 0 and ran[1][1] < 0.05, ran


def test_thc_refuses_what_has_no_meaning_for_it():
    model = _model()
    comp = hvd.Compression.thc(bits=4)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for kwargs, match in (({"density_warmup": 10}, "density"), ({"dense_below": 100}, "density"),
                          ({"momentum_correction": True}, "thc"), ({"adjuster": hvd.Adjuster()}, "thc"),
                          ({"engine": "cpu"}, "thc")):
        with pytest.raises(ValueError, match=match):
            hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), compression=comp, **kwargs)
    # (momentum correction goes on through the adjuster's THC rungs: the route carries velocities)
    sparse = hvd.Compression.cacheaware(density=0.01)
    for kwargs, match in (({"engine": hvd.CpuEngine()}, "CPU engine"),):
        with pytest.raises(ValueError, match=match):
            hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), compression=sparse,
                                     adjuster=hvd.Adjuster(thc_bits=(4,)), **kwargs)
    with pytest.raises(ValueError, match="thc_bits"):
        hvd.Adjuster(thc_bits=(3, 3))
    with pytest.raises(ValueError, match="bits"):
        hvd.Compression.thc(bits=1)
    with pytest.raises(ValueError, match="bits"):
        hvd.Compression.thc(bits=16)
    with pytest.raises(TypeError, match="cross-cluster"):
        comp.compress(torch.ones(3))
