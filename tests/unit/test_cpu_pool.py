"""The pinned CPU pool (c_src/pool.c through stella_mpi._native.pool): core planning with fake
affinity sets, worker affinity read back from /proc, results equal to the single-threaded
kernels, timeouts and refusals."""
import logging
import os
import time

import numpy as np
import pytest
import torch

from stella_mpi import _native
from stella_mpi._native.pool import CpuPool, format_cpu_list, parse_cpu_list, plan_cores
from stella_mpi.optim.sparse_optim import SparseAdam, SparseAdamW, SparseSGD

ffi, lib = _native.ffi, _native.lib
ALLOWED = sorted(os.sched_getaffinity(0))


def _workers(n):
    return [ALLOWED[i % len(ALLOWED)] for i in range(n)]


@pytest.fixture
def pool():
    p = CpuPool(_workers(max(2, len(ALLOWED))))
    yield p
    p.close()


# ------------------------------------------------------------------ core planning

@pytest.mark.parametrize("spec,cores", [("2", [2]), ("2,3", [2, 3]), ("2-5", [2, 3, 4, 5]),
                                        ("0-2, 8,5", [0, 1, 2, 5, 8]), ("3,3", [3])])
def test_parse_cpu_list(spec, cores):
    assert parse_cpu_list(spec) == cores
    assert parse_cpu_list(format_cpu_list(cores)) == cores


@pytest.mark.parametrize("spec", ["", "a", "3-1", "1,,2", "-1", "1-"])
def test_parse_cpu_list_refuses(spec):
    with pytest.raises(ValueError):
        parse_cpu_list(spec)


def test_plan_divides_cores_among_local_ranks_and_leaves_main_core():
    allowed = range(8)
    l0 = plan_cores(0, 2, allowed=allowed, cores="", threads="")
    l1 = plan_cores(1, 2, allowed=allowed, cores="", threads="")
    assert (l0.main, l0.workers, l0.share) == (0, (1, 2, 3), (0, 1, 2, 3))
    assert (l1.main, l1.workers, l1.share) == (4, (5, 6, 7), (4, 5, 6, 7))
    # uneven: 3 ranks on 8 cores -> 2, 3, 3 cores
    shares = [plan_cores(r, 3, allowed=allowed, cores="", threads="").share for r in range(3)]
    assert shares == [(0, 1), (2, 3, 4), (5, 6, 7)]
    assert plan_cores(0, 3, allowed=allowed, cores="", threads="").workers == (1,)


def test_plan_small_machines():
    one = plan_cores(0, 1, allowed=[5], cores="", threads="")
    assert one.workers == (5,) and one.main == 5       # the worker shares the only core
    two = plan_cores(0, 1, allowed=[0, 1], cores="", threads="")
    assert two.workers == (1,) and two.main == 0
    crowded = [plan_cores(r, 3, allowed=[0, 1], cores="", threads="") for r in range(3)]
    assert [c.workers for c in crowded] == [(0,), (1,), (0,)]
    whole = plan_cores(1, 2, allowed=[4, 5, 6], cores="", threads="", divide=False)  # launcher already bound the rank
    assert whole.share == (4, 5, 6) and whole.workers == (5, 6)


def test_plan_env_overrides():
    allowed = range(8)
    assert plan_cores(0, 1, allowed=allowed, cores="", threads="2").workers == (1, 2)
    many = plan_cores(0, 2, allowed=allowed, cores="", threads="6")
    assert many.workers == (1, 2, 3, 0, 1, 2) and many.main is None
    c = plan_cores(0, 1, allowed=allowed, cores="2-5", threads="")
    assert c.workers == (2, 3, 4, 5) and c.main is None and c.source == "STELLA_CPU_CORES"
    c = plan_cores(1, 2, allowed=allowed, cores="1-3;5,7", threads="1")
    assert c.workers == (5,) and c.source == "STELLA_CPU_CORES+STELLA_CPU_THREADS"
    with pytest.raises(ValueError, match="may not run on"):
        plan_cores(0, 1, allowed=[0, 1], cores="1-3", threads="")
    with pytest.raises(ValueError, match="STELLA_CPU_CORES"):
        plan_cores(0, 1, allowed=allowed, cores="x", threads="")
    with pytest.raises(ValueError, match="per-rank lists"):
        plan_cores(0, 3, allowed=allowed, cores="1;2", threads="")
    for bad in ("0", "-2", "two"):
        with pytest.raises(ValueError, match="STELLA_CPU_THREADS"):
            plan_cores(0, 1, allowed=allowed, cores="", threads=bad)
    with pytest.raises(ValueError):
        plan_cores(2, 2, allowed=allowed, cores="", threads="")


def test_plan_is_logged_at_debug(caplog):
    with caplog.at_level(logging.DEBUG, logger="stella_mpi"):
        plan_cores(1, 2, allowed=range(4), cores="", threads="")
    assert any("local rank 1/2" in r.getMessage() and "workers on cores [3]" in r.getMessage()
               for r in caplog.records)


