"""The C core's binding: the cffi module, its status codes mapped to exceptions, the SIMD switch.

The wrappers of the kernels live beside it, one module per C header family: :mod:`.compress`
(selection, codecs, merge), :mod:`.dense` (reductions, casts), :mod:`.pool` (the pinned worker
pool and the choice of its cores); every buffer reaches C through :func:`.buffers.pointer`.
It imports nothing of stella_mpi above the base layer."""
from . import _stella  # built by setup.py (cffi_modules) from c_src/

ffi = _stella.ffi
lib = _stella.lib


class NativeError(RuntimeError):
    """A C kernel refused its arguments (the message names the kernel and the reason)."""


class MalformedPayloadError(NativeError, ValueError):
    """Data received from a peer failed validation in the C core."""


class NativeTimeoutError(NativeError, TimeoutError):
    """A wait in the C core (the worker pool) reached its deadline; the work is still running."""


SIMD_LEVELS = {"scalar": lib.STELLA_SIMD_SCALAR, "avx2": lib.STELLA_SIMD_AVX2, "avx512": lib.STELLA_SIMD_AVX512}


def check(rc, what):
    """Raise the exception matching a C status code; ``what`` names the call."""
    if rc == lib.STELLA_OK:
        return
    msg = "%s: %s" % (what, ffi.string(lib.stella_strerror(rc)).decode())
    if rc == lib.STELLA_ERR_MALFORMED:
        raise MalformedPayloadError(msg)
    if rc in (lib.STELLA_ERR_ARG, lib.STELLA_ERR_NULL, lib.STELLA_ERR_SIZE):
        raise ValueError(msg)
    if rc == lib.STELLA_ERR_NOMEM:
        raise MemoryError(msg)
    if rc == lib.STELLA_ERR_TIMEOUT:
        raise NativeTimeoutError(msg)
    raise NativeError(msg)


def simd_levels_available():
    """Names of the SIMD paths this CPU can run, lowest first."""
    best = lib.stella_simd_best()
    return [name for name, lvl in SIMD_LEVELS.items() if lvl <= best]


def simd_active():
    lvl = lib.stella_simd_active()
    return next(name for name, v in SIMD_LEVELS.items() if v == lvl)


def force_simd(name):
    """Force one SIMD path (``"scalar"``, ``"avx2"``, ``"avx512"``) or ``None`` for automatic."""
    check(lib.stella_simd_force(-1 if name is None else SIMD_LEVELS[name]), "force_simd(%r)" % name)
