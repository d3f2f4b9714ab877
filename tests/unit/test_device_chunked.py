"""SparseLoCo's selection and quantiser in torch operations (compression/device_chunked.py, what a
CUDA pseudo-gradient runs) against the C kernels (c_src/chunked.c), bit for bit, on CPU tensors:
the same indices, values, scales and residuals over many sizes and edges. With CUDA, the same
comparison runs once more with the torch side on the GPU."""
import numpy as np
import pytest
import torch

from stella_mpi._native import chunked as C
from stella_mpi.compression import Memory, Selection, TensorContext
from stella_mpi.compression import device_chunked as D
from stella_mpi.compression.dct import DCTCompressor, forward
from stella_mpi.compression.sparseloco import SparseLoCoCompressor

from test_chunked_kernels import SETTINGS, SIZES, _data

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _bits(t):
    return t.detach().cpu().contiguous().view(torch.int32)


def _same(a, b, what):
    assert a.shape == b.shape and torch.equal(_bits(a), _bits(b)), what


def _run_both(g, r, chunk, k, bits, device):
    """(C's, torch's) (indices, values, scales, residual) of one selection and quantisation."""
    out = []
    for ops, dev in ((C, "cpu"), (D, device)):
        res = None if r is None else torch.from_numpy(r.copy()).to(dev)
        idx, val = ops.chunk_topk(torch.from_numpy(g).to(dev), chunk, k, res)
        scales = ops.quantize(idx, val, len(g), chunk, bits, res) if bits else None
        out.append((idx, val, scales, res))
    return out


def _check(c, t, what):
    (ic, vc, sc, rc), (it, vt, st, rt) = c, t
    assert it.dtype == torch.int32 and torch.equal(ic, it.cpu()), what + ": indices"
    _same(vc, vt, what + ": values")
    if sc is not None:
        _same(sc, st, what + ": scales")
    if rc is not None:
        _same(rc, rt, what + ": residual")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("chunk,k", SETTINGS)
def test_selection_and_quantisation_match_c(n, chunk, k, device):
    g = _data(n, n + k)
    r = (_data(n, n + 1) * 0.3).astype(np.float32)
    for bits in (None, 2, 4, 8):
        _check(*_run_both(g, r, chunk, k, bits, device), "n=%d chunk=%d k=%d bits=%s" % (n, chunk, k, bits))
    _check(*_run_both(g, None, chunk, k, 2, device), "n=%d chunk=%d k=%d, no residual" % (n, chunk, k))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["nonfinite", "ties", "zeros", "huge"])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_edges_match_c(kind, bits, device):
    """NaN and infinities (a chunk holding one sends NaN values and a NaN scale), many equal
    magnitudes (ties to the lower index), all zeros, magnitudes near the float32 range (the
    step is taken down until the top level is finite), signed zeros."""
    for n, chunk, k in ((20_011, 64, 3), (4099, 16, 16), (5, 4096, 41)):
        g = _data(n, 7, kind)
        if kind == "zeros":
            g[::3] = -0.0
        r = np.zeros(n, np.float32)
        _check(*_run_both(g, r, chunk, k, bits, device), "%s n=%d chunk=%d k=%d bits=%d" % (kind, n, chunk, k, bits))


def test_the_step_is_taken_down_where_the_top_level_would_overflow():
    n, chunk = 64, 64
    g = np.zeros(n, np.float32)
    top = np.finfo(np.float32).max   # at 8 bits, (top - 1) / 127 * 127 rounds above it
    g[:4] = [top, np.float32(1.0), np.float32(-3.3e38), np.float32(2e38)]
    c, t = _run_both(g, None, chunk, 4, 8, "cpu")
    _check(c, t, "near the float32 range")
    lo, step = np.float32(t[2][0]), np.float32(t[2][1])
    assert step < (top - lo) / np.float32(127)   # taken down
    assert np.isfinite(lo + step * np.float32(127))


def _both_routes(comp, name, xs, device, monkeypatch):
    """Per step, ``comp``'s select of ``xs[step]`` on the host and on the device route (CUDA, or
    torch operations under STELLA_DEVICE_PATH=torch), each with its own error feedback; yields
    (step, x, ctx, host selection, device selection, host memory, device memory), the device's
    selection and residual checked to be on the device."""
    host, dev = Memory(), Memory()
    for step, x in enumerate(xs):
        ctx = TensorContext(name, step, (x.numel(),))
        monkeypatch.delenv("STELLA_DEVICE_PATH", raising=False)
        a = comp.select(x, ctx, host)
        if device == "cpu":
            monkeypatch.setenv("STELLA_DEVICE_PATH", "torch")
        b = comp.select(x.to(device), ctx, dev)
        assert b.values.device.type == device and dev.get(name).device.type == device
        yield step, x, ctx, a, b, host, dev