def test_plan_reads_the_settings_from_the_environment(monkeypatch):
    monkeypatch.setenv("STELLA_CPU_THREADS", "2")
    monkeypatch.setenv("STELLA_CPU_CORES", "")
    assert len(plan_cores(0, 1, allowed=range(4)).workers) == 2
    monkeypatch.setenv("STELLA_CPU_CORES", "3")
    assert plan_cores(0, 1, allowed=range(4)).workers == (3, 3)


def test_plan_default_uses_real_affinity():
    layout = plan_cores(0, 1, cores="", threads="")
    assert set(layout.workers) <= set(ALLOWED) and layout.allowed == tuple(ALLOWED)


# ------------------------------------------------------------------ the pool itself

def _cpus_allowed_list(tid):
    with open("/proc/self/task/%d/status" % tid) as f:
        for line in f:
            if line.startswith("Cpus_allowed_list:"):
                return line.split(":", 1)[1].strip()
    raise AssertionError("no Cpus_allowed_list for thread %d" % tid)


def test_worker_affinity_read_back_from_proc():
    cores = _workers(max(3, len(ALLOWED)))
    with CpuPool(cores) as p:
        tids = p.thread_ids()
        assert len(set(tids)) == len(cores)
        assert set(tids) <= {int(t) for t in os.listdir("/proc/self/task")}
        assert [_cpus_allowed_list(t) for t in tids] == [str(c) for c in cores]
    layout = plan_cores(0, 1, cores="", threads="")
    with CpuPool(layout.workers) as p:
        assert [_cpus_allowed_list(t) for t in p.thread_ids()] == [str(c) for c in layout.workers]


def test_bad_cores_refused():
    with pytest.raises(ValueError, match="not in this process's allowed set"):
        CpuPool([max(ALLOWED) + 1])
    with pytest.raises(ValueError):
        CpuPool([])


def _sleep_tasks(n, us):
    t = ffi.new("stella_pool_task[]", n)
    for i in range(n):
        t[i].op = lib.STELLA_TASK_SLEEP
        t[i].step = us
    return t


def test_wait_times_out_then_completes(pool):
    t0 = time.monotonic()
    pool.submit(_sleep_tasks(1, 300_000))
    with pytest.raises(TimeoutError):
        pool.wait(20)
    assert time.monotonic() - t0 < 0.25
    with pytest.raises(_native.NativeError, match="busy"):
        pool.submit(_sleep_tasks(1, 1))
    assert pool.wait(5000) == [0]
    assert time.monotonic() - t0 >= 0.29


def test_close_with_batch_in_flight():
    p = CpuPool(_workers(1))
    p.submit(_sleep_tasks(4, 50_000))
    t0 = time.monotonic()
    p.close()
    assert time.monotonic() - t0 < 0.15
    with pytest.raises(RuntimeError, match="closed"):
        p.thread_ids()


def _grads(rng, sizes, density):
    out = []
    for n in sizes:
        k = max(1, int(n * density))
        idx = np.sort(rng.choice(n, size=k, replace=False)).astype(np.int32)
        out.append((idx, rng.standard_normal(k).astype(np.float32)))
    return out


@pytest.mark.parametrize("cls,hp", [(SparseSGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
                                    (SparseAdam, dict(lr=0.01, amsgrad=True)),
                                    (SparseAdamW, dict(lr=0.01, weight_decay=0.1))])
@pytest.mark.parametrize("mode,catch", [("exact", False), ("exact", True), ("lazy", False)])
def test_pool_equals_single_thread(pool, cls, hp, mode, catch):
    sizes = [300_001, 4096, 33, 1]
    rng = np.random.default_rng(4)
    start = [torch.from_numpy(rng.standard_normal(n).astype(np.float32)) for n in sizes]
    a, b = [x.clone() for x in start], [x.clone() for x in start]
    oa, ob = cls(a, mode=mode, **hp), cls(b, mode=mode, **hp)
    for step in range(8):
        g = _grads(rng, sizes, [0.01, 0.3][step % 2])
        g[3] = None if step % 2 else g[3]
        oa.step(g, pool=pool, catch_up=catch, timeout_ms=30_000)
        ob.step(g, catch_up=catch)
    oa.catch_up(pool=pool, timeout_ms=30_000)
    ob.catch_up()
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    sa, sb = oa.state_dict(catch_up=False), ob.state_dict(catch_up=False)
    for da, db in zip(sa["state"], sb["state"]):
        for k in da:
            assert torch.equal(da[k], db[k]), k


def test_pool_step_async_and_refusal(pool):
    p = torch.randn(100_000)
    keep = p.clone()
    opt = SparseAdam([p, torch.randn(10)], lr=0.1)
    bad = np.array([5, 3], np.int32)
    pending = opt.submit_step([(np.arange(50_000, dtype=np.int32) * 2, np.ones(50_000, np.float32)),
                               (bad, np.ones(2, np.float32))], pool=pool)
    with pytest.raises(RuntimeError, match="still running"):
        opt.step([None, None])
    with pytest.raises(ValueError, match="strictly ascending"):
        pending.wait(10_000)
    assert torch.equal(p, keep) and opt.step_count == 0
    pending = opt.submit_step([(np.arange(0, 100_000, 7, dtype=np.int32), np.ones(14286, np.float32)), None],
                              pool=pool)
    pending.wait(10_000)
    assert opt.step_count == 1 and not torch.equal(p, keep)
