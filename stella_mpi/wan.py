"""WAN emulation for runs on one machine: each cluster's ranks live in their own network
namespace, joined through a bridge by veth pairs shaped with ``tc ... tbf`` in both
directions, so cross-cluster traffic crosses a link of the given rate while traffic inside a
cluster stays in its namespace. Used by ``stellarun --wan``.

Needs root (or CAP_NET_ADMIN) and ``ip``/``tc``; :func:`namespaces_available` says whether
they work here. Everything created is named after the launcher's pid and removed by
:meth:`WanEmulation.close`, which the launcher calls on every exit path.
"""
import os
import re
import shutil
import subprocess
import threading
import time

_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}


def parse_rate(text):
    """'100mbit' -> 100e6 bits per second."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError("rate %r: use a number and one of %s (e.g. 100mbit)" % (text, ", ".join(_UNITS)))
    bps = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if bps <= 0:
        raise ValueError("rate %r must be positive" % text)
    return bps


def parse_schedule(text):
    """'0:500mbit,60:100mbit' -> [(0.0, 500e6), (60.0, 100e6)], times ascending."""
    out = []
    for item in str(text).split(","):
        t, sep, rate = item.strip().partition(":")
        if not sep:
            raise ValueError("schedule entry %r: use SECONDS:RATE, e.g. 60:100mbit" % item)
        out.append((float(t), parse_rate(rate)))
    if [t for t, _ in out] != sorted(t for t, _ in out):
        raise ValueError("schedule times must ascend: %r" % text)
    return out


def _run(cmd, check=True):
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError("%s failed: %s" % (" ".join(cmd), (proc.stderr or proc.stdout).strip()))
    return proc


def namespaces_available():
    """(True, "") when network namespaces and tc can be used here, else (False, why)."""
    if os.geteuid() != 0:
        return False, "not root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, "%s not found (apt-get install iproute2)" % tool
    name = "stprobe%d" % os.getpid()
    proc = _run(["ip", "netns", "add", name], check=False)
    if proc.returncode != 0:
        return False, "ip netns add failed: %s" % proc.stderr.strip()
    _run(["ip", "netns", "del", name], check=False)
    return True, ""


def _burst_bytes(bps):
    # tbf needs at least rate/HZ bytes of burst; more keeps TCP from stalling at high rates
    return max(32 * 1024, int(bps / 8 / 200))


class WanEmulation:
    """Namespaces ``stella<pid>c<i>`` with interface ``wan0`` at 10.213.<k>.<i+1>/24."""

    def __init__(self, nclusters, rate_bps, schedule=None):
        self.pid = os.getpid()
        self.nclusters = nclusters
        self.rate_bps = rate_bps
        self.schedule = schedule or []
        self.subnet = 10 + self.pid % 240
        self.namespaces = ["stella%dc%d" % (self.pid, c) for c in range(nclusters)]
        self.bridge = "stbr%d" % (self.pid % 100000)
        self.host_ifs = ["sth%d_%d" % (self.pid % 100000, c) for c in range(nclusters)]
        self._created = []
        self._stop = threading.Event()
        self._thread = None
        self.changes = []  # (seconds since start, rate) applied by the schedule

    def address(self, c):
        return "10.213.%d.%d" % (self.subnet, c + 1)

    def setup(self):
        try:
            _run(["ip", "link", "add", self.bridge, "type", "bridge"])
            self._created.append(("link", self.bridge))
            _run(["ip", "link", "set", self.bridge, "up"])
            for c, (ns, host_if) in enumerate(zip(self.namespaces, self.host_ifs)):
                _run(["ip", "netns", "add", ns])
                self._created.append(("netns", ns))
                peer = "stn%d_%d" % (self.pid % 100000, c)
                _run(["ip", "link", "add", host_if, "type", "veth", "peer", "name", peer])
                self._created.append(("link", host_if))
                _run(["ip", "link", "set", peer, "netns", ns])
                _run(["ip", "-n", ns, "link", "set", peer, "name", "wan0"])
                _run(["ip", "-n", ns, "addr", "add", self.address(c) + "/24", "dev", "wan0"])
                _run(["ip", "-n", ns, "link", "set", "wan0", "up"])
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])
                _run(["ip", "link", "set", host_if, "master", self.bridge])
                _run(["ip", "link", "set", host_if, "up"])
            self._shape("add", self.rate_bps)
        except Exception:
            self.close()
            raise
        if self.schedule:
            self._thread = threading.Thread(target=self._follow_schedule, daemon=True)
            self._thread.start()
        return self

    def _shape(self, verb, bps):
        burst = str(_burst_bytes(bps))
        rate = "%dbit" % int(bps)
        for ns, host_if in zip(self.namespaces, self.host_ifs):
            # into the cluster (host side egress) and out of it (namespace side egress)
            _run(["tc", "qdisc", verb, "dev", host_if, "root", "tbf", "rate", rate, "burst", burst,
                  "latency", "200ms"])
            _run(["ip", "netns", "exec", ns, "tc", "qdisc", verb, "dev", "wan0", "root", "tbf", "rate", rate,
                  "burst", burst, "latency", "200ms"])

    def _follow_schedule(self):
        start = time.monotonic()
        for at, bps in self.schedule:
            if self._stop.wait(max(0.0, at - (time.monotonic() - start))):
                return
            try:
                self._shape("change", bps)
                self.rate_bps = bps
                self.changes.append((time.monotonic() - start, bps))
                print("stellarun: WAN rate now %.0f Mbit/s (t=%.0f s)" % (bps / 1e6, at), flush=True)
            except RuntimeError as e:
                print("stellarun: could not change the WAN rate: %s" % e, flush=True)

    def exec_prefix(self, c):
        """Command prefix that runs a program inside cluster ``c``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[c]]

    def close(self):
        """Remove everything this emulation created (safe to call more than once)."""
        self._stop.set()
        for kind, name in reversed(self._created):
            if kind == "netns":
                _run(["ip", "netns", "del", name], check=False)
            else:
                _run(["ip", "link", "del", name], check=False)
        self._created = []


def leftovers(pid=None):
    """Names of stella namespaces and links still present (for tests and clean-up checks)."""
    ns = _run(["ip", "netns", "list"], check=False).stdout.split()
    links = _run(["ip", "-o", "link", "show"], check=False).stdout
    pat = "stella%d" % pid if pid else "stella"
    found = [n for n in ns if n.startswith(pat)]
    lpat = re.compile(r"\d+: (st(?:br|h)%s[^:@]*)" % (str(pid % 100000) if pid else ""))
    found += [m.group(1) for m in lpat.finditer(links)]
    return found


def reap_stale():
    """Remove what launchers that no longer run left behind (a launcher killed with SIGKILL
    cannot clean up after itself). Names carry the launcher's pid; returns what was removed."""
    removed = []
    for ns in _run(["ip", "netns", "list"], check=False).stdout.split():
        m = re.fullmatch(r"stella(\d+)c\d+", ns)
        if m and not os.path.exists("/proc/%s" % m.group(1)):
            _run(["ip", "netns", "del", ns], check=False)   # takes its veth pair with it
            removed.append(ns)
            bridge = "stbr%d" % (int(m.group(1)) % 100000)
            if _run(["ip", "link", "del", bridge], check=False).returncode == 0:
                removed.append(bridge)
    return removed
