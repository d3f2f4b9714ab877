"""SparseLoCo's compressor: top-k per chunk, the values quantised to 2, 4 or 8 bits with one
scale pair per chunk, error feedback across exchanges (the C kernels: c_src/chunked.c).

Made for the pseudo-gradient of local steps (``hvd.LocalSteps(compression=
hvd.Compression.sparseloco(density=0.01, bits=2))``), where SparseLoCo (Templar, 2025) sends
1-3 % at 2 bits every few dozen inner steps; it is also a compressor of the synchronous sparse
route. Per chunk of ``chunk`` entries (a power of two, 4096 by default) the
``max(1, round(density * chunk))`` largest entries of ``tensor + residual`` are selected; their
magnitudes go on a grid of ``2**(bits-1)`` levels between the chunk's smallest and largest
selected magnitude, with a sign bit; what was not sent, and each sent value's rounding error,
stays in the residual (times ``feedback_decay`` before it is added to the next tensor).

The indices travel in today's sparse codec (16-bit offsets at these densities), the scales as
two float32 per chunk, the codes packed: at density 1 %, 2 bits and chunks of 4096 an entry
costs about 2.5 bytes, 1/160 of the dense float32 tensor. A payload from a peer is decoded by
the C core, which checks every index, scale and code before a value is handed out.

:class:`DCTCompressor` (:mod:`.dct`) is the same selection in the DCT-II domain (DeMo)."""
import torch

from .._native import chunked as kernels
from .._native import compress as codec
from ..base.devices import on_device_route
from . import device_chunked
from .contracts import Selection, SparseCompressor, _flat_f32

BITS = kernels.BITS


def check_chunk(chunk, low=kernels.CHUNK_MIN, high=kernels.CHUNK_MAX, who="sparseloco"):
    if isinstance(chunk, bool) or not isinstance(chunk, int) or not low <= chunk <= high or chunk & (chunk - 1):
        raise ValueError("Compression.%s: chunk must be a power of two in [%d, %d] (entries per chunk), got %r"
                         % (who, low, high, chunk))
    return chunk


def check_bits(bits, who="sparseloco", allow_none=False):
    if allow_none and bits is None:
        return None
    if isinstance(bits, bool) or bits not in BITS:
        raise ValueError("Compression.%s: bits must be one of %s%s (bits per value on the wire), got %r"
                         % (who, ", ".join(map(str, BITS)), " or None (float32 values)" if allow_none else "", bits))
    return int(bits)


