"""The CPU worker pool: choosing cores for a rank, and the pinned C pool (``c_src/stella_pool.h``).

Core choice (:func:`plan_cores`), from the cores this process may run on (``os.sched_getaffinity(0)``):

* the allowed cores are divided among the node's local ranks in contiguous slices
  (rank ``r`` of ``L`` gets ``allowed[r*m//L:(r+1)*m//L]``); when there are more local ranks
  than cores, rank ``r`` shares core ``allowed[r % m]``. If the launcher already bound each
  rank to its own cores, pass ``divide=False``: the allowed set is then this rank's share;
* within its share a rank leaves the first core to its main (training) thread when the share
  has at least two cores; the workers take the others. With one core the worker shares it;
* ``STELLA_CPU_CORES`` (``"2,3"``, ``"2-5"``, ``"0-3,8"``; or one list per local rank separated
  by ``;``, e.g. ``"1-3;5-7"``) names the worker cores explicitly; every core must be allowed;
* ``STELLA_CPU_THREADS`` (a count >= 1) sets the number of workers: the first ones of the
  list, then the main thread's core, then the list again (more threads than cores shares cores).

The layout is logged at debug level on the ``stella_mpi`` logger.
"""
import logging
import os
from dataclasses import dataclass

from ..base.config import CPU_CORES_VAR, CPU_THREADS_VAR, cpu_cores_setting, cpu_threads_setting
from . import check, ffi, lib

log = logging.getLogger("stella_mpi")


def parse_cpu_list(spec):
    """``"2,3"``, ``"2-5"``, ``"0-3, 8"`` -> sorted unique core ids."""
    out = set()
    text = str(spec).strip()
    if not text:
        raise ValueError("empty core list")
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise ValueError("core list %r has an empty item" % spec)
        try:
            if "-" in part:
                a, b = part.split("-", 1)
                a, b = int(a), int(b)
                if a > b:
                    raise ValueError
                out.update(range(a, b + 1))
            else:
                out.add(int(part))
        except ValueError:
            raise ValueError("core list %r: %r is not a core id or a range a-b" % (spec, part)) from None
    if min(out) < 0:
        raise ValueError("core list %r has a negative core id" % spec)
    return sorted(out)


def format_cpu_list(cores):
    """[0, 1, 2, 5] -> ``"0-2,5"`` (the kernel's Cpus_allowed_list format)."""
    cores = sorted(set(cores))
    parts, i = [], 0
    while i < len(cores):
        j = i
        while j + 1 < len(cores) and cores[j + 1] == cores[j] + 1:
            j += 1
        parts.append(str(cores[i]) if i == j else "%d-%d" % (cores[i], cores[j]))
        i = j + 1
    return ",".join(parts)


@dataclass(frozen=True)
class CoreLayout:
    workers: tuple      # one core per worker thread (a core may repeat)
    main: object        # the core left to the rank's main thread, or None
    share: tuple        # this rank's cores
    allowed: tuple      # the process's allowed cores
    source: str         # "auto", "STELLA_CPU_CORES", with "+STELLA_CPU_THREADS" when a count was given

    def describe(self):
        return "workers on cores %s, main thread %s, rank share %s of allowed %s (%s)" % (
            list(self.workers), "core %d" % self.main if self.main is not None else "not reserved",
            format_cpu_list(self.share) or "-", format_cpu_list(self.allowed), self.source)


