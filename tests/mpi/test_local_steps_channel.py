"""Local steps' inner steps on a cluster of several ranks reduce on the cluster's own channel
(optim/cluster_channel.py), off the negotiation: the same numbers as the negotiated allreduce,
a non-finite gradient refused on every rank of its cluster with the rank named, ranks whose
parameters differ refused when the optimizer is built, and ``hvd.join()`` usable once no inner
step waits (clusters of one rank have no channel: they reduce alone)."""
import logging

import pytest
import torch

import stella_mpi as hvd
from reference import nonfinite_policy
from stella_mpi.base.errors import NonFiniteGradientError, TensorMismatchError
from stella_mpi.core.process_sets import global_process_set
from stella_mpi.optim.clusters import cluster_process_set


@pytest.fixture(autouse=True)
def two_clusters(hvd_session):
    if global_process_set.topology.num_clusters < 2:
        pytest.skip("needs two clusters or more")


def _topo():
    return global_process_set.topology


def _model(width=5):
    torch.manual_seed(3)
    m = torch.nn.ModuleDict({"a": torch.nn.Linear(6, width), "b": torch.nn.Linear(width, 3).double()})
    return m


def _optimizer(model, **kw):
    return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                    local_steps=hvd.LocalSteps(every=4), **kw)


def _rank_grads(model, rank):
    g = torch.Generator().manual_seed(101 + rank)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)


def test_the_channel_averages_as_the_negotiated_allreduce_does():
    """Every gradient comes out of the channel with the bits the negotiated allreduce over the
    cluster gives (a float32 and a float64 bucket: the model's two dtypes never share one)."""
    model = _model()
    opt = _optimizer(model)
    _rank_grads(model, hvd.rank())
    want = [hvd.allreduce(p.grad.clone(), op=hvd.Average, process_set=cluster_process_set(), name="channel.want.%d" % i)
            for i, p in enumerate(model.parameters())]
    opt.synchronize()
    for (name, p), w in zip(model.named_parameters(), want):
        assert torch.equal(p.grad, w), name
    channel = opt._route.channel
    if _topo().cluster_size == 1:
        assert channel is None
    else:
        assert len(opt._buckets) == 2 and channel.reductions == 2, (len(opt._buckets), channel.reductions)


def _poisoned_rank():
    """The last rank of the first cluster of several ranks (None: every cluster has one)."""
    for members in _topo().cluster_members:
        if len(members) > 1:
            return global_process_set.ranks[members[-1]]
    return None


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_a_nonfinite_gradient_is_refused_on_every_rank_of_its_cluster_naming_it(policy, caplog):
    bad = _poisoned_rank()
    if bad is None:
        pytest.skip("no cluster of several ranks")
    model = _model()
    opt = _optimizer(model)
    _rank_grads(model, hvd.rank())
    if hvd.rank() == bad:
        next(iter(model.parameters())).grad[0, 0] = float("nan")
    mine = _topo().cluster_id
    hit = bad in [global_process_set.ranks[r] for r in _topo().cluster_members[mine]]
    with nonfinite_policy(policy), caplog.at_level(logging.WARNING, logger="stella_mpi"):
        if policy == "raise" and hit:
            with pytest.raises(NonFiniteGradientError, match=r"on rank %d in the cluster's allreduce" % bad):
                opt.synchronize()
        else:
            opt.synchronize()
    if policy == "skip":
        assert opt._route.skip == hit
        nan = [not bool(torch.isfinite(p.grad).any()) for p in model.parameters()]
        assert nan[0] == hit, nan   # the refused bucket's gradients are NaN on every rank of the cluster
        if hit:
            assert "on rank %d in the cluster's allreduce" % bad in caplog.text, caplog.text
    hvd.barrier()


@pytest.mark.parametrize("differ", ["shape", "buckets"])
def test_ranks_whose_parameters_differ_are_refused_when_the_optimizer_is_built(differ):
    """A rank of a cluster with a parameter of another shape, or the same parameters cut into
    other buckets: the cluster's ranks raise, naming the parameter and both ranks' shapes (or
    their buckets), before any inner step could pair mismatched buffers."""
    topo = _topo()
    if min(len(m) for m in topo.cluster_members) < 2:   # (it would build on, out of step with the others)
        pytest.skip("a cluster of one rank has no channel to refuse on")
    other = topo.cluster_rank == 1
    first = global_process_set.ranks[topo.cluster_members[topo.cluster_id][0]]
    if differ == "shape":
        model, kw = _model(width=7 if other else 5), {}
        match = r"rank %d: a.weight \(5, 6\) float32 on cpu; rank \d+: a.weight \(7, 6\)" % first
    else:
        model, kw = _model(), ({"num_groups": 4} if other else {})
        match = r"cut into different buckets .*rank %d \[2, 2\]; rank \d+ \[1, 1, 1, 1\]" % first
    with pytest.raises(TensorMismatchError, match=match):
        _optimizer(model, **kw)
    hvd.barrier()


def test_join_still_works_once_the_inner_steps_are_over():
    """A local-steps optimizer's channel does not stand in the way of hvd.join() when no inner
    step is waiting on it (a rank that joins while its cluster still steps ends the job naming
    it: tests/test_faults.py)."""
    model = _model()
    opt = _optimizer(model)
    _rank_grads(model, hvd.rank())
    opt.synchronize()
    assert hvd.join() in range(hvd.size())