class SparseLoCoCompressor(SparseCompressor):
    """Chunked top-k with values quantised per chunk (the module's documentation)."""
    name = "sparseloco"
    payload_from_sizes = True   # k_for(n) entries in every selection; payload_size sizes its own format
    float_values = False   # whether bits=None (values sent as float32, today's codec) is allowed
    chunk_max = kernels.CHUNK_MAX

    def __init__(self, density=0.01, chunk=4096, bits=2, feedback_decay=1.0, error_feedback=True,
                 momentum_correction="auto", warmup=SparseCompressor.WARMUP, value_dtype="float32"):
        super().__init__(density=density, value_dtype=value_dtype, error_feedback=error_feedback,
                         momentum_correction=momentum_correction, warmup=warmup)
        if self.value_dtype != "float32":
            raise ValueError("Compression.%s: the values are quantised to bits=%r; value_dtype must stay float32, "
                             "got %r" % (self.name, bits, value_dtype))
        self.chunk = check_chunk(chunk, high=self.chunk_max, who=self.name)
        self.bits = check_bits(bits, who=self.name, allow_none=self.float_values)
        if isinstance(feedback_decay, bool) or not isinstance(feedback_decay, (int, float)) \
                or not 0.0 < feedback_decay <= 1.0:
            raise ValueError("Compression.%s: feedback_decay must be in (0, 1] (the residual's weight before it is "
                             "added to the next tensor), got %r" % (self.name, feedback_decay))
        self.feedback_decay = float(feedback_decay)

    def __repr__(self):
        return "%s(density=%g, chunk=%d, bits=%s)" % (type(self).__name__, self.density, self.chunk, self.bits)

    def _extra_settings(self):
        return (self.chunk, self.bits, self.feedback_decay)

    @classmethod
    def _extra_kwargs(cls, extra):
        chunk, bits, decay = extra
        return {"chunk": chunk, "bits": bits, "feedback_decay": decay}

    @property
    def per_chunk(self):
        """Entries selected from a full chunk."""
        return max(1, min(self.chunk, int(round(self.density * self.chunk))))

    def k_for(self, numel):
        return kernels.topk_count(numel, self.chunk, self.per_chunk) if numel > 0 else 0

    @property
    def entry_bytes(self):
        """Wire bytes per selected entry: a 16-bit offset, the code, the chunk's scales shared
        (float32 values: 4 bytes each, no scales)."""
        if self.bits is None:
            return 6.0
        return 2.0 + self.bits / 8.0 + 8.0 / self.per_chunk

    def payload_size(self, numel, k):
        """Bytes of :meth:`encode`'s payload of ``k`` entries of a tensor of ``numel`` holding no
        whole aligned 16-block (which the codec would send smaller, as block ids): the planner's
        size from sizes alone (stella_mpi/plan/wire.py ``sized_payload``)."""
        if self.bits is None:
            return codec.payload_size(numel, k, 0, codec.choose_scheme(numel, k), "float32")
        return kernels.payload_size(numel, self.chunk, k, self.bits)

    # ---------------- the three contracts

    def _domain(self, flat):
        """The tensor in the domain entries are selected from (the identity here)."""
        return flat

    selects_on_device = True   # a CUDA tensor is selected and quantised where it is (:mod:`.device_chunked`)

    def select(self, tensor, ctx, memory=None):
        """A CUDA tensor (or any under ``STELLA_DEVICE_PATH=torch``) is selected and quantised in
        torch operations on its device, with its residual there, bit for bit as the C kernels
        do on the host; the Selection then stays on the device (the exchange copies only it)."""
        flat = _flat_f32(tensor)
        on_device = self.selects_on_device and on_device_route(flat)
        flat = self._domain((flat if on_device else flat.cpu()).contiguous())
        n = flat.numel()
        residual = memory.residual(ctx.name, n, flat.device) if memory is not None else None
        if residual is not None and self.feedback_decay != 1.0:
            residual.mul_(self.feedback_decay)
        ops = device_chunked if on_device else kernels
        if n == 0:
            idx = torch.empty(0, dtype=torch.int32, device=flat.device)
            val = torch.empty(0, dtype=torch.float32, device=flat.device)
        else:
            idx, val = ops.chunk_topk(flat, self.chunk, self.per_chunk, residual)
        scales = None if self.bits is None else ops.quantize(idx, val, n, self.chunk, self.bits, residual)
        return Selection(idx, val, n, scales=scales)

    def to_wire(self, sel, residual=None):
        """``sel`` quantised (a merge of selections, in the tree route); each value's rounding
        error is added to ``residual`` where given. A selection already on its grid is
        returned as it is."""
        if sel.scales is not None or self.bits is None:
            return sel
        val = sel.values.to("cpu", torch.float32).clone()
        idx = sel.indices.to("cpu").contiguous()
        res = residual if residual is None or residual.device.type == "cpu" else None
        scales = kernels.quantize(idx, val, sel.numel, self.chunk, self.bits, res)
        if residual is not None and res is None:
            residual.index_add_(0, idx.long().to(residual.device), (sel.values.cpu() - val).to(residual.device))
        return Selection(idx, val, sel.numel, scales=scales)

    def encode(self, sel, ctx):
        if self.bits is None:
            return codec.encode(sel.indices, sel.values, sel.numel, "auto", "float32")
        sel = self.to_wire(sel)
        return kernels.encode(sel.indices, sel.values, sel.scales, sel.numel, self.chunk, self.bits)

    def decode(self, payload, ctx, numel):
        if self.bits is None:
            idx, val = codec.decode(payload, numel, 0, value_dtype="float32", implicit=False)
            return Selection(idx, val, int(numel))
        idx, val, scales = kernels.decode(payload, int(numel), self.chunk, self.bits)
        return Selection(idx, val, int(numel), scales=scales)
