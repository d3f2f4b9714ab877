"""The sparse cross-cluster route: against the dense result, against a reference pipeline
each rank computes itself, the error-feedback mass balance, byte counts, and settings checks."""
import math

import pytest
import torch

import stella_mpi as hvd
from stella_mpi.core import state
from stella_mpi.compression import TensorContext
from stella_mpi.compression import merge_selections
from stella_mpi.comm.buffers import split_counts
from reference import error_feedback_balance, rank_input


def _tree(payload_bytes):
    from stella_mpi.comm.sparse_exchange import choose_algorithm
    topo = hvd.global_process_set.topology
    return choose_algorithm(hvd.global_process_set.hierarchy.sparse_algorithm, topo.num_clusters, payload_bytes) == "tree"


def _cluster_shard_sums(inputs, n):
    """Per cluster, the cluster sum split into shards as the route does."""
    topo = hvd.global_process_set.topology
    out = []
    for members in topo.cluster_members:
        total = sum(inputs[r] for r in members)
        if topo.uniform_clusters:
            counts = split_counts(n, len(members))
            out.append(list(torch.split(total, counts)))
        else:
            out.append([total])
    return out


def _compressor(kind, **kwargs):
    """A built-in sparse compressor by test name; ``cacheaware+singles``: cache-aware blocks
    with single entries beside them."""
    if kind == "cacheaware+singles":
        return hvd.Compression.cacheaware(singles=0.6, **kwargs)
    return getattr(hvd.Compression, kind)(**kwargs)


@pytest.mark.parametrize("name", ["topk", "cacheaware", "randomk", "threshold", "cacheaware+singles"])
def test_density_one_equals_dense(name):
    n = 5000
    x = rank_input(hvd.rank(), (n,), torch.float32, seed=31)
    comp = _compressor(name, density=1.0)
    got = hvd.allreduce(x, compression=comp, name="dense1.%s" % name)
    want = hvd.allreduce(x, name="dense1.ref.%s" % name)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_density_one_is_sent_dense_and_flushes_the_residual():
    """The adjuster's top rung: at density 1 the cross-cluster hop is the dense sum (no index
    bytes), with the residual left by a sparse step added and cleared, so nothing is lost."""
    n = 6000
    x1 = rank_input(hvd.rank(), (n,), torch.float32, seed=51)
    x2 = rank_input(hvd.rank(), (n,), torch.float32, seed=52)
    comp = hvd.Compression.topk(density=0.05)
    a = hvd.allreduce(x1, compression=comp, name="rung")
    hvd.stats(end_step=True)
    b = hvd.allreduce(x2, compression=comp.with_density(1.0), name="rung")
    last = hvd.stats(end_step=True)["last_step"]
    want = hvd.allreduce(x1 + x2, name="rung.ref")
    torch.testing.assert_close(a + b, want, rtol=1e-5, atol=1e-5)
    memory = state.current().sparse_memory
    assert not [k for k in memory.names() if k.startswith("rung")], memory.names()
    topo = hvd.global_process_set.topology
    if topo.num_clusters == 2 and topo.uniform_clusters:   # every rank swaps its dense shard with one peer
        shard = split_counts(n, topo.cluster_size)[topo.cluster_rank]
        assert last["wan_bytes_sent"] == 4 * shard and last["residual_norm_ratio"] == 0.0, last


def test_density_one_with_16_bit_values_clamps_and_keeps_the_rounding_error():
    """The dense rung with float16 values: what float16 cannot hold is clamped, not inf, and
    with error feedback the rounding error stays in the residual for the next step."""
    n = 3000
    x = rank_input(hvd.rank(), (n,), torch.float32, seed=61)
    x[5] = 1e6   # beyond float16's range on every rank
    comp = hvd.Compression.topk(density=1.0, value_dtype="float16")
    out = hvd.allreduce(x, compression=comp, name="rung16")
    assert bool(torch.isfinite(out).all())
    if hvd.global_process_set.topology.num_clusters > 1:   # the rank owning entry 5 kept the excess
        memory = state.current().sparse_memory
        local = max([float(memory.get(k).abs().max()) for k in memory.names() if k.startswith("rung16")] or [0.0])
        peak = hvd.allreduce(torch.tensor([local]), op=hvd.Max, name="rung16.peak").item()
        assert peak > 1e5, peak


