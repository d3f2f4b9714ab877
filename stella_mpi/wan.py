"""WAN emulation for runs on one machine: each cluster's ranks live in their own network
namespace, joined through a bridge by veth pairs shaped with ``tc ... tbf`` in both
directions, so cross-cluster traffic crosses a link of the given rate while traffic inside a
cluster stays in its namespace. Used by ``stellarun --wan``.

With a one-way delay (``--wan-delay``; this kernel has no netem) the namespaces are joined by
TUN interfaces instead, and a forwarder thread of the launcher (:mod:`.tunlink`) carries the
packets between them after the delay; tbf still shapes what each cluster sends.

Needs root (or CAP_NET_ADMIN) and ``ip``/``tc``; :func:`namespaces_available` says whether
they work here. Everything created is named after the launcher's pid and removed by
:meth:`WanEmulation.close`, which the launcher calls on every exit path.
"""
import os
import re
import shutil
import signal
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


_DELAY_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def parse_delay(text):
    """'30ms' -> 0.03 seconds (units us, ms, s; '0' is no delay)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if not m or (unit not in _DELAY_UNITS and not (unit == "" and float(m.group(1)) == 0)):
        raise ValueError("delay %r: use a non-negative number and one of us, ms, s (e.g. 30ms)" % (text,))
    seconds = float(m.group(1)) * _DELAY_UNITS.get(unit, 0.0)
    if seconds > 10:
        raise ValueError("delay %r is more than 10 s" % (text,))
    return seconds


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
    """Namespaces ``stella<pid>c<i>`` with interface ``wan0`` at 10.213.<k>.<i+1>/24.

    ``delay_s`` > 0 joins them through TUN devices and a delaying forwarder instead of a bridge."""

    def __init__(self, nclusters, rate_bps, schedule=None, delay_s=0.0):
        self.pid = os.getpid()
        self.nclusters = nclusters
        self.rate_bps = rate_bps
        self.schedule = schedule or []
        self.delay_s = float(delay_s)
        self.forwarder = None
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
        if self.delay_s > 0:
            return self._setup_tun()
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
        return self._start_schedule()

    def _setup_tun(self):
        """Each namespace's ``wan0`` is a TUN device whose fd the forwarder thread holds."""
        from .tunlink import TUN_MTU, DelayForwarder, open_tun
        try:
            routes = {}
            for c, ns in enumerate(self.namespaces):
                _run(["ip", "netns", "add", ns])
                self._created.append(("netns", ns))
                tun = "stt%d_%d" % (self.pid % 100000, c)
                fd = open_tun(tun)
                self._created.append(("fd", fd))
                routes[self.address(c)] = fd
                _run(["ip", "link", "set", tun, "netns", ns])
                _run(["ip", "-n", ns, "link", "set", tun, "name", "wan0"])
                _run(["ip", "-n", ns, "link", "set", "wan0", "mtu", str(TUN_MTU)])
                _run(["ip", "-n", ns, "addr", "add", self.address(c) + "/24", "dev", "wan0"])
                _run(["ip", "-n", ns, "link", "set", "wan0", "up"])
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])
                self._tcp_buffers(ns)
            self._shape("add", self.rate_bps)
            self.forwarder = DelayForwarder(routes, self.delay_s, self.rate_bps, self._tun_burst(self.rate_bps)).start()
            self._created.append(("forwarder", self.forwarder))
        except Exception:
            self.close()
            raise
        return self._start_schedule()

    def _tcp_buffers(self, ns):
        """TCP must keep a bandwidth-delay product (BDP) in flight. Raise the namespace's limits
        to 4 BDP of the fastest rate of the run, and the initial receive buffer to 2 BDP: with
        the TUN's large MTU the usual 128 KiB start lets one or two segments through per round
        trip, and a 10 MB transfer at 100 Mbit/s over 30 ms reached half the rate."""
        fastest = max([self.rate_bps] + [bps for _, bps in self.schedule])
        bdp = int(fastest / 8 * 2 * self.delay_s)
        for key, start in (("net.ipv4.tcp_rmem", 2 * bdp), ("net.ipv4.tcp_wmem", 0)):
            low, default, high = (int(v) for v in _run(["ip", "netns", "exec", ns, "sysctl", "-n", key]).stdout.split())
            value = "%d %d %d" % (low, max(default, start), max(high, 4 * bdp))
            _run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", "%s=%s" % (key, value)])

    @staticmethod
    def _tun_burst(bps):
        from .tunlink import TUN_MTU
        return max(_burst_bytes(bps), 2 * TUN_MTU)   # tbf drops packets larger than its burst

    def _start_schedule(self):
        if self.schedule:
            self._thread = threading.Thread(target=self._follow_schedule, daemon=True)
            self._thread.start()
        return self

    def _shape(self, verb, bps):
        rate = "%dbit" % int(bps)
        if self.delay_s > 0:
            # TUN mode: tbf shapes what each cluster sends, the forwarder what it receives
            for ns in self.namespaces:
                _run(["ip", "netns", "exec", ns, "tc", "qdisc", verb, "dev", "wan0", "root", "tbf", "rate", rate,
                      "burst", str(self._tun_burst(bps)), "latency", "200ms"])
            if self.forwarder is not None:
                self.forwarder.rate_bps = bps
            return
        burst = str(_burst_bytes(bps))
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
                print("stellarun: WAN rate now %.0f Mbit/s (t=%.0f s, unix time %.3f)" % (bps / 1e6, at, time.time()),
                      flush=True)
            except RuntimeError as e:
                print("stellarun: could not change the WAN rate: %s" % e, flush=True)

    def exec_prefix(self, c):
        """Command prefix that runs a program inside cluster ``c``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[c]]

    def close(self):
        """Remove everything this emulation created (safe to call more than once). Ranks still
        running inside the namespaces (mpirun killed before it could stop them) are killed first."""
        self._stop.set()
        for kind, name in self._created:
            if kind == "netns":
                kill_namespace_processes(name)
        for kind, name in reversed(self._created):
            if kind == "forwarder":
                name.stop()
            elif kind == "fd":
                os.close(name)   # a TUN device goes away with its last fd
            elif kind == "netns":
                _run(["ip", "netns", "del", name], check=False)
            else:
                _run(["ip", "link", "del", name], check=False)
        self._created = []


def kill_namespace_processes(ns):
    """SIGKILL every process in network namespace ``ns``; returns their pids."""
    pids = [int(p) for p in _run(["ip", "netns", "pids", ns], check=False).stdout.split() if p.isdigit()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def leftovers(pid=None):
    """Names of stella namespaces and links still present (for tests and clean-up checks)."""
    ns = _run(["ip", "netns", "list"], check=False).stdout.split()
    links = _run(["ip", "-o", "link", "show"], check=False).stdout
    pat = "stella%d" % pid if pid else "stella"
    found = [n for n in ns if n.startswith(pat)]
    lpat = re.compile(r"\d+: (st(?:br|h|t)%s[^:@]*)" % (str(pid % 100000) if pid else ""))
    found += [m.group(1) for m in lpat.finditer(links)]
    return found


def reap_stale():
    """Remove what launchers that no longer run left behind (a launcher killed with SIGKILL
    cannot clean up after itself). Names carry the launcher's pid (links: pid % 100000);
    nothing whose pid could still be running is touched. Returns what was removed."""
    live = {int(d) for d in os.listdir("/proc") if d.isdigit()}
    live_short = {p % 100000 for p in live}
    removed = []
    for ns in _run(["ip", "netns", "list"], check=False).stdout.split():
        m = re.fullmatch(r"stella(\d+)c\d+", ns)
        if m and int(m.group(1)) not in live:
            kill_namespace_processes(ns)
            _run(["ip", "netns", "del", ns], check=False)
            removed.append(ns)
    links = _run(["ip", "-o", "link", "show"], check=False).stdout
    for m in re.finditer(r"\d+: (st(?:br|h)(\d+)[^:@]*)", links):
        if int(m.group(2)) not in live_short:
            if _run(["ip", "link", "del", m.group(1)], check=False).returncode == 0:
                removed.append(m.group(1))
    return removed
