"""The device route against the host route, bit for bit, on the same data.

With CUDA (the ``gpu`` runs: tests/test_gpu.py), the device side holds CUDA tensors: reduction
inside the cluster on the device (NCCL or staged), selection with error feedback on the GPU,
the CPU engine with a CUDA model. Without CUDA, the device side is the same code on CPU tensors
(``STELLA_DEVICE_PATH=torch``: torch-op selection and device-side scatter instead of the C
kernels). Either way the results must equal the C path's bits: the algorithms are deterministic.
"""
import pytest
import torch

import stella_mpi as hvd
from reference import rank_input
from stella_mpi.compression import Memory

CUDA = torch.cuda.is_available()


def _device():
    # called inside tests: hvd.init() runs in the session fixture, after this module is imported
    return torch.device("cuda", hvd.local_rank() % torch.cuda.device_count()) if CUDA else torch.device("cpu")


@pytest.fixture
def device_route(monkeypatch):
    """A function running its argument on the device side (CUDA, or the forced torch path)."""
    def run(fn):
        if not CUDA:
            monkeypatch.setenv("STELLA_DEVICE_PATH", "torch")
        try:
            return fn(_device())
        finally:
            monkeypatch.delenv("STELLA_DEVICE_PATH", raising=False)
    return run


def _bits(t):
    t = t.detach().cpu().contiguous()
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16) if t.element_size() == 2 else t


def _same(a, b, what):
    assert a.shape == b.shape and a.dtype == b.dtype, what
    assert torch.equal(_bits(a), _bits(b)), "%s: the device route differs from the host route" % what


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int32, torch.float64])
def test_dense_allreduce(device_route, dtype):
    xs = [rank_input(hvd.rank(), shape, dtype, seed=5 + i) for i, shape in enumerate([(1000,), (33, 7), (1,)])]
    host = hvd.grouped_allreduce(xs, op=hvd.Sum, name="dev.dense.%s" % dtype)
    dev = device_route(lambda d: hvd.grouped_allreduce([x.to(d) for x in xs], op=hvd.Sum,
                                                       name="dev.dense.%s" % dtype))
    for i, (h, g) in enumerate(zip(host, dev)):
        assert g.device.type == _device().type
        _same(h, g, "grouped allreduce, tensor %d" % i)
    avg_h = hvd.allreduce(xs[0], name="dev.avg")
    avg_d = device_route(lambda d: hvd.allreduce(xs[0].to(d), name="dev.avg"))
    _same(avg_h, avg_d, "average")


def _compressed_host_vs_device(device_route, comp, tag, sizes, seed, residual_device):
    """Three steps of a compressed allreduce with error feedback, host route against device
    route: results and residuals bit for bit (residuals on ``residual_device``)."""
    mem_h, mem_d = Memory(), Memory()
    for step in range(3):
        xs = [rank_input(hvd.rank(), (n,), torch.float32, seed=seed * step + n) for n in sizes]
        host = hvd.synchronize(hvd.compressed_allreduce_async(xs, comp, tag, memory=mem_h, step=step))
        dev = device_route(lambda d: hvd.synchronize(hvd.compressed_allreduce_async(
            [x.to(d) for x in xs], comp, tag, memory=mem_d, step=step)))
        for i, (h, g) in enumerate(zip(host, dev)):
            assert g.device.type == _device().type
            _same(h, g, "%s step %d tensor %d" % (tag, step, i))
        assert mem_h.names() == mem_d.names()
        for key in mem_h.names():
            assert mem_d.get(key).device.type == residual_device
            _same(mem_h.get(key), mem_d.get(key), "residual %s" % key)


@pytest.mark.parametrize("name", ["topk", "cacheaware", "randomk"])
@pytest.mark.parametrize("value_dtype", ["float32", "float16"])
def test_sparse_allreduce_with_error_feedback(device_route, name, value_dtype):
    comp = getattr(hvd.Compression, name)(density=0.02, value_dtype=value_dtype)
    _compressed_host_vs_device(device_route, comp, "dev.sparse.%s.%s" % (name, value_dtype), (40000, 777), 11,
                               _device().type)


@pytest.mark.parametrize("bits,error_feedback", [(2, True), (4, True), (4, False)])
def test_thc_allreduce_with_error_feedback(device_route, bits, error_feedback):
    """Compression.thc on device tensors: rotation, quantization and decoding run in torch
    operations on the device (only the block maxima and the lanes cross to the host for the
    WAN); results and residuals (kept on the device) equal the host route's bits."""
    # without error feedback THC rounds stochastically: the draws must match too
    _compressed_host_vs_device(device_route, hvd.Compression.thc(bits=bits, error_feedback=error_feedback),
                               "dev.thc.%d.%s" % (bits, error_feedback),
                               (5000, 77, 3 * 1024), 13, _device().type)


def _same_runs(host, dev, what):
    """Two runs' per-step lists of tensors, equal bit for bit."""
    assert len(host) == len(dev)
    for step, (hs, ds) in enumerate(zip(host, dev)):
        for i, (h, g) in enumerate(zip(hs, ds)):
            _same(h, g, "%s %d parameter %d" % (what, step, i))


def _wide_model(device):
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Tanh(), torch.nn.Linear(300, 10)).to(device)


def _set_grads(model, step):
    for i, p in enumerate(model.parameters()):
        p.grad = rank_input(hvd.rank(), tuple(p.shape), torch.float32, seed=97 * step + i).to(p.device)


