"""Every collective x op x dtype on the ranks of this job, against references each rank
computes itself from rank-seeded inputs. Run under mpirun by tests/test_mpi_suites.py
(1 and 2 clusters, 2-4 ranks, uneven clusters)."""
import pytest
import torch

import stella_mpi as hvd
from reference import ALL_DTYPES, assert_close, rank_input, reference_allreduce

OPS = [hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product]
SHAPES = [(17,), (3, 5), (0,), (1,), (2, 3, 4)]


def _ops_for(dtype):
    return [hvd.Min, hvd.Max] if dtype == torch.bool else OPS


def test_topology_is_consistent():
    n, r = hvd.size(), hvd.rank()
    assert 0 <= r < n
    assert hvd.local_size() == n  # one host
    assert hvd.local_rank() == r
    assert hvd.cross_size() == 1 and hvd.cross_rank() == 0
    assert 0 <= hvd.cluster_id() < hvd.num_clusters()
    assert 0 <= hvd.cluster_rank() < hvd.cluster_size()
    sizes = hvd.allgather(torch.tensor([hvd.cluster_size()]))
    ids = hvd.allgather(torch.tensor([hvd.cluster_id()]))
    for c in range(hvd.num_clusters()):
        members = (ids == c).nonzero().flatten().tolist()
        assert sizes[members].eq(len(members)).all()
    assert sum(1 for _ in set(ids.tolist())) == hvd.num_clusters()


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_allreduce_every_op(dtype):
    n = hvd.size()
    for op in _ops_for(dtype):
        for shape in SHAPES:
            small = op == hvd.Product or not dtype.is_floating_point
            inputs = [rank_input(r, shape, dtype, seed=op, small=small) for r in range(n)]
            got = hvd.allreduce(inputs[hvd.rank()], op=op, name="ar.%s.%d.%s" % (dtype, op, shape))
            assert_close(got, reference_allreduce(inputs, op, dtype), dtype, "allreduce op=%d %s" % (op, shape))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.int32, torch.int64], ids=str)
def test_allreduce_scale_factors_and_inplace(dtype):
    n = hvd.size()
    inputs = [rank_input(r, (33,), dtype, seed=7) for r in range(n)]
    for op in (hvd.Sum, hvd.Average):
        t = inputs[hvd.rank()].clone()
        out = hvd.allreduce_(t, op=op, prescale_factor=0.5, postscale_factor=3.0, name="scale.%s.%d" % (dtype, op))
        assert out is t
        assert_close(t, reference_allreduce(inputs, op, dtype, 0.5, 3.0), dtype, "scaled op=%d" % op)


def test_allreduce_large_and_odd_sizes():
    n = hvd.size()
    for size in (1, 2, 3, 1000, 2 ** 16 + 3, 1_000_003):
        inputs = [rank_input(r, (size,), torch.float32, seed=size) for r in range(n)]
        got = hvd.allreduce(inputs[hvd.rank()], op=hvd.Sum)
        assert_close(got, reference_allreduce(inputs, hvd.Sum, torch.float32), torch.float32, "size %d" % size)


def test_allreduce_result_identical_on_every_rank():
    x = rank_input(hvd.rank(), (4099,), torch.float32, seed=3)
    y = hvd.allreduce(x, op=hvd.Average)
    everyone = hvd.allgather(y.unsqueeze(0))
    assert all(torch.equal(everyone[0], everyone[i]) for i in range(hvd.size()))


def test_average_default_and_deprecated_average_flag():
    x = torch.full((4,), float(hvd.rank()))
    mean = (hvd.size() - 1) / 2
    assert torch.allclose(hvd.allreduce(x), torch.full((4,), mean))
    with pytest.warns(DeprecationWarning):
        s = hvd.allreduce(x, average=False)
    assert torch.allclose(s, torch.full((4,), mean * hvd.size()))
    with pytest.raises(ValueError, match="supersedes"):
        hvd.allreduce(x, average=True, op=hvd.Sum)


def test_async_poll_synchronize():
    handles = [hvd.allreduce_async(torch.full((100,), float(i + hvd.rank())), op=hvd.Sum, name="async.%d" % i)
               for i in range(5)]
    results = [hvd.synchronize(h) for h in handles]
    base = sum(range(hvd.size()))
    for i, r in enumerate(results):
        assert torch.allclose(r, torch.full((100,), float(base + i * hvd.size())))
    h = hvd.allreduce_async_(torch.ones(3), op=hvd.Sum)
    while not hvd.poll(h):
        pass
    assert torch.equal(hvd.synchronize(h), torch.full((3,), float(hvd.size())))
    assert hvd.synchronize(123456789) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64], ids=str)
