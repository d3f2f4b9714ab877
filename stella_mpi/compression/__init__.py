"""Compression: the contracts (:mod:`.contracts`), Horovod's dense compressors
(:mod:`.dense`), one module per sparse algorithm (:mod:`.topk`, :mod:`.cacheaware`,
:mod:`.threshold`, :mod:`.randomk`, :mod:`.sparseloco`, :mod:`.dct`), homomorphic quantization (:mod:`.thc`), the merge of selections (:mod:`.merge`), the
error-feedback memory (:mod:`.memory`) and the table of compressors (:mod:`.registry`).

Pure computation on CPU tensors through the C kernels: nothing here talks to MPI.

Use::

    comp = Compression.cacheaware(density=0.01)       # or topk, threshold, randomk
    sel = comp.select(flat_f32, ctx, memory=mem)      # Selection: int32 indices, float32 values
    payload = comp.encode(sel, ctx)                   # 1-D torch.uint8
    sel2 = comp.decode(payload, ctx, numel)           # validates; MalformedPayloadError if bad
    merged = merge_selections([sel_a, sel_b])         # union, values summed in list order
    scatter_add(dense_out, merged, scale=1.0 / n)
"""
from .cacheaware import CacheAwareCompressor  # noqa: F401
from .contracts import Compressor, Selection, SparseCompressor, TensorContext  # noqa: F401
from .dct import DCTCompressor  # noqa: F401
from .dense import BF16Compressor, FP16Compressor, NoneCompressor  # noqa: F401
from .memory import Memory  # noqa: F401
from .merge import merge_selections, scatter_add  # noqa: F401
from .randomk import RandomKCompressor  # noqa: F401
from .registry import Compression, get_compressor, register, registered  # noqa: F401
from .sparseloco import SparseLoCoCompressor  # noqa: F401
from .threshold import ThresholdCompressor  # noqa: F401
from .thc import THCCompressor, THCWork  # noqa: F401
from .topk import TopKCompressor  # noqa: F401