@pytest.mark.parametrize("compression", ["cacheaware", "none"])
def test_distributed_optimizer_reduced_gradients(device_route, compression):
    """Horovod's optimizer on a model on the device: the averaged gradients it hands to the
    user's optimizer equal the host route's (sparse: with error feedback over the steps)."""
    def train(device):
        model = _wide_model(device)
        comp = hvd.Compression.none if compression == "none" else hvd.Compression.cacheaware(density=0.01)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), compression=comp)
        seen = []
        for step in range(3):
            _set_grads(model, step)
            opt.synchronize()
            seen.append([p.grad.detach().cpu().clone() for p in model.parameters()])
            with opt.skip_synchronize():
                opt.step()
        return seen
    _same_runs(train(torch.device("cpu")), device_route(train), "step")


PSEUDO = {   # the pseudo-gradient's compression and the outer step it is meant for
    "sparseloco": (lambda: hvd.Compression.sparseloco(density=0.02, chunk=256, bits=2, feedback_decay=0.95), "sum"),
    "dct": (lambda: hvd.Compression.dct(density=0.125, chunk=32, bits=4), "average"),
    "thc4": (lambda: hvd.Compression.thc(bits=4), "average"),
    "none": (lambda: hvd.Compression.none, "average"),
}


@pytest.mark.parametrize("fragments", [1, 2])
@pytest.mark.parametrize("pseudo", sorted(PSEUDO))
def test_local_steps_on_the_device(device_route, pseudo, fragments):
    """Local steps with the model on the device: every rank holds the same bits after each
    exchange, and the parameters follow the host route's (THC: agreement only). Plain SGD at
    lr 1 and the outer sum (lr 2) or average round the same on both sides, so the
    pseudo-gradient's selection and quantisation see the same numbers; the DCT's inverse is a
    matrix product, so it is compared within a tolerance."""
    comp, outer = PSEUDO[pseudo]

    def train(device):
        model = _wide_model(device)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                       named_parameters=model.named_parameters(),
                                       local_steps=hvd.LocalSteps(every=2, fragments=fragments, outer=outer,
                                                                  compression=comp()))
        seen = []
        for step in range(6):
            opt.zero_grad()
            _set_grads(model, step)
            opt.step()
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            if fragments == 1 and step % 2 == 1:   # an exchange landed: the clusters agree bit for bit
                everyone = hvd.allgather(flat.unsqueeze(0), name="dev.local.%s.%d" % (pseudo, step))
                assert all(torch.equal(everyone[r], flat) for r in range(hvd.size())), \
                    "%s: rank %d's parameters differ after exchange %d" % (device, hvd.rank(), step // 2)
            seen.append([p.detach().cpu().clone() for p in model.parameters()])
        opt.sync_clusters()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        everyone = hvd.allgather(flat.unsqueeze(0), name="dev.local.%s.%d.end" % (pseudo, fragments))
        assert all(torch.equal(everyone[r], flat) for r in range(hvd.size())), device
        assert bool(torch.isfinite(flat).all())
        seen.append([p.detach().cpu().clone() for p in model.parameters()])
        return seen
    host, dev = train(torch.device("cpu")), device_route(train)
    if pseudo == "thc4":   # its rotation is keyed by the exchange's name, which each optimizer has its own of
        return             # (test_thc_allreduce_with_error_feedback compares the routes under one name)
    if pseudo == "dct" and CUDA:
        # the forward transform is a float64 product on CUDA, a float32 one on the host: a
        # coefficient one bit apart may round to the next of the 16 levels, one level of its
        # chunk's range (up to its largest coefficient, over 15) in one of its entries
        for step, (hs, ds) in enumerate(zip(host, dev)):
            for i, (h, g) in enumerate(zip(hs, ds)):
                off = float((g - h).norm() / h.norm().clamp_min(1e-12))
                assert off < 1e-3, "step %d parameter %d: the device run is %.2g off the host's" % (step, i, off)
    elif pseudo == "dct":
        for step, (hs, ds) in enumerate(zip(host, dev)):
            for i, (h, g) in enumerate(zip(hs, ds)):
                torch.testing.assert_close(g, h, rtol=1e-5, atol=1e-5, msg="step %d parameter %d" % (step, i))
    else:
        _same_runs(host, dev, "local step")


def _skip_uneven():
    if not hvd.global_process_set.topology.uniform_clusters:
        pytest.skip("engine='cpu' needs clusters of equal size")


@pytest.mark.parametrize("staleness", [0, 1])
def test_cpu_engine_model_on_the_device(device_route, staleness):
    """The CPU engine with the model on the device: the parameters each forward sees equal the
    host model's, step by step (the C optimizer runs on the CPU master in both cases)."""
    _skip_uneven()

    def train(device):
        model = _wide_model(device)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                       named_parameters=model.named_parameters(),
                                       engine=hvd.CpuEngine(staleness=staleness, warmup=0, model=model),
                                       compression=hvd.Compression.cacheaware(density=0.05))
        seen = []
        x = torch.ones(2, 64, device=device)
        for step in range(5):
            model(x)   # the pre-hooks put the required updates in
            seen.append([p.detach().cpu().clone() for p in model.parameters()])
            _set_grads(model, step)
            opt.step()
        opt.drain()
        seen.append([p.detach().cpu().clone() for p in model.parameters()])
        return seen
    _same_runs(train(torch.device("cpu")), device_route(train), "forward")


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_and_cpu_tensors_mixed_across_ranks_are_refused():
    x = torch.ones(10, device=_device()) if hvd.rank() == 0 else torch.ones(10)
    with pytest.raises(hvd.TensorMismatchError, match="cuda"):
        hvd.allreduce(x, name="dev.mixed")
    # the ranks are still in step
    assert hvd.allreduce(torch.ones(3), op=hvd.Sum, name="dev.after").tolist() == [hvd.size()] * 3


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cpu_engine_refuses_parameters_on_two_devices():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[1].to(_device())
    with pytest.raises(ValueError, match="is on"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=model.named_parameters(), engine=hvd.CpuEngine())
