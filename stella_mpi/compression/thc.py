"""THC-style homomorphic quantization of the cross-cluster hop (the computation; the MPI step
is :mod:`stella_mpi.comm.thc_exchange`).

Every cluster quantizes its shard with scales agreed by all clusters, one per block of
2**block_log2 entries (the largest |entry| of the block over every cluster, after an optional
randomized Hadamard rotation of the same blocks), rounding to ``bits`` bits, and
packs the levels into integer lanes wide enough to hold the sum over every cluster. The lanes
of all clusters are then summed as plain 64-bit integers along MPI's reduce-scatter/all-gather:
no cluster decodes and re-encodes at a hop. The bytes each rank sends grow only with the
allreduce's 2 (C-1)/C and by one lane bit per doubling of the clusters C (the sparse
all-gather's grow with C - 1; bench/bench_thc_bytes.py). With error
feedback, what rounding left out (acc minus what was sent, rotated back) is added to the next
step's shard, as on the sparse route.

Three calls, in order, per shard: :meth:`THCCompressor.begin` (error feedback, rotation, the
local largest |entry| of each block), :meth:`THCCompressor.quantize` (with the agreed scales: the words to
sum), :meth:`THCCompressor.finish` (the summed words decoded, validated, rotated back; the
residual updated). The kernels are c_src/thc.c (numpy references in tests/unit). A shard on a
GPU (or any shard under ``STELLA_DEVICE_PATH=torch``) runs the same three calls in torch
operations on its device (:mod:`.device_thc`, the C kernels' bits): only the block maxima and
the integer lanes cross PCIe."""
from dataclasses import dataclass

import numpy as np
import torch

from .._native import compress as sparse_kernels
from .._native import thc as kernels
from ..base.devices import on_device_route
from . import device_thc
from .contracts import Compressor, TensorContext

__all__ = ["THCCompressor", "THCWork"]

_RANK_SALT = 0x7468632D726F756E   # keeps each rank's rounding draws apart from every other's


@dataclass
class THCWork:
    """One shard between the three calls: acc (shard + residual, in the shard's own memory),
    the rotated copy that becomes what this rank sent, and the local largest |entry| of each
    scale block (float32 numpy). ``on_device``: the calls run in torch operations
    (:mod:`.device_thc`) on acc's device, and the words are int64 tensors there."""
    ctx: TensorContext
    acc: torch.Tensor
    rotated: torch.Tensor
    absmax: np.ndarray
    nonfinite: int
    on_device: bool = False


