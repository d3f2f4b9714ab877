"""Names of unnamed collectives (Horovod's ``allreduce.noname.N``), counted per kind and process
set, so that ranks outside a set (which never submit its ops) keep the same count as its
members for the others.

Ops are matched by name, so the counts must stay equal on every rank. A rank that has joined
(``hvd.join``) does not submit the ops that the others run meanwhile. When the negotiation
runs one of them, the joined rank's count catches up (:meth:`AutoNames.catch_up`), and its
next unnamed op gets the same name as everyone else's."""
import re
import threading

_AUTO = re.compile(r"^(?P<prefix>.+?)\.(?:set(?P<set>\d+)\.)?noname\.(?P<n>\d+)$")


class AutoNames:
    def __init__(self):
        self._next = {}   # (prefix, process set id) -> next number
        self._lock = threading.Lock()

    def take(self, prefix, set_id):
        with self._lock:
            n = self._next.get((prefix, set_id), 0)
            self._next[(prefix, set_id)] = n + 1
        return "%s.noname.%d" % (prefix, n) if not set_id else "%s.set%d.noname.%d" % (prefix, set_id, n)

    def catch_up(self, name):
        """Another rank's op of this name ran (or was refused) while this rank did not submit it."""
        m = _AUTO.match(name)
        if m is None:
            return
        key = (m.group("prefix"), int(m.group("set") or 0))
        with self._lock:
            if self._next.get(key, 0) <= int(m.group("n")):
                self._next[key] = int(m.group("n")) + 1
