"""op=hvd.Adasum: hvd.allreduce against the one-process reference tree (comm/adasum.py), per
tensor in a group, equal on every rank; zeros (a joined rank) leave it unchanged; and
DistributedOptimizer(op=hvd.Adasum) as Horovod's delta optimizer."""
import pytest
import torch

import stella_mpi as hvd
from stella_mpi.comm.adasum import combine, reference


def _vec(r, n, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(1000 * seed + r)
    return torch.randn(n, generator=g, dtype=dtype)


def _expected(vectors_per_rank, spans):
    """Horovod's semantics on our hierarchy: one cluster, Adasum over the ranks; several, the sum
    inside each cluster and Adasum across the clusters' sums."""
    if hvd.num_clusters() == 1:
        return reference(vectors_per_rank, spans)
    members = hvd.allgather_object(hvd.cluster_id())
    sums = []
    for c in range(hvd.num_clusters()):
        sums.append(sum(v for v, m in zip(vectors_per_rank, members) if m == c))
    return reference(sums, spans)


def test_combine_is_the_adasum_formula():
    a, b = torch.tensor([1.0, 0.0], dtype=torch.float64), torch.tensor([0.0, 2.0], dtype=torch.float64)
    assert torch.equal(combine(a, b, [(0, 2)]), a + b)            # orthogonal: summed
    assert torch.allclose(combine(a, a, [(0, 2)]), a)              # parallel: averaged
    z = torch.zeros(2, dtype=torch.float64)
    assert torch.equal(combine(a, z, [(0, 2)]), a)                 # zero: neutral


@pytest.mark.parametrize("n", [0, 1, 7, 1000])
def test_allreduce_adasum_matches_the_reference(n):
    r, size = hvd.rank(), hvd.size()
    out = hvd.allreduce(_vec(r, n), op=hvd.Adasum, name="adasum.%d" % n)
    expect = _expected([_vec(q, n) for q in range(size)], [(0, n)])
    assert torch.allclose(out, expect, rtol=1e-12, atol=1e-12)
    everyone = hvd.allgather(out[None])
    assert all(torch.equal(everyone[0], everyone[q]) for q in range(size))   # bit for bit


def test_grouped_adasum_combines_each_tensor_on_its_own():
    r, size = hvd.rank(), hvd.size()
    sizes = [3, 17, 1]
    mine = [_vec(r, s, seed=i + 1).float() for i, s in enumerate(sizes)]
    outs = hvd.grouped_allreduce(mine, op=hvd.Adasum, name="adasum.group")
    for i, s in enumerate(sizes):
        expect = _expected([_vec(q, s, seed=i + 1).float().double() for q in range(size)], [(0, s)])
        assert torch.allclose(outs[i].double(), expect, rtol=1e-5, atol=1e-6)


def test_adasum_refuses_integers_and_reducescatter():
    with pytest.raises(TypeError, match="Adasum"):
        hvd.allreduce(torch.ones(3, dtype=torch.int32), op=hvd.Adasum)
    with pytest.raises(RuntimeError, match="Average or hvd.Sum"):
        hvd.reducescatter(torch.ones(4), op=hvd.Adasum)


def test_delta_optimizer():
    """Each rank steps on its own gradient; the deltas are combined with Adasum."""
    r, size = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    start = [p.detach().clone() for p in model.parameters()]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(r))
    model(x).pow(2).sum().backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    opt.step()
    all_grads = hvd.allgather_object(grads)
    for i, (p, s) in enumerate(zip(model.parameters(), start)):
        deltas = [(-0.1 * g[i]).double().reshape(-1) for g in all_grads]
        expect = s.double().reshape(-1) + _expected(deltas, [(0, p.numel())])
        assert torch.allclose(p.detach().double().reshape(-1), expect, rtol=1e-5, atol=1e-6)