def plan_cores(local_rank=0, local_size=1, allowed=None, *, cores=None, threads=None, divide=True):
    """The :class:`CoreLayout` of local rank ``local_rank`` of ``local_size``.

    ``cores`` and ``threads`` are the settings ``STELLA_CPU_CORES`` and ``STELLA_CPU_THREADS`` as
    written (default: read from the environment by :mod:`stella_mpi.base.config`; "" = automatic);
    ``allowed`` (default ``os.sched_getaffinity(0)``) can be given for tests."""
    local_rank, local_size = int(local_rank), int(local_size)
    if local_size < 1 or not 0 <= local_rank < local_size:
        raise ValueError("local_rank %d / local_size %d is not a valid rank" % (local_rank, local_size))
    cores = cpu_cores_setting() if cores is None else str(cores).strip()
    threads = cpu_threads_setting() if threads is None else str(threads).strip()
    allowed = tuple(sorted(set(os.sched_getaffinity(0) if allowed is None else allowed)))
    if not allowed:
        raise ValueError("no allowed cores")
    m = len(allowed)
    if not divide:
        share = allowed
    elif local_size <= m:
        share = allowed[local_rank * m // local_size:(local_rank + 1) * m // local_size]
    else:
        share = (allowed[local_rank % m],)

    nthreads = None
    if threads:
        try:
            nthreads = int(threads)
        except ValueError:
            nthreads = 0
        if nthreads < 1:
            raise ValueError("%s=%r must be a number of threads >= 1" % (CPU_THREADS_VAR, threads))

    spec = cores
    if spec:
        groups = spec.split(";")
        if len(groups) > 1:
            if len(groups) < local_size:
                raise ValueError("%s=%r has %d per-rank lists for %d local ranks"
                                 % (CPU_CORES_VAR, spec, len(groups), local_size))
            spec_r = groups[local_rank]
        else:
            spec_r = groups[0]
        try:
            workers = parse_cpu_list(spec_r)
        except ValueError as e:
            raise ValueError("%s: %s" % (CPU_CORES_VAR, e)) from None
        outside = [c for c in workers if c not in allowed]
        if outside:
            raise ValueError("%s=%r names core(s) %s that this process may not run on (allowed: %s)"
                             % (CPU_CORES_VAR, spec, format_cpu_list(outside), format_cpu_list(allowed)))
        main, source, share = None, CPU_CORES_VAR, tuple(workers)
    else:
        source = "auto"
        if len(share) >= 2:
            main, workers = share[0], list(share[1:])
        else:
            main, workers = share[0], list(share)

    if nthreads is not None:
        pool = list(workers) + ([main] if main is not None and main not in workers else [])
        workers = [pool[i % len(pool)] for i in range(nthreads)] if nthreads > len(workers) else workers[:nthreads]
        if main is not None and main in workers:
            main = None  # the count asked for the main thread's core too
        source += "+" + CPU_THREADS_VAR
    layout = CoreLayout(tuple(workers), main, tuple(share), allowed, source)
    log.debug("stella_mpi cpu pool, local rank %d/%d: %s", local_rank, local_size, layout.describe())
    return layout


class CpuPool:
    """Worker threads pinned one per entry of ``cores`` (see ``c_src/stella_pool.h``).

    Tasks are ``stella_pool_task`` structs; the sparse optimizers (``stella_mpi.optim.sparse_optim``)
    build them. One batch at a time: :meth:`submit`, then :meth:`wait`. A wait given a deadline
    (``timeout_ms`` >= 0; the CPU engine passes STELLA_TIMEOUT's) raises
    :class:`stella_mpi._native.NativeTimeoutError` (a ``TimeoutError``) when it passes, with the
    batch still running (wait again, or :meth:`close`); -1 waits for good."""

    def __init__(self, cores):
        cores = [int(c) for c in cores]
        if not cores:
            raise ValueError("a pool needs at least one core")
        arr = ffi.new("int32_t[]", cores)
        out = ffi.new("stella_pool **")
        rc = lib.stella_pool_create(arr, len(cores), out)
        if rc == lib.STELLA_ERR_ARG:
            allowed = sorted(os.sched_getaffinity(0))
            bad = [c for c in cores if c not in allowed]
            raise ValueError("cannot pin workers to core(s) %s: not in this process's allowed set %s"
                             % (format_cpu_list(bad) or cores, format_cpu_list(allowed)))
        check(rc, "stella_pool_create")
        self._pool = out[0]
        self.cores = tuple(cores)
        self._keep = None        # Python objects the batch in flight points into
        self._ntasks = 0

    @classmethod
    def for_rank(cls, local_rank=0, local_size=1, divide=True, *, cores=None, threads=None):
        """A pool on the cores :func:`plan_cores` picks."""
        layout = plan_cores(local_rank, local_size, cores=cores, threads=threads, divide=divide)
        pool = cls(layout.workers)
        pool.layout = layout
        return pool

    def _live(self):
        if self._pool is None:
            raise RuntimeError("the CPU pool is closed")
        return self._pool

    @property
    def size(self):
        return len(self.cores)

    def thread_ids(self):
        """Kernel thread ids of the workers, in the order of ``cores``."""
        n = len(self.cores)
        tids = ffi.new("int32_t[]", n)
        check(lib.stella_pool_threads(self._live(), tids, ffi.NULL, n), "stella_pool_threads")
        return [tids[i] for i in range(n)]

    @property
    def busy(self):
        return self._keep is not None

    def submit(self, tasks, keepalive=(), grain=0):
        """Queue a batch: ``tasks`` is a cffi ``stella_pool_task[]``; ``keepalive`` holds the
        tensors it points into until the batch is over."""
        n = len(tasks)
        rc = lib.stella_pool_submit(self._live(), tasks if n else ffi.NULL, n, int(grain))
        check(rc, "stella_pool_submit")
        self._keep = (tasks, keepalive)
        self._ntasks = n

    def wait(self, timeout_ms=-1):
        """Wait for the batch; returns the per-task status codes (all 0 on success) or raises
        the error of the first failing task. ``timeout_ms < 0`` waits without a deadline."""
        n = self._ntasks
        st = ffi.new("int32_t[]", max(n, 1))
        rc = lib.stella_pool_wait(self._live(), int(timeout_ms), st, n)
        if rc == lib.STELLA_ERR_TIMEOUT:
            check(rc, "stella_pool_wait(%d ms)" % timeout_ms)
        self._keep = None
        self._ntasks = 0
        codes = [st[i] for i in range(n)]
        if rc:
            bad = next(i for i, c in enumerate(codes) if c) if any(codes) else -1
            check(rc, "CPU pool task %d" % bad)
        return codes

    def run(self, tasks, keepalive=(), timeout_ms=-1, grain=0):
        self.submit(tasks, keepalive, grain)
        return self.wait(timeout_ms)

    def close(self):
        """Stop and join the workers (chunks of a running batch not yet started are dropped)."""
        if self._pool is not None:
            lib.stella_pool_destroy(self._pool)
            self._pool = None
            self._keep = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
