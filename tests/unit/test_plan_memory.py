"""stella_mpi/plan/memory.py against the runtime's real allocations: a small model's buckets
(the optimizer's own plan_by_size), fused with the real fuse() into the hierarchy's scratch,
each rank-0 shard of a 2-rank cluster sent through the real sparse and THC steps
(sparse_reduce / thc_reduce over MPI.COMM_SELF), then the residuals and scratch buffers the
runtime allocated are measured and compared with route_memory's prediction."""
import types

import pytest
import torch
from mpi4py import MPI

from stella_mpi.comm.buffers import split_counts
from stella_mpi.comm.deadline import Deadline
from stella_mpi.comm.hierarchy import Hierarchy
from stella_mpi.comm.pacing import Pacer
from stella_mpi.comm.sparse_exchange import sparse_reduce
from stella_mpi.comm.thc_exchange import thc_reduce
from stella_mpi.compression import get_compressor
from stella_mpi.compression.memory import Memory
from stella_mpi.core.counters import WanStats
from stella_mpi.core.fusion import fuse
from stella_mpi.optim.buckets import plan_by_size, plan_pseudo_gradient_buckets
from stella_mpi.plan import wire
from stella_mpi.plan import memory as pm

FUSION = 48 * 1024   # bytes: several buckets for the small model


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(300, 24), torch.nn.Linear(24, 96), torch.nn.ReLU(),
                               torch.nn.Linear(96, 96), torch.nn.Linear(96, 300))


def _hier():
    h = Hierarchy.__new__(Hierarchy)
    h._scratch = {}
    h.topo = types.SimpleNamespace(cluster_rank=0)
    h.stats, h.pacer, h.tamper, h.sparse_algorithm = WanStats(), Pacer(), None, "allgather"
    h.deadline = Deadline(60.0, 0)
    return h


def _run(route_comp, numels_by_bucket, params_by_bucket, g):
    """The real route over every bucket on rank 0 of a cluster of g: {what: bytes allocated}."""
    hier, mem = _hier(), Memory()
    for i, ps in enumerate(params_by_bucket):
        grads = [torch.randn_like(p) for p in ps]
        buf, direct = fuse(grads, [torch.empty_like(p) for p in ps], torch.float32, hier.scratch)
        shard = buf[:split_counts(buf.numel(), g)[0]].clone()
        if getattr(route_comp, "homomorphic", False):
            thc_reduce(hier, shard, route_comp, mem, "b%d#shard0" % i, 0, 0, MPI.COMM_SELF, "shard")
        else:
            sparse_reduce(hier, shard, route_comp, mem, "b%d" % i, 0, 0, MPI.COMM_SELF, "shard")
    got = {"residual": sum(4 * mem.get(n).numel() for n in mem.names())}
    for (slot, dtype, _), t in hier._scratch.items():
        got[slot] = t.numel() * t.element_size()
    return got


@pytest.mark.parametrize("kind", ["sparse", "thc"])
def test_route_memory_matches_the_runtime_allocations(kind):
    model = _model()
    params = list(model.parameters())
    planned = [b for _, b in plan_by_size([list(reversed(params))], FUSION)]
    assert len(planned) >= 3 and any(len(b) > 1 for b in planned)
    numels = [p.numel() for p in params]
    assert wire.bucket_members(numels, FUSION) == [[p.numel() for p in b] for b in planned]
    comp = get_compressor("topk", density=0.01) if kind == "sparse" else get_compressor("thc", bits=4)
    got = _run(comp, None, planned, g=2)
    route = {"kind": kind, "compressor": "topk", "density": 0.01, "bits": 4}
    # COMM_SELF: the words are sized for one cluster (the lane for 1)
    want = pm.route_memory(route, [2], numels, fusion_bytes=FUSION, device="cpu")
    assert want == {}   # one cluster: nothing crosses
    want = pm.route_memory(route, [2, 2], numels, fusion_bytes=FUSION, device="cpu")
    assert got["residual"] == want["residual"]
    assert got["fusion"] == want["fusion"]
    if kind == "thc":
        assert got["thc.rotated"] == want["thc_rotated"]


def test_gpu_staging_fp16_gather_and_local_steps():
    numels = [1000, 5000, 3000]
    total = sum(numels)
    fp16 = pm.route_memory({"kind": "fp16"}, [1] * 8, numels, device="gpu")
    assert fp16["gather"] == 2 * total * 8 and fp16["wire"] == 2 * total and fp16["host_cross"] == 4 * total
    dense2 = pm.route_memory({"kind": "dense"}, [4, 4], numels, device="cpu")
    assert dense2["peer"] == 4 * split_counts(total, 4)[0] and "host_cross" not in dense2
    local = pm.route_memory({"kind": "local", "pseudo": {"kind": "thc", "bits": 4}}, [2] * 4, numels,
                            pseudo_bucket_bytes=0)
    assert local["anchor"] == local["outer_momentum"] == local["pseudo_gradient"] == 4 * total
    assert local["pseudo_fusion"] == 4 * total   # one fused buffer of the whole model (before issue 32)
    cut = pm.route_memory({"kind": "local", "pseudo": {"kind": "thc", "bits": 4}}, [2] * 4, numels,
                          fusion_bytes=4 * 8500)
    # the runtime's pseudo-gradient buckets (parameter order, optim/tuning.py): [1000, 5000], [3000]
    planned = plan_pseudo_gradient_buckets([torch.zeros(n) for n in numels], 4 * 8500)
    assert [[p.numel() for p in b] for b in planned] == [[1000, 5000], [3000]]
    assert cut["pseudo_fusion"] == 4 * 6000 and cut["pseudo_thc_rotated"] == 4 * 3000
    assert local["pseudo_residual"] == 4 * split_counts(total, 2)[0]
    avg = pm.route_memory({"kind": "local"}, [2] * 4, numels, outer="average")
    assert "outer_momentum" not in avg
    mc = pm.route_memory({"kind": "sparse", "density": 0.01}, [2, 2], numels, momentum_correction=True)
    assert mc["momentum_velocity"] == 4 * total


def test_bad_input_names_the_value():
    with pytest.raises(ValueError, match="ring"):
        pm.route_memory({"kind": "ring"}, [2, 2], [10])
    with pytest.raises(ValueError, match="cluster_sizes"):
        pm.route_memory({"kind": "dense"}, [], [10])
    with pytest.raises(ValueError, match="outer"):
        pm.route_memory({"kind": "local"}, [2, 2], [10], outer="adam")
