"""The compression contracts.

Two kinds of compressor share one registry (:mod:`.registry`):

* dense compressors keep Horovod's contract exactly: ``compress(tensor) ->
  (tensor_compressed, ctx)`` and ``decompress(tensor_compressed, ctx) ->
  tensor``. ``Compression.none``, ``Compression.fp16`` and ``Compression.bf16``
  (:mod:`.dense`) are of this kind; they may be used inside a cluster and across clusters.
* sparse compressors (:class:`SparseCompressor`, ``sparse = True``) select a fraction of a
  flat float32 gradient shard. They are only used on the cross-cluster (WAN) hop, through
  three small contracts: ``select`` (with error feedback), ``encode`` and ``decode``. They
  receive a :class:`TensorContext` that tells them the tensor's name, the step, its shape and
  a seed shared by all ranks. One module per algorithm implements ``_select``.

A new sparse compressor subclasses :class:`SparseCompressor`, implements ``_select`` (and
``_expected_key`` if its payload carries no indices), and is listed in :mod:`.registry`.
"""
import copy
import threading
from dataclasses import dataclass, field
from typing import Optional

import torch

from .._native import compress as kernels
from ..base.devices import on_device_route
from . import device_select

__all__ = ["TensorContext", "Compressor", "Selection", "SparseCompressor"]


@dataclass(frozen=True)
class TensorContext:
    """What a compressor may know about the tensor it compresses."""
    name: str
    step: int
    shape: tuple
    seed: int = 0
    extra: dict = field(default_factory=dict, compare=False)


class Compressor:
    """Base of every compressor; the Horovod contract (static methods work on the class too)."""
    name = "base"
    sparse = False
    wire_dtype = None  # dtype on the wire for dense compressors (None: unchanged)

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError

    def settings(self):
        """A tuple that must be equal on every rank (checked at the first exchange)."""
        return (self.name,)


@dataclass
class Selection:
    """Entries selected from a flat tensor of ``numel`` float32 elements.

    indices: 1-D torch.int32, strictly ascending, each in [0, numel).
    values:  1-D torch.float32, the same length (already rounded to the wire
             dtype when the compressor sends float16/bfloat16).
    key:     the random-k key when the indices are the random-k draw (the
             payload then carries values only), else None.
    scales:  the chunks' (lo, step) float32 pairs when the values are quantised
             on their grid (:mod:`.sparseloco`), else None.
    """
    indices: torch.Tensor
    values: torch.Tensor
    numel: int
    key: Optional[int] = None
    scales: Optional[torch.Tensor] = None

    def __len__(self):
        return self.indices.numel()

    def to_dense(self):
        out = torch.zeros(self.numel, dtype=torch.float32)
        if len(self):
            kernels.scatter_add(out, self.indices, self.values)
        return out


def _flat_f32(tensor):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError("expected a torch tensor, got %s" % type(tensor).__name__)
    if tensor.dtype != torch.float32:
        raise TypeError("sparse compressors take float32 tensors, got %s" % tensor.dtype)
    if tensor.device.type not in ("cpu", "cuda"):
        raise ValueError("sparse compressors take CPU or CUDA tensors; got a %s tensor" % tensor.device)
    if not tensor.is_contiguous():
        raise ValueError("the tensor must be contiguous")
    return tensor.detach().view(-1)