@pytest.mark.parametrize("device", DEVICES)
def test_the_compressor_selects_on_the_device_route_as_on_the_host(device, monkeypatch):
    """Compression.sparseloco's select over several exchanges (decay 0.95, error feedback): the
    device route (CUDA, or torch operations under STELLA_DEVICE_PATH=torch) gives the host's
    selections and residuals, and keeps the residual where the tensor is."""
    comp = SparseLoCoCompressor(density=0.01, chunk=1024, bits=2, feedback_decay=0.95)
    n = 3 * 1024 + 77
    xs = [torch.from_numpy(_data(n, 50 + step)) for step in range(4)]
    for step, x, ctx, a, b, host, dev in _both_routes(comp, "slc", xs, device, monkeypatch):
        assert torch.equal(a.indices, b.indices.cpu())
        _same(a.values, b.values, "values at step %d" % step)
        _same(a.scales, b.scales, "scales at step %d" % step)
        _same(host.get("slc"), dev.get("slc"), "residual at step %d" % step)
        # a device selection, copied to the host as the exchange does, encodes to the host's payload
        copied = Selection(b.indices.cpu(), b.values.cpu(), n, scales=b.scales.cpu())
        assert torch.equal(comp.encode(a, ctx), comp.encode(copied, ctx))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk,bits", [(64, 4), (32, 2), (128, None)])
def test_the_dct_compressor_selects_on_the_device_route_as_on_the_host(device, chunk, bits, monkeypatch):
    """Compression.dct's select over several exchanges (error feedback in the coefficient
    domain): the device route keeps the transform, the selection and the residual where the
    tensor is. Under STELLA_DEVICE_PATH=torch on the host the transform is the host's float32
    product, so everything matches bit for bit; on CUDA the transform is a float64 product
    rounded to float32, so the coefficients may differ in their last bit: the same entries are
    chosen (a near tie may flip a few) and the values and residuals agree to float32 rounding."""
    comp = DCTCompressor(density=1.0 / 16, chunk=chunk, bits=bits)
    n = 5 * chunk * 7 + 13
    before = torch.zeros(n)
    xs = [torch.from_numpy(_data(n, 70 + step)) * torch.linspace(0.5, 2.0, n) for step in range(4)]
    for step, x, ctx, a, b, host, dev in _both_routes(comp, "dct", xs, device, monkeypatch):
        if device == "cpu":
            assert torch.equal(a.indices, b.indices.cpu())
            _same(a.values, b.values, "values at step %d" % step)
            if bits:
                _same(a.scales, b.scales, "scales at step %d" % step)
            _same(host.get("dct"), dev.get("dct"), "residual at step %d" % step)
        else:   # the same entries, and error feedback's sum: what was sent plus the residual is what was due
            same = np.intersect1d(a.indices.numpy(), b.indices.cpu().numpy()).size
            k = a.indices.numel()   # (a near tie may flip an entry or two)
            assert same >= k - max(2, 0.02 * k), "step %d: %d of %d entries alike" % (step, same, k)
            due = forward(x.double(), chunk).float() + before
            sent = Selection(b.indices.cpu(), b.values.cpu(), n).to_dense()
            torch.testing.assert_close(sent + dev.get("dct").cpu(), due, rtol=1e-5, atol=1e-5 * float(due.abs().max()))
        before = dev.get("dct").cpu().clone()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [0, 1, 255, 256, 257, 3 * 256 + 17, 40 * 256 + 3])
def test_the_selection_in_slices_matches_c(n, device, monkeypatch):
    """The chunks' keys are taken a slice at a time (``_SLICE`` entries of whole chunks, so a large
    shard's int64 temporaries stay small): with slices of 3 chunks, and of part of one (taken as
    one chunk), the same indices, values, scales and residuals as the C kernels."""
    for slice_entries in (3 * 256, 100):
        monkeypatch.setattr(D, "_SLICE", slice_entries)
        g = _data(n, n + 5)
        r = (_data(n, n + 6) * 0.3).astype(np.float32)
        for chunk, k in ((256, 7), (64, 1), (256, 255)):
            _check(*_run_both(g, r, chunk, k, 2, device), "n=%d chunk=%d k=%d slice=%d" % (n, chunk, k, slice_entries))
