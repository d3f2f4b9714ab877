"""Waiting on MPI and gloo with a deadline, and torch <-> MPI buffer views.

MPI has no timeouts, so every wait here polls a non-blocking request. MPI
progresses a non-blocking collective only inside MPI calls, so the poll must
be frequent: it yields the CPU between tests (other ranks on the same cores
get to run, which matters when ranks outnumber cores) and only after a few
milliseconds without completion falls back to short sleeps. The GIL is
released while yielding or sleeping, so the training thread keeps running.
"""
import os
import time
from datetime import timedelta

import numpy as np
import torch
from mpi4py import MPI

from .errors import StellaTimeoutError

_YIELD_SECONDS = 5e-3   # poll with sched_yield this long before sleeping
_MAX_SLEEP = 2e-4


class Deadline:
    """Waits on requests; raises StellaTimeoutError past ``timeout_s``."""

    def __init__(self, timeout_s, rank):
        self.timeout_s = timeout_s
        self.rank = rank

    def _expired(self, what):
        return StellaTimeoutError(
            "rank %d: %s did not complete within %.0f s (STELLA_TIMEOUT); a peer has stalled, "
            "died or is running a different collective" % (self.rank, what, self.timeout_s))

    def wait(self, req, what):
        self.wait_all([req], what)

    def wait_all(self, reqs, what):
        reqs = [r for r in reqs if r is not None]
        if not reqs:
            return
        if MPI.Request.Testall(reqs):
            return
        start = time.monotonic()
        polls, nap = 0, 1e-5
        yield_ = os.sched_yield
        while not MPI.Request.Testall(reqs):
            polls += 1
            if polls & 63:
                yield_()
                continue
            elapsed = time.monotonic() - start
            if elapsed > self.timeout_s:
                raise self._expired(what)
            if elapsed < _YIELD_SECONDS:
                yield_()
            else:
                time.sleep(nap)
                nap = min(nap * 2, _MAX_SLEEP)

    def wait_work(self, work, what):
        """Wait on a torch.distributed Work object (gloo/NCCL)."""
        try:
            work.wait(timedelta(seconds=self.timeout_s))
        except RuntimeError as e:
            if "timed out" in str(e).lower() or "timeout" in str(e).lower():
                raise self._expired(what) from e
            raise


def mpi_view(t):
    """A numpy view of a contiguous CPU tensor that MPI can send or reduce.

    16-bit floats (no MPI type) are viewed as int16: such views may be moved,
    never reduced by MPI (reductions run in float32, see collectives)."""
    if not t.is_contiguous():
        raise ValueError("internal: MPI buffers must be contiguous")
    if t.dtype in (torch.float16, torch.bfloat16):
        return t.view(torch.int16).numpy()
    return t.numpy()


def byte_view(t):
    """The bytes of a contiguous CPU tensor as a uint8 numpy array (for pure data movement)."""
    if t.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return t.contiguous().view(-1).view(torch.uint8).numpy()


def allgather_json(comm, obj, deadline, what):
    """Allgather a JSON-able value from every rank (never pickle: peer data is untrusted)."""
    import json
    data = np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8)
    lengths = np.zeros(comm.Get_size(), dtype=np.int64)
    deadline.wait(comm.Iallgather(np.array([data.size], dtype=np.int64), lengths), what)
    out = np.empty(int(lengths.sum()), dtype=np.uint8)
    displs = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    deadline.wait(comm.Iallgatherv(data, [out, lengths.tolist(), displs.tolist(), MPI.BYTE]), what)
    result = []
    for off, n in zip(displs, lengths):
        try:
            result.append(json.loads(out[off:off + n].tobytes().decode()))
        except (UnicodeDecodeError, ValueError) as e:
            raise ValueError("%s: malformed message from a peer: %s" % (what, e)) from None
    return result


def bcast_json(comm, obj, root, deadline, what):
    """Broadcast a JSON-able value from ``root``."""
    import json
    n = np.zeros(1, dtype=np.int64)
    data = None
    if comm.Get_rank() == root:
        data = np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8).copy()
        n[0] = data.size
    deadline.wait(comm.Ibcast(n, root=root), what)
    if data is None:
        data = np.empty(int(n[0]), dtype=np.uint8)
    deadline.wait(comm.Ibcast(data, root=root), what)
    try:
        return json.loads(data.tobytes().decode())
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError("%s: malformed message from rank %d: %s" % (what, root, e)) from None


def allreduce_max(comm, values, deadline, what):
    """Element-wise maximum of a list of floats over ``comm``."""
    arr = np.asarray(values, dtype=np.float64)
    out = np.empty_like(arr)
    deadline.wait(comm.Iallreduce(arr, out, op=MPI.MAX), what)
    return out.tolist()


_PACE_BPS = None
_PACE_DELAY_S = 0.0


def wan_pace(nbytes, started, rounds=1):
    """User-space WAN emulation (``stellarun --wan`` without network namespaces): stretch a
    cross-cluster exchange of ``nbytes`` that began at ``started`` (time.monotonic()) to the
    time it would take at ``STELLA_WAN_PACE_BPS`` bits per second, plus the one-way delay
    ``STELLA_WAN_PACE_DELAY_S`` once per message round (``rounds``: messages that must arrive
    one after the other, e.g. sizes then payload)."""
    global _PACE_BPS, _PACE_DELAY_S
    if _PACE_BPS is None:
        _PACE_BPS = float(os.environ.get("STELLA_WAN_PACE_BPS", "0") or 0)
        _PACE_DELAY_S = float(os.environ.get("STELLA_WAN_PACE_DELAY_S", "0") or 0)
    if _PACE_BPS <= 0 or nbytes <= 0:
        return
    left = nbytes * 8 / _PACE_BPS + rounds * _PACE_DELAY_S - (time.monotonic() - started)
    if left > 0:
        time.sleep(left)
