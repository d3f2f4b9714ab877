"""DeMo's compressor: the tensor is cut into chunks of ``chunk`` entries, each taken to the
DCT-II domain (orthonormal), and SparseLoCo's selection runs on the coefficients: top-k per
chunk, values quantised to ``bits`` (or sent as float32 with ``bits=None``), error feedback in
the coefficient domain. The receiver sums the coefficients (the transform is linear) and takes
the inverse; the exchange calls :meth:`DCTCompressor.from_coefficients` after the sum.

Gradients and pseudo-gradients are smooth along a parameter's rows, so a few low-frequency
coefficients hold much of a chunk's energy (DeMo, Peng et al. 2024). A short tail (``numel %
chunk`` entries) is left untransformed. The transforms are one matrix product per chunk size
(chunks of 16 to 1024 entries); the inverse runs in float64 and is rounded to float32, so
every rank turns the same coefficients into the same bits (whatever its BLAS).

A CUDA tensor is transformed, selected and quantised on its device, its residual there (as
SparseLoCo's, :mod:`.device_chunked`); only the selection is copied to the host. There the
forward runs in float64 too, so a script's ``allow_tf32`` never rounds the coefficients to 10
bits (an error outside the error feedback's reach); on the host it is a float32 product."""
import math

import torch

from .sparseloco import SparseLoCoCompressor

DCT_CHUNK_MAX = 1024
_BASES = {}
_ROWS = 1 << 22   # entries per float64 slice of the device transform (32 MiB)


def dct_basis(chunk, dtype=torch.float32, device="cpu"):
    """The orthonormal DCT-II matrix D (chunk x chunk): coefficients = D @ x, x = D.T @ coefficients
    (one copy per chunk, dtype and device)."""
    device = torch.device(device)
    key = (chunk, dtype, device)
    if key not in _BASES:
        i = torch.arange(chunk, dtype=torch.float64)
        d = torch.cos(math.pi * (i[None, :] + 0.5) * i[:, None] / chunk) * math.sqrt(2.0 / chunk)
        d[0] /= math.sqrt(2.0)
        _BASES[key] = d.to(device, dtype)
    return _BASES[key]


def _in_float64(flat):
    """Whether the forward transform of ``flat`` is the float64 product (a CUDA tensor)."""
    return flat.device.type == "cuda"


def forward(flat, chunk):
    """The DCT-II of every full chunk of ``flat`` (1-D float32); the tail as it is. On the host a
    float32 product; elsewhere (CUDA) a float64 one rounded to float32, whatever allow_tf32 says."""
    full = flat.numel() // chunk * chunk
    out = torch.empty_like(flat)
    if full:
        rows = flat[:full].view(-1, chunk)
        if not _in_float64(flat):
            torch.matmul(rows, dct_basis(chunk, flat.dtype).t(), out=out[:full].view(-1, chunk))
        else:   # in slices, so the float64 copy stays small whatever the tensor
            basis, dst, step = dct_basis(chunk, torch.float64, flat.device).t(), out[:full].view(-1, chunk), max(1, _ROWS // chunk)
            for r in range(0, rows.shape[0], step):
                dst[r:r + step].copy_(rows[r:r + step].to(torch.float64) @ basis)
    out[full:] = flat[full:]
    return out


def inverse_(flat, chunk):
    """``flat`` (coefficients, 1-D float32) back to the entries' domain, in place (a float64
    product, in slices of ``_ROWS`` entries)."""
    full = flat.numel() // chunk * chunk
    if full:
        rows, basis, step = flat[:full].view(-1, chunk), dct_basis(chunk, torch.float64, flat.device), max(1, _ROWS // chunk)
        for r in range(0, rows.shape[0], step):
            rows[r:r + step].copy_(rows[r:r + step].to(torch.float64) @ basis)
    return flat


class DCTCompressor(SparseLoCoCompressor):
    """Top-k of each chunk's DCT-II coefficients (the module's documentation). ``density``:
    the coefficients sent per chunk, ``max(1, round(density * chunk))``; ``bits``: 2, 4, 8 or
    None (float32 values)."""
    name = "dct"
    float_values = True
    chunk_max = DCT_CHUNK_MAX

    def __init__(self, density=1.0 / 32, chunk=64, bits=4, feedback_decay=1.0, error_feedback=True,
                 momentum_correction=False, warmup=0, value_dtype="float32"):
        super().__init__(density=density, chunk=chunk, bits=bits, feedback_decay=feedback_decay,
                         error_feedback=error_feedback, momentum_correction=momentum_correction, warmup=warmup,
                         value_dtype=value_dtype)

    def _domain(self, flat):
        return forward(flat, self.chunk)

    def from_coefficients(self, piece):
        """The exchange's sum of coefficients (1-D float32, in place) back to the entries."""
        return inverse_(piece, self.chunk)
