"""The compressors by name: one explicit table of the built-in ones, ``register`` for a user's
own, and Horovod's ``hvd.Compression`` namespace over both."""
from .cacheaware import CacheAwareCompressor
from .dct import DCTCompressor
from .dense import BF16Compressor, FP16Compressor, NoneCompressor
from .randomk import RandomKCompressor
from .threshold import ThresholdCompressor
from .sparseloco import SparseLoCoCompressor
from .thc import THCCompressor
from .topk import TopKCompressor

BUILT_IN = {
    "none": NoneCompressor,
    "fp16": FP16Compressor,
    "bf16": BF16Compressor,
    "topk": TopKCompressor,
    "cacheaware": CacheAwareCompressor,
    "threshold": ThresholdCompressor,
    "randomk": RandomKCompressor,
    "thc": THCCompressor,
    "sparseloco": SparseLoCoCompressor,
    "dct": DCTCompressor,
}
_REGISTRY = dict(BUILT_IN)


def register(name, factory):
    """Register a compressor class or factory under ``name`` (``Compression.<name>``)."""
    if name in _REGISTRY and _REGISTRY[name] is not factory:
        raise ValueError("compressor %r is already registered" % name)
    _REGISTRY[name] = factory
    return factory


def registered():
    return sorted(_REGISTRY)


def get_factory(name):
    """The class or factory registered under ``name``."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError("unknown compressor %r; registered: %s" % (name, ", ".join(registered()))) from None


def get_compressor(name, **kwargs):
    """Build a compressor by registry name, e.g. ``get_compressor("topk", density=0.01)``."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError("unknown compressor %r; registered: %s" % (name, ", ".join(registered()))) from None
    if isinstance(factory, type) and not factory.sparse and not kwargs:
        return factory
    return factory(**kwargs)


class _CompressionNamespace(type):
    def __getattr__(cls, name):
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return _REGISTRY[name]
        except KeyError:
            raise AttributeError("Compression has no compressor %r; registered: %s"
                                 % (name, ", ".join(registered()))) from None


class Compression(metaclass=_CompressionNamespace):
    """Horovod's ``hvd.Compression``: ``none``, ``fp16`` as before, plus ``bf16`` and every
    registered cross-cluster compressor (``Compression.cacheaware(density=0.01)``,
    ``Compression.thc(bits=4)``)."""
    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
