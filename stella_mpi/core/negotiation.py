"""Matching collectives by name across ranks (Horovod's negotiation, without a coordinator).

Ranks may submit collectives in any order. A collective runs once every rank of its process
set has submitted one with that name, and all ranks run the ready ones in one agreed order.
Each negotiation *round* involves every rank of the runtime's world and costs one small
all-reduce:

- **The response cache.** Every (process set, name) that has run once owns a bit, and its
  description is kept. A rank sets the bit when it has that collective pending with the same
  description. It also sets the bit when it is not a member of the set, or when it has joined
  (``hvd.join``). A bitwise AND over the ranks says what is ready everywhere.
- **New descriptions.** A rank that has a collective the cache does not know (or knows with
  another description, or whose input is not finite) says so in a small JSON message. A flag in
  the vector tells every rank whether anybody has something to say, and only then do the
  messages travel, in one allgather. Every rank keeps the same *table* of partly submitted
  names from these messages. A name is complete when every member that has not joined has
  described it. Equal descriptions make it ready; different ones raise the same
  :class:`TensorMismatchError` on every member, naming the ranks and their shapes, and the
  ranks stay in step.

Every rank applies the same messages and results in the same order, so the cache (LRU
eviction included), the table and the order of the ready collectives are identical
everywhere. Nothing is decided by one rank for the others.

The low three bits of the vector are flags, combined by the same AND; the cache's bits follow.
With the default capacity (1020) the vector is 128 bytes: above that, MPICH's non-blocking
allreduce takes two message steps instead of one, which doubles a round's latency over a WAN
(measured: 5.1 against 10.2 ms at 5 ms one-way delay).

- bit 0, *quiet*: the rank has nothing to say;
- bit 1, *stopping*: ``hvd.shutdown``, so the loop ends when all are stopping;
- bit 2, *no report*: the rank wants no stall report (see :meth:`Negotiator.round`).

A rank with nothing pending that has not joined waits for its round patiently (naps instead of
a busy poll) until it has work of its own.
"""
import math

import numpy as np
from mpi4py import MPI

from ..base.errors import CollectiveRefused, NonFiniteGradientError, TensorMismatchError
from ..comm.messages import allgather_json

# as in Horovod, joined ranks contribute zeros to these (and to stella's sparse allreduce)
JOINABLE = ("allreduce", "barrier", "sparse_allreduce")

_QUIET, _STOPPING, _NO_REPORT = 1, 2, 4
_FLAG_BITS = 3   # the flags take the low bits of the vector; the cache's bits follow


def describe(desc):
    """One line naming a collective for error messages."""
    if desc is None:
        return "nothing (joined)"
    parts = [desc.get("kind", "?")] + ([repr(desc["name"])] if desc.get("name") else [])
    for key in ("dtype", "device", "shape", "shapes", "trailing", "op", "root", "prescale", "postscale",
                "compressor", "step"):
        if key in desc:
            parts.append("%s=%s" % (key, desc[key]))
    return " ".join(parts)


class Pending:
    """What the negotiation needs of one locally submitted collective."""
    __slots__ = ("key", "desc", "members", "nonfinite", "said", "since", "op", "bit", "version")

    def __init__(self, key, desc, members, nonfinite, since, op=None):
        self.key = key              # (process set id, name)
        self.desc = desc            # compared by equality (dicts of numbers, strings and lists)
        self.members = members      # world ranks of the process set
        self.nonfinite = nonfinite  # this rank's input holds NaN/Inf
        self.said = False           # its description went out in a message
        self.since = since          # monotonic time of submission
        self.op = op                # what the collective thread runs
        self.bit = None             # its cache bit in the vector (0: goes by description) ...
        self.version = -1           # ... as of this version of the negotiator's cache and table


class _Entry:
    __slots__ = ("key", "desc", "members", "bit", "used")

    def __init__(self, key, desc, members, bit, used):
        self.key, self.desc, self.members, self.bit, self.used = key, desc, members, bit, used


class Ready:
    """A collective every member has submitted: run it (``error`` None) or raise ``error``."""
    __slots__ = ("key", "desc", "members", "joined", "error")

    def __init__(self, key, desc, members, joined, error=None):
        self.key, self.desc, self.members, self.joined, self.error = key, desc, members, joined, error