_WIRE = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class SparseCompressor(Compressor):
    """Base of the sparse compressors: density, value dtype on the wire, and
    per-tensor selection state (carried thresholds, scratch memory).

    Tensors with fewer than ``16 / density`` elements are selected with the exact top-k
    whatever the compressor (a block or a random draw would be too coarse),
    k = max(1, round(density * numel))."""
    name = "sparse"
    sparse = True

    # the DistributedOptimizer's options of the sparse route (hvd.allreduce ignores them): DGC's
    # momentum correction ("auto": on for SGD with momentum; optim/momentum_correction.py) and
    # its density warm-up (steps over which the density falls from 25 % to ``density``; measured
    # at parity with dense together: bench/bench_parity.py)
    WARMUP = 50

    def __init__(self, density=0.01, value_dtype="float32", error_feedback=True, momentum_correction="auto",
                 warmup=WARMUP):
        density = float(density)
        if not (0.0 < density <= 1.0):
            raise ValueError("density must be in (0, 1], got %r" % density)
        if not any(momentum_correction is v for v in (True, False)) and momentum_correction != "auto":
            raise ValueError("momentum_correction must be 'auto' (on for SGD with momentum), True or False; got %r"
                             % (momentum_correction,))
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError("warmup is the number of steps over which the density falls from 25 %% to density "
                             "(an int >= 0); got %r" % (warmup,))
        self.momentum_correction = momentum_correction
        self.warmup = warmup
        self.density = density
        # keep what was not sent and add it to the next step's gradient (the exchange
        # passes a Memory to select() only when this is on)
        self.error_feedback = bool(error_feedback)
        self.value_dtype = kernels.value_dtype_name(value_dtype)
        self._states = {}
        self._lock = threading.Lock()

    def __repr__(self):
        return "%s(density=%g, value_dtype=%r, error_feedback=%s)" % (type(self).__name__, self.density,
                                                                     self.value_dtype, self.error_feedback)

    def route_options(self):
        """The sparse route's options as keyword arguments (momentum correction, warm-up)."""
        return {"momentum_correction": self.momentum_correction, "warmup": self.warmup}

    def settings(self):
        return (self.name, self.density, self.value_dtype, self.error_feedback) + self._extra_settings()

    def with_density(self, density):
        """A copy that sends ``density`` of the entries and shares this one's per-tensor
        selection state (the adjuster switches density between steps; collectives already
        queued keep the compressor they were launched with)."""
        density = float(density)
        if not (0.0 < density <= 1.0):
            raise ValueError("density must be in (0, 1], got %r" % density)
        other = copy.copy(self)
        other.density = density
        return other

    def _extra_settings(self):
        return ()

    @classmethod
    def from_settings(cls, settings):
        """The compressor whose :meth:`settings` are ``settings`` (a joined rank rebuilds the
        others' compressor from a collective's description). Subclasses with extra settings
        override :meth:`_extra_kwargs`."""
        name, density, value_dtype, error_feedback, *extra = settings
        comp = cls(density=density, value_dtype=value_dtype, error_feedback=error_feedback, **cls._extra_kwargs(extra))
        if tuple(comp.settings()) != tuple(settings):
            raise ValueError("compressor %r cannot be rebuilt from its settings %r" % (name, list(settings)))
        return comp

    @classmethod
    def _extra_kwargs(cls, extra):
        if extra:
            raise ValueError("%s has no extra settings, got %r" % (cls.__name__, list(extra)))
        return {}

    # Horovod's dense contract does not apply: the WAN exchange calls select/encode/decode.
    def compress(self, tensor):
        raise TypeError("%s is a sparse compressor: use select/encode/decode (cross-cluster hop)" % self.name)

    def decompress(self, tensor, ctx):
        raise TypeError("%s is a sparse compressor: use select/encode/decode (cross-cluster hop)" % self.name)

    def k_for(self, numel):
        """Entries to send for a tensor of numel elements."""
        if numel <= 0:
            return 0
        return max(1, min(numel, int(round(self.density * numel))))

    def is_small(self, numel):
        return numel < 16.0 / self.density

    def state(self, name, numel=None):
        """The selection state of one tensor (created on first use; afresh when the name comes
        back with another size: a new tensor)."""
        with self._lock:
            numel_and_state = self._states.get(name)
            if numel_and_state is None or (numel is not None and numel_and_state[0] != numel):
                numel_and_state = (numel, kernels.SelState())
                self._states[name] = numel_and_state
            return numel_and_state[1]

    def select(self, tensor, ctx, memory=None):
        """Select entries of a flat float32 tensor. With ``memory`` (error
        feedback) acc = tensor + residual[ctx.name]; entries are taken from acc
        and the residual becomes acc minus what is sent, so that, bit for bit,
        sent + residual == acc (for 16-bit wire values the rounding error stays
        in the residual, exact while |acc| < 2x the largest finite wire value).

        A CUDA tensor is selected on its device (:mod:`.device_select`, torch operations with
        the C kernels' rules); the Selection and the residual stay on that device. CPU tensors
        run the C kernels (or the torch operations too under ``STELLA_DEVICE_PATH=torch``)."""
        flat = _flat_f32(tensor)
        n = flat.numel()
        if n > kernels.MAX_NUMEL:
            raise ValueError("tensor %r has %d elements; split it below %d" % (ctx.name, n, kernels.MAX_NUMEL))
        residual = memory.residual(ctx.name, n, flat.device) if memory is not None else None
        k = self.k_for(n)
        key = None
        on_device = on_device_route(flat)
        if n == 0:
            idx = torch.empty(0, dtype=torch.int32, device=flat.device)
            val = torch.empty(0, dtype=torch.float32, device=flat.device)
        elif self.is_small(n):
            idx, val = (device_select.topk(flat, k, residual) if on_device
                        else kernels.topk(flat, k, residual, self.state(ctx.name, n)))
        elif on_device:
            idx, val, key = self._select_on_device(flat, n, k, residual, ctx)
        else:
            idx, val, key = self._select(flat, n, k, residual, ctx)
        if self.value_dtype != "float32" and len(idx):
            val = self._round_to_wire(idx, val, residual)
        return Selection(idx, val, n, key)

    def _select(self, flat, n, k, residual, ctx):
        """(indices, values, random-k key or None) of k entries of ``flat`` (+ ``residual``)."""
        raise NotImplementedError

    def _select_on_device(self, flat, n, k, residual, ctx):
        """:meth:`_select` in torch operations (CUDA tensors); the exact top-k unless overridden."""
        idx, val = device_select.topk(flat, k, residual)
        return idx, val, None

    def wire_rounding(self, val):
        """(``val`` as the 16-bit wire carries it, clamped to its range; the rounding error, 0
        where a value is not finite)."""
        wire = _WIRE[self.value_dtype]
        finfo = torch.finfo(wire)
        finite = torch.isfinite(val)
        q = torch.where(finite, val.clamp(-finfo.max, finfo.max), val).to(wire).to(torch.float32)
        return q, torch.where(finite, val - q, torch.zeros_like(val))

    def _round_to_wire(self, idx, val, residual):
        q, err = self.wire_rounding(val)
        if residual is not None:
            residual.index_copy_(0, idx.long(), err)
        return q

    def to_wire(self, sel, residual=None):
        """``sel`` with its values as the wire carries them (what a peer decodes from
        :meth:`encode`); the rounding error is added to ``residual`` (dense, of the tensor's
        numel) where given. Float32: ``sel`` itself."""
        if self.value_dtype == "float32":
            return sel
        q, err = self.wire_rounding(sel.values)
        if residual is not None:
            residual.index_add_(0, sel.indices.long().to(residual.device), err.to(residual.device))
        return Selection(sel.indices, q, sel.numel)

    def encode(self, sel, ctx):
        """Payload of a selection: 1-D torch.uint8, the smallest index scheme
        (16-bit offsets, block ids, values only for random-k and dense)."""
        if sel.key is not None:
            return kernels.randomk_encode(sel.key, sel.values, sel.numel, self.value_dtype)
        return kernels.encode(sel.indices, sel.values, sel.numel, "auto", self.value_dtype)

    def decode(self, payload, ctx, numel):
        """Validate and decode a payload from a peer (MalformedPayloadError naming what is wrong)."""
        idx, val = kernels.decode(payload, numel, self._expected_key(ctx, numel), value_dtype=self.value_dtype,
                                  implicit=self.implicit_indices)
        return Selection(idx, val, int(numel))

    implicit_indices = False   # payloads whose indices a random-k key implies (random-k only)
    # whether a payload's size follows from (numel, k) alone: every selection has exactly k entries
    # (the planner, stella_mpi/plan/wire.py, sizes it without data; else it needs the selections);
    # a compressor with a payload format of its own sizes it with ``payload_size(numel, k)``
    payload_from_sizes = False

    def _expected_key(self, ctx, numel):
        return 0