def test_grouped_allreduce(dtype):
    n = hvd.size()
    shapes = [(5,), (2, 7), (0,), (1,)]
    inputs = [[rank_input(r, s, dtype, seed=i) for i, s in enumerate(shapes)] for r in range(n)]
    got = hvd.grouped_allreduce(inputs[hvd.rank()], op=hvd.Sum)
    for i, g in enumerate(got):
        assert_close(g, reference_allreduce([inputs[r][i] for r in range(n)], hvd.Sum, dtype), dtype, "group %d" % i)
    mine = [t.clone() for t in inputs[hvd.rank()]]
    out = hvd.grouped_allreduce_(mine, op=hvd.Max)
    for i, (o, m) in enumerate(zip(out, mine)):
        assert o is m
        assert_close(m, reference_allreduce([inputs[r][i] for r in range(n)], hvd.Max, dtype), dtype, "max %d" % i)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_allgather_uneven_first_dim(dtype):
    n = hvd.size()
    inputs = [rank_input(r, (r % 3, 4), dtype, seed=11) for r in range(n)]  # rank 0 sends nothing
    got = hvd.allgather(inputs[hvd.rank()])
    assert torch.equal(got, torch.cat(inputs)), (got, inputs)
    grouped = hvd.grouped_allgather([inputs[hvd.rank()], inputs[hvd.rank()][:, :1]])
    assert torch.equal(grouped[1], torch.cat([x[:, :1] for x in inputs]))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_broadcast_from_every_root(dtype):
    n = hvd.size()
    for root in range(n):
        for shape in [(6,), (2, 3), (0,), ()]:
            mine = rank_input(hvd.rank(), shape, dtype, seed=root)
            got = hvd.broadcast(mine, root, name="bc.%s.%d.%s" % (dtype, root, shape))
            assert torch.equal(got, rank_input(root, shape, dtype, seed=root))
            assert torch.equal(mine, rank_input(hvd.rank(), shape, dtype, seed=root))  # input untouched
            t = mine.clone()
            assert hvd.broadcast_(t, root) is t
            assert torch.equal(t, rank_input(root, shape, dtype, seed=root))


@pytest.mark.parametrize("dtype", [torch.float32, torch.int16, torch.bool, torch.bfloat16], ids=str)
def test_alltoall_with_and_without_splits(dtype):
    n, me = hvd.size(), hvd.rank()
    # rank r sends (r + d) % 3 rows to rank d
    splits = [(me + d) % 3 for d in range(n)]
    x = rank_input(me, (sum(splits), 2), dtype, seed=5)
    out, recv = hvd.alltoall(x, splits=torch.tensor(splits, dtype=torch.int32))
    expect = []
    for src in range(n):
        s = [(src + d) % 3 for d in range(n)]
        xs = rank_input(src, (sum(s), 2), dtype, seed=5)
        start = sum(s[:me])
        expect.append(xs[start:start + s[me]])
    assert torch.equal(out, torch.cat(expect))
    assert recv.dtype == torch.int32 and recv.tolist() == [(src + me) % 3 for src in range(n)]
    even = rank_input(me, (2 * n, 3), dtype, seed=9)
    out2 = hvd.alltoall(even)
    assert isinstance(out2, torch.Tensor) and out2.shape == (2 * n, 3)
    # rows of zero elements still count: the received splits and the shape follow the rows
    empty_rows, recv0 = hvd.alltoall(torch.zeros(sum(splits), 0, dtype=dtype), splits=torch.tensor(splits, dtype=torch.int32))
    assert empty_rows.shape == (sum((src + me) % 3 for src in range(n)), 0), empty_rows.shape
    assert recv0.tolist() == recv.tolist()
    with pytest.raises(ValueError, match="even multiple"):
        hvd.alltoall(torch.zeros(2 * n + 1))
    with pytest.raises(ValueError, match="number of workers"):
        hvd.alltoall(torch.zeros(4), splits=[1] * (n + 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32], ids=str)