class Outcome:
    """What one round decided, the same on every rank."""
    __slots__ = ("ready", "all_stopping", "progress", "join_done", "last_joined", "report",
                 "wants_report")

    def __init__(self):
        self.ready = []            # [Ready] in the agreed order
        self.all_stopping = False
        self.progress = False      # anything ready or said: keep cycling fast
        self.join_done = False
        self.last_joined = -1
        self.report = None         # {world rank: [[set id, name], ...]}: what each rank has pending
        self.wants_report = False  # a rank asked for everyone's pending list in the next round


class Negotiator:
    """The agreed state of one runtime: response cache, table of partly submitted names, joined
    ranks. ``comm``: the global process set's communicator (its ranks are the world ranks)."""

    def __init__(self, comm, deadline, capacity, busy=None):
        """``busy()``: whether this rank has work waiting (an idle round then stops dozing)."""
        self.comm = comm
        self.busy = busy or (lambda: False)
        self.deadline = deadline
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.capacity = max(0, int(capacity))
        self.words = math.ceil((_FLAG_BITS + self.capacity) / 64)
        self._occupied = 0    # bits (shifted past the flags) of the cache's entries
        self._outsider = 0    # ... of the entries whose process set this rank is not in
        self.cache = {}                          # key -> _Entry
        self.by_bit = [None] * self.capacity     # bit -> _Entry
        self.table = {}                          # key -> {"members": [...], "descs": {rank: (desc, nonfinite)}}
        self.joined = []                         # world ranks that have joined, in the agreed order
        self.rounds = 0
        self.messages = 0                        # rounds that needed the allgather of descriptions
        self.version = 0   # changes whenever the cache or the table does (a Pending's bit is then re-checked)

    # ---------------- one round ----------------

    def round(self, pending, joining, stopping, want_report, report_now):
        """Run one round. ``pending``: this rank's :class:`Pending` collectives (by key);
        ``joining``: this rank has called ``join()`` and not yet announced it (it is announced in
        this round); ``want_report``: ask every
        rank for its pending list next round (the stall inspector); ``report_now``: the last
        round asked for one, so send it."""
        self.rounds += 1
        joined_me = self.rank in self.joined
        mask = self._occupied if joined_me else self._outsider
        said = []
        version = self.version
        for p in pending.values():
            if p.said:
                continue
            if p.version != version:
                entry = self.cache.get(p.key)
                p.bit = 1 << (entry.bit + _FLAG_BITS) if (
                    entry is not None and entry.members == p.members and not p.nonfinite and p.key not in self.table
                    and entry.desc == p.desc) else 0
                p.version = version
            if p.bit:
                mask |= p.bit
                continue
            said.append([p.key[0], p.key[1], p.members, p.desc, bool(p.nonfinite)])
            p.said = True
        message = {}
        if said:
            message["new"] = said
        if joining:
            message["join"] = True
        if report_now:
            message["pending"] = [list(k) for k in pending]
        flags = 0
        if not message:
            flags |= _QUIET
        if stopping:
            flags |= _STOPPING
        if not want_report:
            flags |= _NO_REPORT
        vec = np.frombuffer((mask | flags).to_bytes(8 * self.words, "little"), dtype=np.uint64).copy()
        out = np.empty_like(vec)
        self.deadline.wait(self.comm.Iallreduce(vec, out, op=MPI.BAND), "negotiation round",
                           patient=self.busy if not (pending or joining or joined_me) else None)
        agreed = int.from_bytes(out.tobytes(), "little")
        head = agreed & ((1 << _FLAG_BITS) - 1)
        result = Outcome()
        result.all_stopping = bool(head & _STOPPING)
        wants_report = not (head & _NO_REPORT)
        messages = None
        if not head & _QUIET:
            self.messages += 1
            messages = allgather_json(self.comm, message, self.deadline, "negotiation messages")
            result.progress = True
        # 1. what the cache says is ready everywhere (bit order; the same list on every rank,
        # entries of sets this rank is not in included, so that fusion decides alike)
        value = (agreed & self._occupied) >> _FLAG_BITS
        while value:
            low = value & -value
            bit = low.bit_length() - 1
            value ^= low
            entry = self.by_bit[bit] if bit < self.capacity else None
            if entry is None:
                continue
            joined = [r for r in entry.members if r in self.joined]
            if len(joined) == len(entry.members):
                continue   # nobody active: set by joined ranks alone
            entry.used = self.rounds
            result.ready.append(self._ready(entry.key, entry.desc, entry.members, len(joined)))
        # 2. the messages, in rank order
        if messages is not None:
            for r, msg in enumerate(messages):
                if not isinstance(msg, dict):
                    raise ValueError("negotiation: malformed message from rank %d: %r" % (r, msg))
                for item in msg.get("new", ()):
                    self._learn(r, item)
                if msg.get("join") and r not in self.joined:
                    self.joined.append(r)
                if "pending" in msg:
                    result.report = result.report or {}
                    result.report[r] = [tuple(k) for k in msg["pending"]]
        # 3. names now described by every active member (table order)
        for key in list(self.table):
            row = self.table[key]
            active = [r for r in row["members"] if r not in self.joined]
            if not active or any(r not in row["descs"] for r in active):
                continue
            del self.table[key]
            self.version += 1
            result.ready.append(self._complete(key, row, active))
        if len(self.joined) == self.size:
            result.join_done = True
            result.last_joined = self.joined[-1]
            self.joined = []
        if result.ready:
            result.progress = True
        result.wants_report = wants_report
        return result

    # ---------------- applying what the round said ----------------

    def _learn(self, r, item):
        try:
            set_id, name, members, desc, nonfinite = item
            key = (int(set_id), str(name))
            members = [int(m) for m in members]
        except (TypeError, ValueError):
            raise ValueError("negotiation: malformed description from rank %d: %r" % (r, item)) from None
        if r not in members or not isinstance(desc, dict):
            raise ValueError("negotiation: rank %d described %r for a set it is not in" % (r, key))
        row = self.table.get(key)
        if row is None:
            row = self.table[key] = {"members": members, "descs": {}}
            self.version += 1
        row["descs"][r] = (desc, bool(nonfinite))

    def _ready(self, key, desc, members, njoined):
        error = None
        if njoined and desc.get("kind") not in JOINABLE:
            error = CollectiveRefused("%s is not supported while %d rank(s) have joined (hvd.join); only allreduce "
                                      "(dense or sparse) and barrier are" % (describe(desc), njoined))
        return Ready(key, desc, members, njoined, error)

    def _complete(self, key, row, active):
        descs = row["descs"]
        njoined = len(row["members"]) - len(active)
        first = descs[active[0]][0]
        if any(descs[r][0] != first for r in active[1:]):
            lines = ["ranks submitted different collectives under the name %r:" % key[1]]
            for r in active:
                lines.append("  rank %d: %s" % (r, describe(descs[r][0])))
            return Ready(key, first, row["members"], njoined, TensorMismatchError("\n".join(lines)))
        bad = [r for r in active if descs[r][1]]
        if bad:
            return Ready(key, first, row["members"], njoined, NonFiniteGradientError(
                "a non-finite gradient (NaN or Inf) on rank %s in %s; refused on every rank"
                % (", ".join(map(str, bad)), describe(first))))
        self._remember(key, first, row["members"])
        return self._ready(key, first, row["members"], njoined)

    def _remember(self, key, desc, members):
        if not self.capacity:
            return
        entry = self.cache.get(key)
        if entry is not None:
            entry.desc, entry.members, entry.used = desc, members, self.rounds
            self._mark(entry)
            return
        if len(self.cache) < self.capacity:
            bit = len(self.cache)
        else:   # the least recently used entry makes room (the same one on every rank)
            victim = min(self.cache.values(), key=lambda e: (e.used, e.bit))
            del self.cache[victim.key]
            bit = victim.bit
        entry = _Entry(key, desc, members, bit, self.rounds)
        self.cache[key] = entry
        self.by_bit[bit] = entry
        self._mark(entry)

    def _mark(self, entry):
        self.version += 1
        b = 1 << (entry.bit + _FLAG_BITS)
        self._occupied |= b
        if self.rank in entry.members:
            self._outsider &= ~b
        else:
            self._outsider |= b

    def pending_names(self, report, members_of):
        """Lines naming, for each collective some ranks have pending, the ranks that have not
        submitted it. ``report``: :attr:`Outcome.report`."""
        holders = {}
        for r, keys in sorted(report.items()):
            for key in keys:
                holders.setdefault(key, []).append(r)
        lines = []
        for key, have in holders.items():
            members = members_of.get(key)
            if members is None:
                row = self.table.get(key)
                entry = self.cache.get(key)
                members = row["members"] if row else entry.members if entry else list(range(self.size))
            active = [r for r in members if r not in self.joined]
            missing = [r for r in active if r not in have]
            if missing:
                lines.append((key, have, missing))
        return lines
