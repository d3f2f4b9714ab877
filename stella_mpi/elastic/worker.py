"""The worker's side of an elastic job: ``hvd.elastic.run`` and the job it runs in.

Under ``stellarun --elastic`` each MPI job is one incarnation of the elastic job. The launcher
gives every rank (environment):

    STELLA_ELASTIC_DIR     this host's node-local directory (commits are written there)
    STELLA_ELASTIC_NOTIFY  a file the launcher rewrites when hosts are added or removed:
                           "<epoch> added|removed"
    STELLA_ELASTIC_EPOCH   the epoch this incarnation started with
    STELLA_ELASTIC_RESETS  how many resets came before it
    HOROVOD_HOSTNAME       the host the rank runs for (HOROVOD_RANK, HOROVOD_SIZE, ... as well)

``run(func)`` then: (1) finds the newest commit on any host (each host's first rank reads its
file; one all-gather picks the newest, ties to the lowest rank), loads it there, calls the reset
callbacks if this incarnation follows a reset, and syncs the state from that rank to all; (2)
calls ``func(state)``; (3) when a collective fails (``HorovodInternalError``: a peer was lost) the
rank leaves with EXIT_RESET and the launcher starts the next incarnation from the last commit,
which is Horovod's "restore and reset"; on ``HostsUpdatedInterrupt`` the current state is saved
first (Horovod keeps it in memory), then the rank leaves the same way. Outside an elastic
launch ``run`` syncs once from rank 0 and calls ``func``; errors propagate (no reset possible).
"""
import functools
import logging
import os
import sys
import time

import torch

from ..base.config import elastic_setting
from ..base.errors import CollectiveRefused, HorovodInternalError, HostsUpdatedInterrupt

log = logging.getLogger("stella_mpi")

EXIT_RESET = 75            # a rank leaving so that the launcher starts the next incarnation
COMMIT_FILE = "commit.pt"

_job = None


class ElasticJob:
    """This incarnation: where commits go, which rank writes them, and what the launcher says."""

    def __init__(self, setting):
        self.dir = setting["dir"]
        self.notify = setting["notify"]
        self.epoch = setting["epoch"]
        self.resets = setting["resets"]
        self.host = setting["host"]
        self.writer = False
        self.last_persist_s = None
        self.started = None   # how the incarnation started (seconds and what was restored)

    @property
    def path(self):
        return os.path.join(self.dir, COMMIT_FILE)

    def read_update(self):
        """"added" / "removed" when the launcher announced a host change after this
        incarnation started, else None."""
        try:
            with open(self.notify) as f:
                fields = f.read().split()
            epoch, kind = int(fields[0]), fields[1]
        except (OSError, ValueError, IndexError):
            return None
        return kind if epoch > self.epoch else None

    def persist(self, state):
        """Write the last saved state to this host's file (the host's first rank only), atomically."""
        if not self.writer:
            return
        t0 = time.perf_counter()
        os.makedirs(self.dir, exist_ok=True)
        tmp = self.path + ".tmp"
        torch.save({"version": 1, "commit": state._commits, "state": state.snapshot()}, tmp)
        os.replace(tmp, self.path)
        self.last_persist_s = time.perf_counter() - t0

    def load(self):
        """(commit number, snapshot) of this host's file, or (-1, None)."""
        if not self.writer or not os.path.exists(self.path):
            return -1, None
        try:
            data = torch.load(self.path, weights_only=False)   # written by this job's own ranks
            return int(data["commit"]), data["state"]
        except Exception as e:   # a torn or foreign file: this host has no usable commit
            log.warning("stella_mpi elastic: ignoring %s (%s)", self.path, e)
            return -1, None

    def start(self, state):
        """Newest commit anywhere -> its rank; reset callbacks; sync from there to all. Once per
        incarnation: a later call of the wrapped function (one per epoch) syncs the state as it
        is in memory, as Horovod does, instead of rolling back to the last commit."""
        from ..api.functions import allgather_object
        from ..api.queries import rank
        if self.started is not None:
            state.sync(0)
            return
        t0, t0_unix = time.perf_counter(), time.time()
        me = rank()
        hosts = allgather_object(self.host, name="elastic.hosts")
        self.writer = hosts.index(self.host) == me
        commit, snap = self.load()
        commits = allgather_object(commit, name="elastic.commits")
        best = max(commits)
        root = commits.index(best) if best >= 0 else 0
        if best >= 0 and me == root:
            state.load_snapshot(snap)
        t1 = time.perf_counter()
        if self.resets:
            state.on_reset()
        state.sync(root)
        t2 = time.perf_counter()
        self.started = {"commit": best, "root": root, "find_s": t1 - t0, "sync_s": t2 - t1, "unix": t0_unix}
        if me == 0:
            print("stella_mpi elastic: incarnation after %d reset(s) on %d host(s): %s in %.3f s (find %.3f s, "
                  "sync %.3f s; started unix %.3f)" % (self.resets, len(set(hosts)), "resumed commit %d from rank %d"
                                                       % (best, root) if best >= 0 else "fresh start", t2 - t0,
                                                       t1 - t0, t2 - t1, t0_unix), flush=True)

    def leave(self, why):
        from ..api.lifecycle import shutdown
        print("stella_mpi elastic: leaving for a reset: %s" % why, flush=True)
        try:
            shutdown()
        except Exception:   # the world may be broken already; the launcher restarts it
            pass
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_RESET)


def current_job():
    """The elastic job this process runs in (``stellarun --elastic``), or None."""
    global _job
    if _job is None:
        setting = elastic_setting()
        if setting is not None:
            _job = ElasticJob(setting)
    return _job


def run(func):
    """Horovod's ``hvd.elastic.run``: ``func(state, ...)`` runs from the newest committed state
    and, under ``stellarun --elastic``, survives lost and added hosts (see the module's text).
    ``func`` must not run collectives before its first use of ``state``."""
    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        job = current_job()
        if job is None:
            state.sync(0)
            return func(state, *args, **kwargs)
        job.start(state)
        try:
            return func(state, *args, **kwargs)
        except CollectiveRefused:
            raise   # every rank refused alike and they are still in step: the program's error, not a lost peer
        except HorovodInternalError as e:
            job.leave("a collective failed (%s); the next incarnation resumes from commit %d"
                      % (str(e).splitlines()[0] if str(e) else type(e).__name__, state._commits))
        except HostsUpdatedInterrupt:
            state.save()
            job.persist(state)
            job.leave("hosts changed; state saved at commit %d" % state._commits)
    return wrapper
