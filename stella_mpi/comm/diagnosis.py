"""Naming the rank that never came.

MPI cannot say which rank a collective waits for. When a wait passes its deadline, the rank
asks the others where they are: it sends a small message on a reserved tag of COMM_WORLD to
every rank it waited for and listens for a few seconds. Every rank that waits with a deadline
answers such questions while it polls (:func:`serve`), and a rank whose own deadline passes asks
too, so the survivors of a job learn which ranks are silent (stalled, dead, or busy outside
stella_mpi) and what the others are waiting in. The answers are untrusted data: bounded in
size, parsed as JSON, shown as text.
"""
import json
import os
import socket
import time

import numpy as np
from mpi4py import MPI

TAG = 32117          # reserved on COMM_WORLD (every MPI allows tags up to 32767)
MAX_BYTES = 4096
_roster = {}         # world rank -> (host, pid), gathered at init
_told = set()        # ranks this process has already told where it waits
_heard = {}          # rank -> where it said it waits (questions and answers alike)


def set_roster(entries):
    """Remember every rank's host and pid (``{COMM_WORLD rank: [host, pid]}``, from ``init()``)."""
    _roster.clear()
    _roster.update({int(r): (str(e[0]), int(e[1])) for r, e in entries.items()})


def describe_rank(rank):
    host_pid = _roster.get(rank)
    return "rank %d" % rank if host_pid is None else "rank %d (host %s, pid %d)" % (rank, host_pid[0], host_pid[1])


def _message(where):
    world = MPI.COMM_WORLD
    return np.frombuffer(json.dumps({"rank": world.Get_rank(), "host": socket.gethostname(), "pid": os.getpid(),
                                     "where": str(where)[:300]}).encode()[:MAX_BYTES], dtype=np.uint8).copy()


def _receive_pending():
    """Every question or answer that has arrived, also kept in ``_heard``: {source rank: text
    of where it waits}."""
    world = MPI.COMM_WORLD
    got = {}
    status = MPI.Status()
    while world.Iprobe(source=MPI.ANY_SOURCE, tag=TAG, status=status):
        src, count = status.Get_source(), status.Get_count(MPI.BYTE)
        buf = np.empty(max(count, 0), dtype=np.uint8)
        world.Recv([buf, MPI.BYTE], source=src, tag=TAG)
        if count > MAX_BYTES:
            got[src] = "(an oversized answer)"
            continue
        try:
            got[src] = str(json.loads(buf.tobytes().decode()).get("where", "?"))[:300]
        except (ValueError, UnicodeDecodeError, AttributeError):
            got[src] = "(a garbled answer)"
    _heard.update(got)
    return got


def serve(where):
    """Answer the ranks that asked where this one waits (called while polling a wait)."""
    if not MPI.Is_initialized() or MPI.Is_finalized():
        return
    asked = _receive_pending()
    if asked:
        msg = _message(where)
        world = MPI.COMM_WORLD
        for src in asked:
            if src not in _told:
                _told.add(src)
                world.Isend([msg, MPI.BYTE], dest=src, tag=TAG)


def ask(where, peers, grace_s):
    """Tell ``peers`` (world ranks) where this rank waits and listen ``grace_s`` seconds for
    theirs. Returns one line per peer: where it waits, or that it did not answer."""
    world = MPI.COMM_WORLD
    me = world.Get_rank()
    peers = [p for p in peers if p != me and 0 <= p < world.Get_size()]
    msg = _message(where)
    for p in peers:
        if p not in _told:
            _told.add(p)
            world.Isend([msg, MPI.BYTE], dest=p, tag=TAG)
    end = time.monotonic() + grace_s
    while True:
        _receive_pending()
        heard = {p: _heard[p] for p in peers if p in _heard}
        if len(heard) == len(peers) or time.monotonic() >= end:
            break
        time.sleep(0.01)
    lines = []
    for p in peers:
        if p in heard:
            lines.append("  %s is waiting in %s" % (describe_rank(p), heard[p]))
        else:
            lines.append("  %s did not answer within %.0f s: it has stalled, died or is busy outside stella_mpi"
                         % (describe_rank(p), grace_s))
    return lines


def silent(lines):
    """The ranks of ``ask``'s answer that did not answer."""
    return [ln.strip().split(" did not answer")[0] for ln in lines if "did not answer" in ln]