def test_reducescatter(dtype):
    n, me = hvd.size(), hvd.rank()
    rows = 2 * n + 1  # uneven: the first rank gets one more row
    inputs = [rank_input(r, (rows, 3), dtype, seed=13) for r in range(n)]
    for op in (hvd.Sum, hvd.Average):
        got = hvd.reducescatter(inputs[me], op=op)
        full = reference_allreduce(inputs, op, dtype)
        counts = [rows // n + (1 if r < rows % n else 0) for r in range(n)]
        start = sum(counts[:me])
        assert_close(got, full[start:start + counts[me]], dtype, "reducescatter op=%d" % op)


def test_barrier_and_objects():
    hvd.barrier()
    obj = {"rank": hvd.rank(), "text": "x" * hvd.rank()}
    assert hvd.broadcast_object(obj, root_rank=hvd.size() - 1) == {"rank": hvd.size() - 1,
                                                                    "text": "x" * (hvd.size() - 1)}
    assert hvd.allgather_object(obj) == [{"rank": r, "text": "x" * r} for r in range(hvd.size())]


def test_autograd_through_collectives():
    n, me = hvd.size(), hvd.rank()
    x = torch.full((3,), float(me + 1), requires_grad=True)
    y = hvd.allreduce(x, op=hvd.Sum)
    (y * torch.arange(3.0)).sum().backward()
    # d/dx_me sum_k w_k * sum_r x_r = w, summed over ranks by the backward allreduce
    assert torch.allclose(x.grad, torch.arange(3.0) * n)
    x2 = torch.ones(me + 1, 2, requires_grad=True)
    g = hvd.allgather(x2)
    (g * 2).sum().backward()
    assert torch.allclose(x2.grad, torch.full((me + 1, 2), 2.0))
    x3 = torch.ones(4, requires_grad=True)
    b = hvd.broadcast(x3, 0)
    (b * 3).sum().backward()
    assert torch.allclose(x3.grad, torch.full((4,), 3.0 if me == 0 else 0.0))


def test_inplace_collectives_on_parameters():
    """allreduce_ and broadcast_ write into a parameter (a leaf that requires grad), inside
    no_grad or not, as Horovod's do; fp16/bf16 compression keeps autograd on CPU float32."""
    n = hvd.size()
    p = torch.nn.Parameter(torch.full((5,), float(hvd.rank() + 1)))
    with torch.no_grad():
        out = hvd.allreduce_(p, op=hvd.Average, name="inplace.param.a")
    assert out is p and torch.equal(p.detach(), torch.full((5,), (n + 1) / 2.0))
    hvd.allreduce_(p, op=hvd.Sum, name="inplace.param.b")
    assert torch.equal(p.detach(), torch.full((5,), n * (n + 1) / 2.0)) and p.requires_grad
    q = torch.nn.Parameter(torch.full((3, 2), float(hvd.rank())))
    assert hvd.broadcast_(q, root_rank=n - 1, name="inplace.param.c") is q
    assert torch.equal(q.detach(), torch.full((3, 2), float(n - 1)))
    for comp in (hvd.Compression.fp16, hvd.Compression.bf16):
        x = torch.full((4,), 1.0 + hvd.rank(), requires_grad=True)
        y = hvd.allreduce(x, op=hvd.Sum, compression=comp, name="inplace.grad.%s" % comp.name)
        y.sum().backward()
        assert torch.equal(x.grad, torch.full((4,), float(n)))   # Horovod: the gradient is allreduced too


def test_objects_and_roots_as_horovod_takes_them():
    """broadcast_object of the root's object against the others' None, unnamed (names by type
    would differ and stall), allgather_object of objects of different types, a numpy root rank."""
    import numpy as np
    got = hvd.broadcast_object({"lr": 0.1} if hvd.rank() == 0 else None)
    assert got == {"lr": 0.1}
    assert hvd.allgather_object(hvd.rank() if hvd.rank() % 2 else float(hvd.rank())) == \
        [r if r % 2 else float(r) for r in range(hvd.size())]
    t = torch.full((2,), float(hvd.rank()))
    assert torch.equal(hvd.broadcast(t, root_rank=np.int64(hvd.size() - 1)), torch.full((2,), float(hvd.size() - 1)))
    with pytest.raises(ValueError, match="root_rank"):
        hvd.broadcast(t, root_rank=True)


def test_process_set_ids_are_never_reused():
    """A removed set's id is not given to the next set: its ranks' auto-name counters stay
    behind, and a new set under the same id would name its first unnamed op differently on a rank
    that used the old set (they would wait for each other until the deadline)."""
    n = hvd.size()
    if n < 3:
        pytest.skip("needs two overlapping sets of two ranks")
    a = hvd.add_process_set([0, 1])
    used = a.process_set_id
    if hvd.rank() in (0, 1):
        hvd.allreduce(torch.ones(2), process_set=a)
    hvd.remove_process_set(a)
    b = hvd.add_process_set([1, 2])
    assert b.process_set_id not in (0, used)
    # rank 1's op waits for rank 2's, which comes only after the removal was tried: every rank
    # refuses to free the set's communicators under it
    h = hvd.allreduce_async(torch.ones(2), op=hvd.Sum, process_set=b) if hvd.rank() == 1 else None
    with pytest.raises(ValueError, match="still queued or running on some rank"):
        hvd.remove_process_set(b)
    if hvd.rank() == 2:
        h = hvd.allreduce_async(torch.ones(2), op=hvd.Sum, process_set=b)
    if h is not None:
        assert torch.equal(hvd.synchronize(h), torch.full((2,), 2.0))
    hvd.remove_process_set(b)


def test_join_with_uneven_work():
    me, n = hvd.rank(), hvd.size()
    steps = 2 + me  # the last rank does the most steps
    for s in range(steps):
        active = sum(1 for r in range(n) if 2 + r > s)
        got = hvd.allreduce(torch.ones(5), op=hvd.Sum, name="join.step.%d" % s)
        assert torch.allclose(got, torch.full((5,), float(active))), (s, got)
    with pytest.raises(ValueError, match="takes a CUDA device index"):
        hvd.join(device="cuda:0")
    last = hvd.join()
    assert last == n - 1
    assert torch.allclose(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(n)))


