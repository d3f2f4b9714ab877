"""Waiting on MPI and gloo with a deadline.

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

from mpi4py import MPI

from ..base.errors import StellaTimeoutError

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
