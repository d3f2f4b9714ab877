"""The dense C kernels against numpy, on every SIMD path this CPU has."""
import numpy as np
import pytest
import torch

from stella_mpi import _native
from stella_mpi._native import ffi, lib

SIZES = [0, 1, 15, 16, 17, 31, 33, 2 ** 15 - 1, 2 ** 15, 2 ** 15 + 1, 2 ** 16 - 1, 2 ** 16, 2 ** 16 + 1, 10 ** 6]
PATHS = _native.simd_levels_available()


@pytest.fixture(params=PATHS)
def simd(request):
    _native.force_simd(request.param)
    yield request.param
    _native.force_simd(None)


def _ptr(a, ctype):
    return ffi.cast(ctype, a.ctypes.data)


def _special(n, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * np.exp(rng.uniform(-20, 20, n))).astype(np.float32)
    if n >= 8:
        x[:8] = [np.nan, np.inf, -np.inf, 0.0, -0.0, 65504.0, 65520.0, 1e-8]
    return x


@pytest.mark.parametrize("n", SIZES)
def test_f32_to_f16_matches_numpy(simd, n):
    x = _special(n, n)
    out = np.empty(n, dtype=np.uint16)
    _native.check(lib.stella_f32_to_f16(_ptr(x, "float *"), _ptr(out, "uint16_t *"), n, 1.0), "cast")
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    got = out.view(np.float16)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    assert np.array_equal(got[ok].view(np.uint16), want[ok].view(np.uint16))


@pytest.mark.parametrize("n", SIZES)
def test_f32_to_bf16_matches_torch(simd, n):
    x = _special(n, n + 1)
    out = np.empty(n, dtype=np.uint16)
    _native.check(lib.stella_f32_to_bf16(_ptr(x, "float *"), _ptr(out, "uint16_t *"), n, 2.0), "cast")
    want = (torch.from_numpy(x) * 2.0).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(x)
    assert np.array_equal(out[~nan], want[~nan])
    assert np.all((out[nan] & 0x7F80) == 0x7F80) and np.all(out[nan] & 0x7F)


@pytest.mark.parametrize("n", [0, 1, 17, 4099, 2 ** 16 + 1])
def test_half_to_f32_roundtrip_and_scale(simd, n):
    h = np.random.default_rng(n).standard_normal(n).astype(np.float16)
    out = np.empty(n, dtype=np.float32)
    _native.check(lib.stella_f16_to_f32(_ptr(h, "uint16_t *"), _ptr(out, "float *"), n, 0.5), "cast")
    assert np.array_equal(out, h.astype(np.float32) * np.float32(0.5))
    b = torch.randn(n).to(torch.bfloat16)
    bo = np.empty(n, dtype=np.float32)
    _native.check(lib.stella_bf16_to_f32(ffi.cast("uint16_t *", b.data_ptr()), _ptr(bo, "float *"), n, 1.0), "cast")
    assert np.array_equal(bo, b.float().numpy())


@pytest.mark.parametrize("op", ["sum", "min", "max", "product"])
@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 1000, 2 ** 16 + 3])
def test_accumulate_matches_numpy(simd, op, n):
    rng = np.random.default_rng(n)
    a = rng.standard_normal(n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    if n > 4:
        a[1], b[2], b[3] = np.nan, np.nan, np.inf
    code = {"sum": lib.STELLA_OP_SUM, "min": lib.STELLA_OP_MIN, "max": lib.STELLA_OP_MAX,
            "product": lib.STELLA_OP_PROD}[op]
    want = {"sum": np.add, "min": np.minimum, "max": np.maximum, "product": np.multiply}[op](a, b)
    acc = a.copy()
    _native.check(lib.stella_accumulate_f32(_ptr(acc, "float *"), _ptr(b, "float *"), n, code), "acc")
    np.testing.assert_array_equal(acc, want)
    hb = b.astype(np.float16)
    acc = a.copy()
    _native.check(lib.stella_accumulate_f16(_ptr(acc, "float *"), _ptr(hb, "uint16_t *"), n, code), "acc")
    np.testing.assert_array_equal(acc, {"sum": np.add, "min": np.minimum, "max": np.maximum,
                                        "product": np.multiply}[op](a, hb.astype(np.float32)))


def test_paths_give_identical_bits():
    x = _special(100_003, 5)
    results = []
    for path in PATHS:
        _native.force_simd(path)
        out = np.empty_like(x, dtype=np.uint16)
        lib.stella_f32_to_f16(_ptr(x, "float *"), _ptr(out, "uint16_t *"), x.size, 0.25)
        acc = x.copy()
        lib.stella_accumulate_f32(_ptr(acc, "float *"), _ptr(x, "float *"), x.size, lib.STELLA_OP_MAX)
        results.append((out.tobytes(), acc.tobytes()))
    _native.force_simd(None)
    assert all(r == results[0] for r in results)


def test_checksum():
    a = np.arange(1000, dtype=np.float32)
    out = ffi.new("uint64_t *")
    _native.check(lib.stella_checksum64(_ptr(a, "void *"), a.nbytes, out), "checksum")
    first = out[0]
    lib.stella_checksum64(_ptr(a, "void *"), a.nbytes, out)
    assert out[0] == first
    a[500] += 1
    lib.stella_checksum64(_ptr(a, "void *"), a.nbytes, out)
    assert out[0] != first
    lib.stella_checksum64(_ptr(a, "void *"), a.nbytes - 1, out)  # odd lengths are fine


def test_bad_arguments_become_exceptions():
    x = np.zeros(4, dtype=np.float32)
    with pytest.raises(ValueError, match="out of range"):
        _native.check(lib.stella_scale_f32(_ptr(x, "float *"), -1, 1.0), "stella_scale_f32")
    with pytest.raises(ValueError, match="NULL"):
        _native.check(lib.stella_scale_f32(ffi.NULL, 4, 1.0), "stella_scale_f32")
    with pytest.raises(ValueError, match="out of range"):
        _native.check(lib.stella_accumulate_f32(_ptr(x, "float *"), _ptr(x, "float *"), 4, 99), "acc")
    assert lib.stella_scale_f32(ffi.NULL, 0, 1.0) == lib.STELLA_OK
    with pytest.raises(KeyError):
        _native.force_simd("sse9")


def test_large_length_is_validated_without_allocating():
    # n near 2^31 and beyond is legal for the ABI (int64 lengths); a negative n (e.g. an
    # overflowed int32 from a caller) is refused.
    x = np.zeros(1, dtype=np.float32)
    assert lib.stella_scale_f32(_ptr(x, "float *"), -(2 ** 31), 1.0) == lib.STELLA_ERR_ARG
