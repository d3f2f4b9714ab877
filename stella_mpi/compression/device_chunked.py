"""SparseLoCo's chunked top-k and per-chunk quantiser (c_src/chunked.c) in torch operations, for
pseudo-gradients that live on a GPU.

On the host, a CUDA shard of several million entries had to cross PCIe whole and be selected
by one CPU core: 6.8 M entries cost about 70 ms of selection per exchange, which set the pace of
local steps on an H100 (bench/results/gpu_31_h100.json). Here the selection and the quantiser run
where the shard is, and only the selected entries, their codes and the chunks' scales cross.

The functions follow the C kernels bit for bit, and are checked against them on CPU tensors
over many sizes and edges (tests/unit/test_device_chunked.py):

* per chunk of ``chunk`` entries, the ``k`` largest magnitudes of ``acc = grad + residual``
  (fewer in a short tail chunk, :func:`stella_mpi._native.chunked.topk_count`), in the C
  kernels' magnitude order (``device_select.magnitude_keys``: NaN above +Inf, ties to the lower
  index); the residual becomes ``acc`` with the sent entries set to +0.0;
* per chunk, ``lo``/``hi`` the smallest/largest selected finite magnitude, the step
  ``(hi - lo) / (levels - 1)`` (stepped down while the top level would overflow), a value's
  level ``floor((|v| - lo) / step + 0.5)`` clamped to the grid, its value ``lo + step * j``
  with the sign of ``v``; every operation one float32 rounding, as the C kernels are built
  with ``-ffp-contract=off``. Divisions are tensor by tensor: CUDA divides by a host scalar
  through its reciprocal, which would round differently;
* a chunk holding a NaN or an infinity sends NaN values and a NaN scale (the receiver's
  checks refuse it, naming the sender), and its residual is left as the selection left it.
"""
import torch

from .._native import chunked as kernels
from .device_select import _LOW32, _accumulate, _take, _top_units, magnitude_keys

_SLICE = 1 << 22   # entries whose keys are taken at once (the temporaries: about 32 MiB each)


def chunk_topk(flat, chunk, k, residual=None):
    """(int32 indices ascending, float32 values) on ``flat``'s device: ``stella_chunk_topk_f32``."""
    acc = _accumulate(flat, residual)
    n = acc.numel()
    dev = acc.device
    if n == 0:
        return torch.empty(0, dtype=torch.int32, device=dev), torch.empty(0, dtype=torch.float32, device=dev)
    full = n // chunk
    parts = []
    if full:
        if k >= chunk:
            parts.append(torch.arange(full * chunk, device=dev))
        else:   # in slices of whole chunks: the int64 keys and orders are 8 bytes an entry each
            rows = max(1, _SLICE // chunk)
            low = _LOW32 - torch.arange(chunk, device=dev, dtype=torch.int64)
            for r in range(0, full, rows):
                m = min(rows, full - r)
                order = (magnitude_keys(acc[r * chunk:(r + m) * chunk]).view(m, chunk) << 32) | low
                top = torch.sort(torch.topk(order, k, dim=1, sorted=False).indices, dim=1).values
                del order
                parts.append((top + torch.arange(r, r + m, device=dev, dtype=torch.int64)[:, None] * chunk).reshape(-1))
    if n > full * chunk:
        tail = n - full * chunk
        parts.append(_top_units(magnitude_keys(acc[full * chunk:]), kernels.topk_count(tail, chunk, k)) + full * chunk)
    return _take(acc, parts[0] if len(parts) == 1 else torch.cat(parts), residual)


def _grid_step(lo, hi, levels):
    """``grid_step`` of c_src/chunked.c per chunk: the largest step <= (hi - lo) / (levels - 1)
    whose top level is finite (0 where hi <= lo)."""
    top = torch.full_like(lo, float(levels - 1))   # (levels >= 2: bits are 2, 4 or 8)
    step = torch.where(hi > lo, (hi - lo) / top, torch.zeros_like(lo))   # (no selection: lo = inf, hi = 0)
    over = (step > 0) & ~torch.isfinite(lo + step * top)
    while bool(over.any()):   # only where hi - lo is near the float32 range: a few ulps down
        step = torch.where(over, torch.nextafter(step, torch.zeros_like(step)), step)
        over = (step > 0) & ~torch.isfinite(lo + step * top)
    return step


def quantize(idx, val, n, chunk, bits, residual=None):
    """Quantise the selected values in place and return the chunks' scales (float32, ``lo, step``
    per chunk) on their device: ``stella_chunk_quantize_f32``. With ``residual``, each finite
    value's rounding error is added at its index."""
    levels = 1 << (int(bits) - 1)
    nch = (int(n) + chunk - 1) // chunk
    dev = val.device
    scales = torch.zeros(2 * nch, dtype=torch.float32, device=dev)
    if idx.numel() == 0:
        return scales
    c = idx.long() // chunk
    mag = val.abs()
    finite = torch.isfinite(val)
    inf = torch.full((nch,), float("inf"), device=dev)
    lo = inf.scatter_reduce(0, c, torch.where(finite, mag, inf[:1].expand_as(mag)), "amin")
    hi = torch.zeros(nch, device=dev).scatter_reduce(0, c, torch.where(finite, mag, torch.zeros_like(mag)), "amax")
    has = torch.zeros(nch, dtype=torch.bool, device=dev).index_fill_(0, c, True)
    bad = torch.zeros(nch, dtype=torch.bool, device=dev).index_fill_(0, c[~finite], True)
    step = _grid_step(lo, hi, levels)
    lo_e, step_e = lo[c], step[c]
    q = torch.floor((mag - lo_e) / step_e + 0.5)
    q = torch.where((step_e > 0) & (q > 0), torch.clamp(q, max=float(levels - 1)), torch.zeros_like(q))
    m = lo_e + step_e * q
    out = torch.where(torch.signbit(val), -m, m)
    bad_e = bad[c]
    if residual is not None:
        ok = ~bad_e
        at = idx[ok].long()
        residual[at] = residual[at] + (val[ok] - out[ok])
    val.copy_(torch.where(bad_e, torch.full_like(out, float("nan")), out))
    nan = torch.full_like(lo, float("nan"))
    scales[0::2] = torch.where(has, torch.where(bad, nan, lo), torch.zeros_like(lo))
    scales[1::2] = torch.where(has & ~bad, step, torch.zeros_like(step))
    return scales