def test_mismatched_shapes_raise_on_every_rank():
    shape = (3,) if hvd.rank() == 0 else (4,)
    with pytest.raises(hvd.TensorMismatchError) as info:
        hvd.allreduce(torch.zeros(shape), name="mismatch")
    msg = str(info.value)
    assert "rank 0" in msg and "[3]" in msg and "[4]" in msg
    dtype = torch.float32 if hvd.rank() == 0 else torch.float64
    with pytest.raises(hvd.TensorMismatchError, match="float64"):
        hvd.allreduce(torch.zeros(2, dtype=dtype), name="mismatch.dtype")
    # the ranks are still in step afterwards
    assert torch.allclose(hvd.allreduce(torch.ones(1), op=hvd.Sum), torch.full((1,), float(hvd.size())))


def test_bad_input_is_refused_locally():
    with pytest.raises(TypeError, match="dtype"):
        hvd.allreduce(torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(TypeError, match="bool"):
        hvd.allreduce(torch.zeros(2, dtype=torch.bool), op=hvd.Sum)
    with pytest.raises(TypeError, match="Adasum"):
        hvd.allreduce(torch.zeros(2, dtype=torch.int64), op=hvd.Adasum)
    with pytest.raises(ValueError, match="root_rank"):
        hvd.broadcast(torch.zeros(2), hvd.size())
    with pytest.raises(ValueError, match="scalar"):
        hvd.allgather(torch.tensor(1.0))
    with pytest.raises(TypeError):
        hvd.allreduce([1, 2, 3])


def test_fp16_and_bf16_compression():
    n = hvd.size()
    inputs = [rank_input(r, (1000,), torch.float32, seed=21) for r in range(n)]
    want = reference_allreduce(inputs, hvd.Average, torch.float32)
    for comp, tol in ((hvd.Compression.fp16, 2e-3), (hvd.Compression.bf16, 2e-2)):
        got = hvd.allreduce(inputs[hvd.rank()], compression=comp)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_process_set_subset():
    if hvd.size() < 3:
        pytest.skip("needs 3 ranks")
    ps = hvd.add_process_set([0, 2])
    try:
        if hvd.rank() in (0, 2):
            got = hvd.allreduce(torch.full((3,), float(hvd.rank())), op=hvd.Sum, process_set=ps)
            assert torch.allclose(got, torch.full((3,), 2.0))
            assert ps.size() == 2 and ps.rank() == (0 if hvd.rank() == 0 else 1)
        else:
            with pytest.raises(ValueError, match="not a member"):
                hvd.allreduce(torch.ones(1), process_set=ps)
    finally:
        hvd.remove_process_set(ps)


def test_join_refuses_other_collectives_alike():
    """While a rank has joined, an allgather is refused on every active rank (as Horovod does),
    the ranks stay in step, and the rest can join afterwards."""
    from stella_mpi.base.errors import CollectiveRefused
    if hvd.size() < 2:
        pytest.skip("needs a rank that joins and one that does not")
    if hvd.rank() == 0:
        last = hvd.join()
    else:
        with pytest.raises(CollectiveRefused, match="joined"):
            hvd.allgather(torch.ones(2, 1), name="refused.while.joined")
        last = hvd.join()
    assert 1 <= last < hvd.size()
    everyone = hvd.allgather(torch.tensor([last]))
    assert everyone.eq(last).all()


def _listening(port):
    """Local addresses (hex, as in /proc/net/tcp*) of the sockets listening on ``port``."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            addr, hexport = fields[1].split(":")
            if int(hexport, 16) == port and fields[3] == "0A":
                out.append(addr)
    return out


def test_the_gloo_store_listens_on_one_address_only():
    intra = hvd.global_process_set.intra
    if intra.name != "gloo" or hvd.cluster_rank() != 0:
        pytest.skip("this rank leads no gloo group")
    port = intra.store.port
    addrs = _listening(port)
    assert addrs, "nothing listens on the store's port %d" % port
    wildcard = {"00000000", "00000000000000000000000000000000"}
    assert not set(addrs) & wildcard, "the gloo store listens on every address: %s" % addrs
