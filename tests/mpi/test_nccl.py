"""The CUDA intra-cluster route: NCCL where each cluster rank has its own GPU, staged through
pinned host memory where ranks share one. Needs CUDA (skipped without it); run by tests/test_gpu.py."""
import pytest
import torch
from mpi4py import MPI

import stella_mpi as hvd
from stella_mpi.comm.deadline import Deadline
from stella_mpi.comm.intra import MpiIntra, NcclIntra, StagedIntra
from stella_mpi.base.devices import route_for

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _device():
    return torch.device("cuda", hvd.local_rank() % max(torch.cuda.device_count(), 1))


def test_nccl_intra_on_one_rank():
    """NCCL's calls as the cluster route makes them, on a group of one (one GPU allows no more):
    allreduce, the padded reduce-scatter and the all-gather, inside the side stream."""
    comm = MPI.COMM_SELF.Dup()
    dl = Deadline(60, hvd.rank())
    intra = NcclIntra(comm, dl, True)
    dev = _device()
    route = route_for(dev)
    try:
        with route.context():
            x = torch.arange(10, dtype=torch.float32, device=dev)
            intra.allreduce(x, "sum")
            shard = intra.reduce_scatter(x.clone(), [10], "sum")
            out = torch.empty(10, device=dev)
            intra.allgather_into(shard, [10], out)
        route.finish()
        assert x.tolist() == list(range(10)) and out.tolist() == list(range(10))
    finally:
        intra.free()
        comm.Free()


def test_staged_intra_equals_host_backend():
    comm = hvd.global_process_set.comms.cluster
    dl = Deadline(60, hvd.rank())
    host = MpiIntra(comm, dl)
    dev = _device()
    staged = StagedIntra(host, route_for(dev))
    n = comm.Get_size()
    x = torch.arange(7 * n, dtype=torch.float32) + hvd.rank()
    counts = [7] * n
    want = x.clone()
    host.allreduce(want, "sum")
    got = x.to(dev)
    staged.allreduce(got, "sum")
    assert torch.equal(got.cpu(), want)
    shard = staged.reduce_scatter(x.to(dev), counts, "sum")
    assert torch.equal(shard.cpu(), want[7 * comm.Get_rank():7 * comm.Get_rank() + 7])
    out = torch.empty(7 * n, device=dev)
    staged.allgather_into(shard, counts, out)
    assert torch.equal(out.cpu(), want)


def test_route_chosen_from_the_gpu_layout():
    """After a CUDA allreduce the cluster's route is NCCL when its ranks have distinct GPUs, and
    staged (with a warning on the cluster's first rank naming the ranks) when they share one."""
    hier = hvd.global_process_set.hierarchy
    dev = _device()
    out = hvd.allreduce(torch.ones(5, device=dev), op=hvd.Sum, name="nccl.layout")
    assert out.device == dev and out.tolist() == [float(hvd.size())] * 5
    topo = hier.topo
    intra = hier.device_intras.get(dev)
    if topo.cluster_size == 1:
        assert intra is None
        return
    gpus = hvd.allgather_object(str(torch.cuda.get_device_properties(dev).uuid))
    members = topo.cluster_members[topo.cluster_id]
    shared = len({gpus[r] for r in members}) < len(members)
    if shared:
        assert intra is None
        assert isinstance(hier.intra_for(torch.ones(1, device=dev)), StagedIntra)
        # the warning (cluster rank 0) went out at the cluster's first CUDA collective, which may
        # have been an earlier test's: its text is kept on every rank
        why = hier.staged_reasons[dev]
        assert ("ranks %s share GPU" % list(members)) in why, why
    else:
        assert isinstance(intra, NcclIntra)
