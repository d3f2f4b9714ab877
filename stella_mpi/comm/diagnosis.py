"""Naming the rank that never came.

MPI cannot say which rank a collective waits for. When a wait passes its deadline, the rank
asks the others where they are: it sends a small message on a reserved tag of COMM_WORLD to
every rank it waited for and listens for a few seconds. Every rank that waits with a deadline
answers such questions while it polls (:func:`serve`), and a rank whose own deadline passes asks
too, so the survivors of a job learn which ranks are silent (stalled, dead, or busy outside
stella_mpi's waits) and what the others are waiting in. The answers are untrusted data: parsed
as JSON, shown as text of bounded length. The tag is reserved on COMM_WORLD: a program that
receives with MPI.ANY_TAG on COMM_WORLD itself could take these messages.
"""
import json
import os
import socket
import threading
import time

import numpy as np
from mpi4py import MPI

TAG = 32117          # reserved on COMM_WORLD (every MPI allows tags up to 32767)
MAX_TEXT = 300
_roster = {}         # world rank -> (host, pid), gathered at init
_told = set()        # ranks this process has already told where it waits
_heard = {}          # rank -> where it said it waits (questions and answers alike)
_sends = []          # (request, buffer) of messages in flight: the buffers must outlive the sends
_lock = threading.Lock()   # one thread at a time probes and receives (a probed message is one thread's)


def set_roster(entries):
    """Remember every rank's host and pid (``{COMM_WORLD rank: [host, pid]}``, from ``init()``)."""
    _roster.clear()
    _roster.update({int(r): (str(e[0])[:100], int(e[1])) for r, e in entries.items()})


def stopped_here():
    """'; rank 3 (host h, pid p) is stopped' for the ranks of this host that are stopped now
    (SIGSTOP, a debugger): what a watchdog without MPI can still tell."""
    host, found = socket.gethostname(), []
    for rank, (h, pid) in sorted(_roster.items()):
        if h != host or pid == os.getpid():
            continue
        try:
            with open("/proc/%d/stat" % pid) as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                    found.append(describe_rank(rank))
        except (OSError, IndexError):
            continue
    return "; %s %s stopped" % (", ".join(found), "is" if len(found) == 1 else "are") if found else ""


def describe_rank(rank):
    host_pid = _roster.get(rank)
    return "rank %d" % rank if host_pid is None else "rank %d (host %s, pid %d)" % (rank, host_pid[0], host_pid[1])


def _tell(ranks, where):
    """Send ``where`` to ``ranks`` (each once)."""
    world = MPI.COMM_WORLD
    msg = np.frombuffer(json.dumps({"rank": world.Get_rank(), "host": socket.gethostname(), "pid": os.getpid(),
                                    "where": str(where)[:MAX_TEXT]}).encode(), dtype=np.uint8).copy()
    with _lock:   # (the training thread waits on MPI too: LocalSteps(overlap=True))
        for r in ranks:
            if r not in _told:
                _told.add(r)
                _sends.append((world.Isend([msg, MPI.BYTE], dest=r, tag=TAG), msg))
        _sends[:] = [(req, buf) for req, buf in _sends if not req.Test()]


def _receive_pending():
    """Take every question or answer that has arrived into ``_heard``; returns their senders."""
    world = MPI.COMM_WORLD
    got = []
    status = MPI.Status()
    with _lock:
        while world.Iprobe(source=MPI.ANY_SOURCE, tag=TAG, status=status):
            src, count = status.Get_source(), status.Get_count(MPI.BYTE)
            buf = np.empty(max(count, 0), dtype=np.uint8)
            world.Recv([buf, MPI.BYTE], source=src, tag=TAG)
            try:
                _heard[src] = str(json.loads(buf.tobytes().decode()).get("where", "?"))[:MAX_TEXT]
            except (ValueError, UnicodeDecodeError, AttributeError):
                _heard[src] = "(a garbled answer)"
            got.append(src)
    return got


def serve(where):
    """Answer the ranks that asked where this one waits (called while polling a wait)."""
    if not MPI.Is_initialized() or MPI.Is_finalized():
        return
    asked = _receive_pending()
    if asked:
        _tell(asked, where)


def ask(where, peers, grace_s):
    """Tell every rank where this one waits and listen ``grace_s`` seconds for theirs. Returns
    (text, silent): the text is the finding about ``peers`` (the COMM_WORLD ranks the wait
    involved): the silent ones, then where the others wait; ``silent`` lists every rank of
    COMM_WORLD that did not answer. All are asked, not only the peers, so that a launcher can
    tell a whole cluster cut off by its link (all its ranks silent) from one stalled rank."""
    world = MPI.COMM_WORLD
    me = world.Get_rank()
    everyone = [p for p in range(world.Get_size()) if p != me]
    peers = [p for p in peers if p != me and 0 <= p < world.Get_size()]
    _tell(everyone, where)
    end = time.monotonic() + grace_s
    while True:
        _receive_pending()
        if all(p in _heard for p in everyone) or time.monotonic() >= end:
            break
        time.sleep(0.01)
    silent_anywhere = [p for p in everyone if p not in _heard]
    silent = [p for p in peers if p not in _heard]
    waiting = {}
    for p in peers:
        if p in _heard:
            waiting.setdefault(_heard[p], []).append(p)
    lines = []
    if silent:
        lines.append("%s never came (no answer within %.0f s: stalled, dead, or busy outside stella_mpi's waits; "
                     "a thread that blocks while it holds Python's GIL, as mpi4py's pickle-based comm.allreduce, "
                     "comm.gather and comm.reduce do, stops stella_mpi's collective thread on its rank: use the "
                     "buffer forms, comm.Allreduce ...)" % (", ".join(describe_rank(p) for p in silent), grace_s))
    else:
        lines.append("every peer answered: they wait elsewhere")
    for place, ranks in waiting.items():
        lines.append("  rank(s) %s wait in %s" % (", ".join(str(r) for r in ranks), place))
    return "\n".join(lines), silent_anywhere