def test_topk_matches_reference_pipeline():
    """First step (empty residual): result = sum over clusters of each cluster's top-k of its
    shard sum, divided by the number of ranks."""
    n, density = 4000, 0.05
    topo = hvd.global_process_set.topology
    inputs = [rank_input(r, (n,), torch.float32, seed=41) for r in range(hvd.size())]
    comp = hvd.Compression.topk(density=density)
    got = hvd.allreduce(inputs[hvd.rank()], compression=comp, name="ref.pipeline")
    if topo.num_clusters == 1:
        torch.testing.assert_close(got, sum(inputs) / hvd.size())
        return
    if _tree(8 * n):
        pytest.skip("the tree re-selects at each round; covered by the conservation test")
    shards = _cluster_shard_sums(inputs, n)
    ref_comp = hvd.Compression.topk(density=density)
    pieces = []
    for s in range(len(shards[0])):
        sels = [ref_comp.select(shards[c][s].contiguous(), TensorContext("r", 0, (shards[c][s].numel(),)))
                for c in range(topo.num_clusters)]
        pieces.append(merge_selections(sels).to_dense())
    want = torch.cat(pieces) / hvd.size()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert (got != 0).sum() <= topo.num_clusters * sum(max(1, round(density * p.numel())) for p in pieces)


@pytest.mark.parametrize("name", ["topk", "cacheaware", "randomk", "threshold", "topk:float16", "cacheaware:bfloat16",
                                  "cacheaware+singles", "cacheaware+singles:float16"])
def test_error_feedback_conserves_the_gradient(name):
    """Over several steps, what was delivered plus what waits in the residuals equals what was
    fed in: nothing is lost, nothing is counted twice; and every rank gets the same result (on
    the tree route too, where a threshold selection's length differs by rank and 16-bit merges
    are rounded before they are sent on)."""
    topo = hvd.global_process_set.topology
    n, steps, key = 20011, 4, "ef.%s" % name
    kind, _, dtype = name.partition(":")
    comp = _compressor(kind, density=0.02, value_dtype=dtype or "float32")
    delivered, residual, fed = error_feedback_balance(comp, key, n, [100 * s + 7 for s in range(steps)])
    tol = 1e-4 if not dtype else 1e-2   # (16-bit sums of 16-bit values round along the way)
    torch.testing.assert_close(delivered + residual, fed, rtol=tol, atol=10 * tol)
    if topo.num_clusters > 1:
        assert residual.abs().sum() > 0  # something was held back


def test_wan_bytes_follow_the_payload_formula():
    topo = hvd.global_process_set.topology
    if topo.num_clusters == 1 or not topo.uniform_clusters or _tree(1 << 30):
        pytest.skip("needs clusters of equal size and the all-gather exchange")
    n, density = 20_000, 0.01
    hvd.stats(end_step=True)
    hvd.allreduce(torch.randn(n), compression=hvd.Compression.topk(density=density), name="bytes")
    last = hvd.stats(end_step=True)["last_step"]
    shard = split_counts(n, topo.cluster_size)[topo.cluster_rank]
    k = max(1, round(density * shard))
    peers = topo.num_clusters - 1
    index_bytes = min(4 * k, 4 * math.ceil(shard / 65536) + 2 * k)   # uint32 or 16-bit offsets
    payload = 32 + index_bytes + 4 * k
    assert last["wan_bytes_sent"] == peers * (payload + 8), (last, payload)
    assert last["entries_sent"] == k and last["elements"] == shard
    assert last["density"] == pytest.approx(k / shard)
    assert last["select_s"] >= 0 and last["exchange_s"] > 0