class THCCompressor(Compressor):
    """``hvd.Compression.thc(bits=4)``: homomorphic quantization on the cross-cluster hop.

    bits: 2 to 8 (levels q in [-L, L], L = 2**(bits-1) - 1; 2 bits send -1, 0 or +1 times the
    scale). One scale per block of 2**block_log2 entries, agreed by every cluster: a fused
    bucket holds tensors of very different magnitudes, and under one scale for the whole bucket
    the small ones rounded to zero step after step (Adam on a 6.8M byte-level LM then diverged,
    loss 5.5 to 33 in 12 steps; with a scale per 1024 entries it trains; the scales cost 4 bytes
    per block on the WAN, under 1 % at 4 bits). rotation: a randomized Hadamard rotation of the
    same blocks before quantizing (spreads outliers; the same signs on every rank and step). error_feedback: keep
    what rounding left out and add it to the next step's shard. rounding: "stochastic"
    (unbiased: E[sent] = acc) or "nearest"; by default nearest with error feedback and
    stochastic without. Measured (2 clusters, 4096 entries, constant input, 40 steps): with
    error feedback nearest rounding had the lower error at 2, 4 and 8 bits, and at 2 bits
    stochastic rounding let the scale grow 8x (a rounding error up to one whole step, fed back,
    raises the next step's largest |entry|) where nearest kept it at the input's.

    Like the sparse compressors it works only across clusters, on float32 sums or averages,
    with a residual per tensor name; unlike them it sends every entry (no density to tune)."""
    name = "thc"
    sparse = True        # takes the compressed WAN route of hvd.allreduce and DistributedOptimizer
    homomorphic = True   # its words are summed on the wire (comm/thc_exchange.py), never decoded at a hop

    def __init__(self, bits=4, rotation=True, block_log2=10, error_feedback=True, rounding=None):
        if not isinstance(bits, int) or isinstance(bits, bool) or not kernels.MIN_BITS <= bits <= kernels.MAX_BITS:
            raise ValueError("Compression.thc: bits must be an integer in [%d, %d], got %r"
                             % (kernels.MIN_BITS, kernels.MAX_BITS, bits))
        if not isinstance(block_log2, int) or isinstance(block_log2, bool) or not 1 <= block_log2 <= kernels.MAX_BLOCK_LOG2:
            raise ValueError("Compression.thc: block_log2 must be an integer in [1, %d], got %r"
                             % (kernels.MAX_BLOCK_LOG2, block_log2))
        if rounding is None:
            rounding = "nearest" if error_feedback else "stochastic"
        if rounding not in ("stochastic", "nearest"):
            raise ValueError("Compression.thc: rounding must be 'stochastic' or 'nearest', got %r" % (rounding,))
        self.bits = bits
        self.rotation = bool(rotation)
        self.block_log2 = block_log2
        self.error_feedback = bool(error_feedback)
        self.rounding = rounding

    def __repr__(self):
        return "THCCompressor(bits=%d, rotation=%s, block_log2=%d, error_feedback=%s, rounding=%r)" % (
            self.bits, self.rotation, self.block_log2, self.error_feedback, self.rounding)

    def settings(self):
        return (self.name, self.bits, self.rotation, self.block_log2, self.error_feedback, self.rounding)

    @classmethod
    def from_settings(cls, settings):
        name, bits, rotation, block_log2, error_feedback, rounding = settings
        return cls(bits=bits, rotation=rotation, block_log2=block_log2, error_feedback=error_feedback,
                   rounding=rounding)

    def compress(self, tensor):
        raise TypeError("thc works on the cross-cluster hop only (hvd.allreduce with a name, or DistributedOptimizer)")

    def decompress(self, tensor, ctx):
        raise TypeError("thc works on the cross-cluster hop only (hvd.allreduce with a name, or DistributedOptimizer)")

    def levels(self):
        return kernels.levels(self.bits)

    def lane_bits(self, nclusters):
        return kernels.lane_bits(self.bits, nclusters)

    def _rotation_key(self, ctx):
        return sparse_kernels.randomk_key(ctx.seed, ctx.name + "#thc-rotation", 0)

    def _rounding_key(self, ctx, rank):
        return sparse_kernels.randomk_key(ctx.seed ^ (_RANK_SALT * (rank + 1)), ctx.name + "#thc-rounding", ctx.step)

    def begin(self, flat, ctx, memory=None, scratch=None):
        """acc = flat + residual (in place in ``flat``, a contiguous float32 vector); its rotated
        copy and the largest finite |entry| of each block (NaN/Inf counted, not measured). A CUDA
        vector (or any under ``STELLA_DEVICE_PATH=torch``) stays on its device, residual included.
        ``scratch``: a float32 vector of flat's size and device to hold the rotated copy until
        :meth:`finish` (the caller's, reused from call to call: a fresh one costs its page faults)."""
        if flat.dtype != torch.float32 or not flat.is_contiguous() or flat.device.type not in ("cpu", "cuda"):
            raise ValueError("THCCompressor.begin takes a contiguous float32 vector on the CPU or a GPU, got %s on %s"
                             % (flat.dtype, flat.device))
        flat = flat.view(-1)
        on_device = on_device_route(flat)
        if memory is not None:
            res = memory.residual(ctx.name, flat.numel(), flat.device)
            flat.add_(res)
        if scratch is not None:
            if scratch.numel() != flat.numel() or scratch.device != flat.device or scratch.dtype != torch.float32:
                raise ValueError("THCCompressor.begin: the scratch vector (%d %s on %s) does not match the shard "
                                 "(%d float32 on %s)" % (scratch.numel(), scratch.dtype, scratch.device, flat.numel(),
                                                         flat.device))
            rotated = scratch.view(-1).copy_(flat)
        else:
            rotated = flat.clone()
        if on_device:
            if self.rotation:
                device_thc.rotate(rotated, self.block_log2, self._rotation_key(ctx))
            absmax, nonfinite = device_thc.block_absmax(rotated, self.block_log2)
            # the maxima (4 bytes per block) and the count cross to the host: the scale round is MPI's
            return THCWork(ctx, flat, rotated, absmax.cpu().numpy(), int(nonfinite), True)
        if self.rotation:
            kernels.rotate(rotated, self.block_log2, self._rotation_key(ctx))
        absmax, nonfinite = kernels.block_absmax(rotated, self.block_log2)
        return THCWork(ctx, flat, rotated, absmax, nonfinite)

    def quantize(self, work, scales, nclusters, rank):
        """The words this rank adds (uint64 numpy; on the device route an int64 tensor on the
        shard's device, the same bits), with the agreed ``scales`` (one per block);
        ``work.rotated`` becomes what it sent."""
        if work.on_device:
            return device_thc.quantize(work.rotated, self.bits, torch.from_numpy(scales).to(work.acc.device),
                                       self._rounding_key(work.ctx, rank), self.lane_bits(nclusters),
                                       stochastic=self.rounding == "stochastic", scale_log2=self.block_log2)
        return kernels.quantize(work.rotated, self.bits, scales, self._rounding_key(work.ctx, rank),
                                self.lane_bits(nclusters), stochastic=self.rounding == "stochastic",
                                scale_log2=self.block_log2)

    def finish(self, work, words, nclusters, scales, memory=None):
        """The sum over clusters, decoded from the summed ``words`` into ``work.acc``'s memory
        (MalformedPayloadError when a lane is out of range), rotated back; the residual becomes
        acc minus what this rank sent. On the device route ``words`` may be a host array or
        tensor: unpack_sum copies it to the device (the lanes are all that cross PCIe)."""
        n = work.acc.numel()
        sent = work.rotated
        dev = work.on_device
        rot = device_thc.rotate if dev else kernels.rotate
        if self.rotation:
            rot(sent, self.block_log2, self._rotation_key(work.ctx), inverse=True)
        if memory is not None:
            torch.sub(work.acc, sent, out=memory.residual(work.ctx.name, n, work.acc.device))
        if dev:
            if isinstance(words, np.ndarray):
                words = torch.from_numpy(words.view(np.int64))
            out = device_thc.unpack_sum(words, n, self.bits, nclusters,
                                        self.lane_bits(nclusters), torch.from_numpy(np.ascontiguousarray(scales)),
                                        work.acc, scale_log2=self.block_log2)
        else:
            out = kernels.unpack_sum(words, n, self.bits, nclusters, self.lane_bits(nclusters), scales,
                                     out=work.acc, scale_log2=self.block_log2)
        if self.rotation:
            rot(out, self.block_log2, self._rotation_key(work.ctx), inverse=True)
        return out

    def skip_nonfinite(self, work, memory=None):
        """A NaN or Inf in some cluster's rotated values (an overflow: the executor refuses
        non-finite inputs before THC runs): nothing was sent and every rank refuses the step, so,
        as on the sparse route, no residual keeps this step's values: the residual stays what it
        was (any non-finite entry zeroed, so none stays there forever)."""
        if memory is not None:
            res = memory.residual(work.ctx.name, work.acc.numel(), work.acc.device)
            torch.where(torch.isfinite(res), res, torch.zeros_like(res), out=res)
