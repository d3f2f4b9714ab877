"""Waiting on MPI and gloo with a deadline.

MPI has no timeouts, so every wait here polls a non-blocking request. MPI
progresses a non-blocking collective only inside MPI calls, so the poll must
be frequent: it yields the CPU between tests (other ranks on the same cores
get to run, which matters when ranks outnumber cores) and only after a few
milliseconds without completion falls back to short sleeps. The GIL is
released while yielding or sleeping, so the training thread keeps running.
While it polls, a wait answers the other ranks' questions of where it is
(:mod:`.diagnosis`); when its deadline passes, it asks them, so the error names
the ranks that never came.

MPI calls that have no non-blocking form (communicator splits, group creation,
finalization) run under :meth:`Deadline.guard`: a watchdog thread that ends the
job if the call has not returned by the deadline.
"""
import os
import threading
import time
from contextlib import contextmanager
from datetime import timedelta

from mpi4py import MPI

from ..base.errors import StellaTimeoutError
from . import diagnosis
from .abort import end_job

_YIELD_SECONDS = 5e-3   # poll with sched_yield this long before sleeping
_MAX_SLEEP = 2e-4
_PATIENT_SLEEP = 1e-3   # the longest nap of a patient wait


class Deadline:
    """Waits on requests; raises StellaTimeoutError past ``timeout_s``, naming the ranks of
    ``peers`` (COMM_WORLD ranks the waits involve; all when None) that never came."""

    def __init__(self, timeout_s, rank, peers=None):
        self.timeout_s = timeout_s
        self.rank = rank
        self.peers = peers

    @property
    def grace_s(self):
        """How long a rank whose deadline passed listens for the others' answers."""
        return min(3.0, max(0.5, self.timeout_s / 4))

    def _expired(self, what):
        head = "rank %d: %s did not complete within %.0f s (STELLA_TIMEOUT)" % (self.rank, what, self.timeout_s)
        try:
            peers = self.peers if self.peers is not None else range(MPI.COMM_WORLD.Get_size())
            text, silent = diagnosis.ask(what, peers, self.grace_s)
            error = StellaTimeoutError(head + "; " + text)
            error.silent_ranks = silent
            return error
        except Exception as e:  # noqa: BLE001 - the diagnosis must never stand in the way of the error
            return StellaTimeoutError("%s; a peer has stalled, died or is running a different collective (the "
                                      "ranks could not be asked: %s)" % (head, e))

    def wait(self, req, what, patient=None, watch=None):
        self.wait_all([req], what, patient, watch)

    def wait_all(self, reqs, what, patient=None, watch=None):
        """``patient``: nobody waits on this result soon (an idle negotiation round): a function
        that says when that changes. Until it does, poll with naps instead of yielding in a
        loop, so that a rank with nothing to do leaves the cores to the ranks that compute.
        ``watch()``: called now and then while the wait lasts (it may end the job: a peer is
        known never to come)."""
        reqs = [r for r in reqs if r is not None]
        if not reqs:
            return
        if MPI.Request.Testall(reqs):
            return
        start = time.monotonic()

        def check():
            """Past the deadline: raise, naming who never came; past half a second: answer the
            others' questions of where this rank waits."""
            elapsed = time.monotonic() - start
            if elapsed > self.timeout_s:
                raise self._expired(what)
            if elapsed > 0.5:
                diagnosis.serve(what)
            if watch is not None:
                watch()

        if patient is not None:
            doze = _MAX_SLEEP
            while not patient():
                if MPI.Request.Testall(reqs):
                    return
                check()
                time.sleep(doze)
                doze = min(doze * 2, _PATIENT_SLEEP)
        active = time.monotonic()
        polls, nap = 0, 1e-5
        yield_ = os.sched_yield
        while not MPI.Request.Testall(reqs):
            polls += 1
            if polls & 63:
                yield_()
                continue
            check()
            if time.monotonic() - active < _YIELD_SECONDS:
                yield_()
            else:
                time.sleep(nap)
                nap = min(nap * 2, _MAX_SLEEP)

    @contextmanager
    def guard(self, what):
        """Run a blocking MPI call (one with no request to poll) under a watchdog: if it has not
        returned within the deadline, the job ends, naming ``what`` and the ranks that never
        came. (mpi4py releases the GIL in such calls, so the watchdog thread runs.)"""
        done = threading.Event()

        def watch():
            if not done.wait(self.timeout_s):
                error = self._expired(what)
                if not done.is_set():
                    end_on_timeout(error)
        watcher = threading.Thread(target=watch, name="stella-watchdog", daemon=True)
        watcher.start()
        try:
            yield
        finally:
            done.set()

    def wait_work(self, work, what):
        """Wait on a torch.distributed Work object (gloo/NCCL), polled as wait_all polls MPI, so
        that this rank answers the others' questions of where it waits (a rank blocked inside
        gloo would otherwise be reported as never having come); its own error, if any, raised."""
        self.poll_work(work, what)
        try:
            work.wait(timedelta(seconds=self.timeout_s))
        except RuntimeError as e:
            if "timed out" in str(e).lower() or "timeout" in str(e).lower():
                raise self._expired(what) from e
            raise

    def poll_work(self, work, what):
        """Until ``work.is_completed()``: short naps, answering the others' questions after half
        a second; past the deadline, StellaTimeoutError naming who never came."""
        start, nap = time.monotonic(), 20e-6
        while not work.is_completed():
            elapsed = time.monotonic() - start
            if elapsed > self.timeout_s:
                raise self._expired(what)
            if elapsed > 0.5:
                diagnosis.serve(what)
            time.sleep(nap)
            nap = min(nap * 2, 2e-3)


def end_on_timeout(error):
    """End the job for ``error`` (a StellaTimeoutError), recording the ranks that did not answer."""
    end_job("stella_mpi: %s" % error, cause="deadline", silent=error.silent_ranks)


def world_ranks(comm, ranks):
    """COMM_WORLD's numbers of ``comm``'s ``ranks`` (whom a deadline's diagnosis asks)."""
    group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return list(group.Translate_ranks(list(ranks), world))
    finally:
        group.Free()
        world.Free()
