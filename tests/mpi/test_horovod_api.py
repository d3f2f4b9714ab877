"""Horovod's calls that stella_mpi had missing or different: sparse_allreduce_async on torch
sparse tensors, DistributedOptimizer with sparse gradients (nn.Embedding(sparse=True)) and
its _parameter_names, grouped_allgather_async and grouped_reducescatter_async."""
import pytest
import torch

import stella_mpi as hvd


def _sparse(r, rows, seed):
    g = torch.Generator().manual_seed(seed * 100 + r)
    t = torch.rand(rows, 6, generator=g)
    t[t < 0.8] = 0
    return t


@pytest.mark.parametrize("op", ["average", "sum"])
def test_sparse_allreduce_async_equals_a_dense_allreduce(op):
    r = hvd.rank()
    hop = hvd.Average if op == "average" else hvd.Sum
    dense = [_sparse(r, rows, i) for i, rows in enumerate((17, 1, 0, 40))]
    expect = [hvd.allreduce(t, op=hop, name="sparse.ref.%s.%d" % (op, i)) for i, t in enumerate(dense)]
    handles = [hvd.sparse_allreduce_async(t.to_sparse(), name="sparse.%s.%d" % (op, i), op=hop)
               for i, t in enumerate(dense)]
    for h, e in zip(handles, expect):
        out = hvd.synchronize(h)
        assert out.is_sparse and out.shape == e.shape
        assert torch.allclose(out.to_dense(), e, atol=1e-6)


def test_sparse_allreduce_async_refuses_a_dense_tensor():
    with pytest.raises(TypeError, match="sparse COO"):
        hvd.sparse_allreduce_async(torch.ones(3), name="not.sparse")


@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_sparse_embedding_gradients(sparse_as_dense):
    r, n = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 3, sparse=True)
    start = emb.weight.detach().clone()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.5), sparse_as_dense=sparse_as_dense)
    batches = [torch.LongTensor([[1, 2, 4, 5], [4, 3, 2, 9]]), torch.LongTensor([[1, 3, 4], [4, 7, 9]])]
    emb(batches[r % 2]).sum().backward()
    opt.step()
    # the mean over the ranks of each rank's gradient (one per occurrence of an index)
    grad = torch.zeros(10, 3)
    for q in range(n):
        for i in batches[q % 2].reshape(-1).tolist():
            grad[i] += 1.0 / n
    assert torch.allclose(emb.weight.detach(), start - 0.5 * grad, atol=1e-6)
    assert list(opt._parameter_names.values()) == ["allreduce.noname.0.0"]


def test_optimizer_without_named_parameters_names_them_as_horovod():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([{"params": model[0].parameters()},
                                                    {"params": model[1].parameters()}], lr=0.1))
    assert sorted(opt._parameter_names.values()) == ["allreduce.noname.%d.%d" % (g, i) for g in (0, 1)
                                                     for i in (0, 1)]
    assert hvd.allgather_object(sorted(opt._parameter_names.values())) == [sorted(opt._parameter_names.values())] \
        * hvd.size()


def test_grouped_allgather_and_reducescatter_async():
    r, n = hvd.rank(), hvd.size()
    tensors = [torch.full((r + 1, 2), float(r)), torch.full((2,), float(10 + r))]
    h = hvd.grouped_allgather_async(tensors, name="group.gather")
    assert not isinstance(h, int)
    outs = hvd.synchronize(h)
    assert torch.equal(outs[0], torch.cat([torch.full((q + 1, 2), float(q)) for q in range(n)]))
    assert torch.equal(outs[1], torch.tensor([float(10 + q) for q in range(n) for _ in range(2)]))
    rows = [torch.arange(2.0 * n).reshape(n, 2) * (r + 1), torch.ones(n + 1) * (r + 1)]
    outs = hvd.synchronize(hvd.grouped_reducescatter_async(rows, name="group.rs", op=hvd.Sum))
    total = sum(q + 1 for q in range(n))
    assert torch.equal(outs[0], (torch.arange(2.0 * n).reshape(n, 2) * total)[r:r + 1])
    extra = 1 if r < (n + 1) % n or n == 1 else 0
    assert outs[1].numel() == (n + 1) // n + extra and torch.all(outs[1] == total)
    h = hvd.grouped_allgather_async([torch.ones(1)], name="group.poll")
    assert hvd.poll(h) in (True, False)
    assert torch.equal(hvd.synchronize(h)[0], torch.ones(n))