def test_dense_route_counts_wan_bytes_too():
    topo = hvd.global_process_set.topology
    if topo.num_clusters != 2 or not topo.uniform_clusters:
        pytest.skip("two clusters of equal size")
    hvd.stats(end_step=True)
    hvd.allreduce(torch.randn(8000), name="dense.bytes")
    last = hvd.stats(end_step=True)["last_step"]
    assert last["wan_bytes_sent"] == 4 * split_counts(8000, topo.cluster_size)[topo.cluster_rank]


def test_mismatched_compressor_settings_are_detected():
    density = 0.01 if hvd.rank() == 0 else 0.02
    if hvd.size() == 1:
        pytest.skip("one rank")
    with pytest.raises(hvd.TensorMismatchError, match="compressor"):
        hvd.allreduce(torch.randn(1000), compression=hvd.Compression.topk(density=density), name="mismatch.comp")


def test_sparse_needs_a_name_and_float32():
    with pytest.raises(ValueError, match="name"):
        hvd.allreduce(torch.randn(10), compression=hvd.Compression.topk(density=0.5))
    ints = torch.arange(10)
    assert torch.equal(hvd.allreduce(ints, compression=hvd.Compression.topk(density=0.5), op=hvd.Sum),
                       ints * hvd.size())  # non-float tensors take the dense route


def test_distributed_optimizer_sparse_keeps_ranks_identical():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 5))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.cacheaware(density=0.05))
    g = torch.Generator().manual_seed(hvd.rank())
    for _ in range(3):
        opt.zero_grad()
        x = torch.randn(16, 20, generator=g)
        model(x).pow(2).mean().backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = hvd.allgather(flat.unsqueeze(0))
    assert all(torch.equal(everyone[0], everyone[r]) for r in range(hvd.size()))
    st = hvd.stats()
    topo = hvd.global_process_set.topology
    if topo.num_clusters > 1 and (topo.uniform_clusters or topo.cluster_rank == 0):  # ranks on the WAN
        assert st["last_step"]["wan_bytes_sent"] > 0 and st["last_step"]["density"] < 0.2


def test_a_name_reused_with_another_size_is_a_new_tensor():
    """As in Horovod: the same name with another size later is a new tensor (fresh residual),
    not an error that ends the job."""
    comp = hvd.Compression.topk(density=1.0)   # density 1 sends everything: the exact mean
    for n in (1000, 1536, 1000):
        x = torch.arange(n, dtype=torch.float32) * (hvd.rank() + 1)
        out = hvd.allreduce(x, compression=comp, name="reused.size")
        want = torch.arange(n, dtype=torch.float32) * sum(r + 1 for r in range(hvd.size())) / hvd.size()
        torch.testing.assert_close(out, want)


def test_a_sparse_sum_that_overflows_is_refused_everywhere():
    """Finite inputs whose sum over clusters is not (3e38 at the same index everywhere): every
    rank holds the same sum, so every rank refuses it alike, rather than handing over an Inf;
    the residual stays finite and the same name goes on."""
    from stella_mpi.base.errors import NonFiniteGradientError
    if hvd.global_process_set.topology.num_clusters < 2:
        pytest.skip("one cluster: nothing crosses")
    n = 4096
    comp = hvd.Compression.topk(density=0.01)
    big = torch.zeros(n)
    big[100] = 3e38
    with pytest.raises(NonFiniteGradientError, match="sparse sum over clusters is not finite"):
        hvd.allreduce(big, compression=comp, name="sparse.overflow", op=hvd.Sum)
    for k in state.current().sparse_memory.names():
        if k.startswith("sparse.overflow"):
            assert torch.isfinite(state.current().sparse_memory.get(k)).all(), k
    after = hvd.allreduce(rank_input(hvd.rank(), (n,), torch.float32, seed=3), compression=comp,
                          name="sparse.overflow", op=hvd.Sum)
    everyone = hvd.allgather(after.unsqueeze(0))
    assert torch.isfinite(after).all() and all(torch.equal(everyone[0], everyone[r]) for r in range(hvd.size()))
