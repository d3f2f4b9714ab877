"""Dense-path kernels against torch doing the same work, single thread (pytest-benchmark).

    .venv/bin/python -m pytest bench/test_bench_dense.py --benchmark-only --benchmark-group-by=param:n

Compare rows within one group (same size): e.g. stella cast vs torch cast.
"""
import pytest
import torch

from stella_mpi._native import check, ffi, lib

SIZES = [1_000_000, 25_000_000]


@pytest.fixture(autouse=True)
def one_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def _p(t, ctype):
    return ffi.cast(ctype, t.data_ptr())


@pytest.mark.parametrize("n", SIZES)
def test_cast_f32_to_f16_stella(benchmark, n):
    x, out = torch.randn(n), torch.empty(n, dtype=torch.float16)
    benchmark(lambda: check(lib.stella_f32_to_f16(_p(x, "float *"), _p(out, "uint16_t *"), n, 1.0), "cast"))
    assert torch.equal(out, x.half())


@pytest.mark.parametrize("n", SIZES)
def test_cast_f32_to_f16_torch(benchmark, n):
    x, out = torch.randn(n), torch.empty(n, dtype=torch.float16)
    benchmark(lambda: out.copy_(x))


@pytest.mark.parametrize("n", SIZES)
def test_accumulate_f16_into_f32_stella(benchmark, n):
    acc, h = torch.randn(n), torch.randn(n).half()
    benchmark(lambda: lib.stella_accumulate_f16(_p(acc, "float *"), _p(h, "uint16_t *"), n, lib.STELLA_OP_SUM))


@pytest.mark.parametrize("n", SIZES)
def test_accumulate_f16_into_f32_torch(benchmark, n):
    acc, h = torch.randn(n), torch.randn(n).half()
    benchmark(lambda: acc.add_(h))
