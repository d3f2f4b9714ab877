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

from .shaping import LINK_DOWN, QUEUE_LIMIT_MS, burst_bytes
from .tunlink import TUN_MTU, DelayForwarder, open_tun

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


def _tbf(bps, forwarder):
    """tc arguments of a tbf at ``bps``; with a TUN forwarder, its (larger) burst."""
    burst = forwarder.burst if forwarder is not None else burst_bytes(bps)
    return ["tbf", "rate", "%dbit" % int(bps), "burst", str(burst), "latency", "%dms" % QUEUE_LIMIT_MS]


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
        self.down = False   # cut by the schedule ("SECONDS:down")
        self.subnet = 10 + self.pid % 240
        self.namespaces = ["stella%dc%d" % (self.pid, c) for c in range(nclusters)]
        self.bridge = "stbr%d" % self.pid
        self.host_ifs = ["sth%d_%d" % (self.pid, c) for c in range(nclusters)]
        self._created = []
        self._stop = threading.Event()
        self._thread = None
        self.changes = []  # (seconds since start, rate) applied by the schedule

    def address(self, c):
        return "10.213.%d.%d" % (self.subnet, c + 1)

    def setup(self):
        """Create the namespaces and the link (veth + bridge, or TUN + forwarder with a delay);
        on any failure or interruption, remove what was made so far."""
        try:
            if self.delay_s > 0:
                self._setup_tun()
            else:
                self._setup_bridge()
        except BaseException:
            self.close()
            raise
        if self.schedule:
            self._thread = threading.Thread(target=self._follow_schedule, daemon=True)
            self._thread.start()
        return self

    def _hosts_file(self, ns):
        """``/etc/netns/NS/hosts``, which ``ip netns exec`` puts over /etc/hosts inside the
        namespace: this machine's entries plus the loopback's IPv6 and IPv4-mapped forms and every
        cluster's WAN address. Without them a reverse lookup of a peer's address goes to DNS, which
        this machine may not reach: torch's c10d store then warns "The hostname of the client socket
        cannot be retrieved" for every connection (and waits for the resolver)."""
        folder = os.path.join(NETNS_ETC, ns)
        os.makedirs(folder, exist_ok=True)
        self._created.append(("netns-etc", folder))
        try:
            with open("/etc/hosts") as f:
                base = f.read()
        except OSError:
            base = "127.0.0.1 localhost\n"
        lines = [base.rstrip("\n"), "# added by stellarun for the emulated WAN",
                 "::1 localhost ip6-localhost", "::ffff:127.0.0.1 localhost"]
        for c in range(self.nclusters):
            lines += ["%s stella-wan%d" % (self.address(c), c), "::ffff:%s stella-wan%d" % (self.address(c), c)]
        with open(os.path.join(folder, "hosts"), "w") as f:
            f.write("\n".join(lines) + "\n")

    def _add_namespace(self, c, dev):
        """Namespace of cluster ``c`` with ``dev`` (made in this namespace) moved in as ``wan0``."""
        ns = self.namespaces[c]
        _run(["ip", "netns", "add", ns])
        self._created.append(("netns", ns))
        try:
            self._hosts_file(ns)
        except OSError as e:
            print("stellarun: no hosts file for namespace %s (%s): reverse lookups may go to DNS" % (ns, e), flush=True)
        _run(["ip", "link", "set", dev, "netns", ns])
        _run(["ip", "-n", ns, "link", "set", dev, "name", "wan0"])
        _run(["ip", "-n", ns, "addr", "add", self.address(c) + "/24", "dev", "wan0"])
        _run(["ip", "-n", ns, "link", "set", "wan0", "up"])
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        return ns

    def _setup_bridge(self):
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        self._created.append(("link", self.bridge))
        _run(["ip", "link", "set", self.bridge, "up"])
        for c, host_if in enumerate(self.host_ifs):
            peer = "stn%d_%d" % (self.pid, c)
            _run(["ip", "link", "add", host_if, "type", "veth", "peer", "name", peer])
            self._created.append(("link", host_if))
            self._add_namespace(c, peer)
            _run(["ip", "link", "set", host_if, "master", self.bridge])
            _run(["ip", "link", "set", host_if, "up"])
        self._shape("add", self.rate_bps)

    def _setup_tun(self):
        """Each namespace's ``wan0`` is a TUN device whose fd the forwarder thread holds."""
        routes = {}
        for c in range(self.nclusters):
            tun = "stt%d_%d" % (self.pid, c)
            fd = open_tun(tun)
            self._created.append(("fd", fd))
            routes[self.address(c)] = fd
            ns = self._add_namespace(c, tun)
            _run(["ip", "-n", ns, "link", "set", "wan0", "mtu", str(TUN_MTU)])
            self._tcp_buffers(ns)
        self.forwarder = DelayForwarder(routes, self.delay_s, self.rate_bps).start()
        self._created.append(("forwarder", self.forwarder))
        self._shape("add", self.rate_bps)

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

    def _shape(self, verb, bps):
        """tbf at ``bps`` on what each cluster sends (its ``wan0``) and, with the bridge, on what
        it receives (the host side of its veth); with TUN devices the forwarder shapes that."""
        if self.forwarder is not None:
            self.forwarder.set_rate(bps)
        for ns in self.namespaces:
            _run(["ip", "netns", "exec", ns, "tc", "qdisc", verb, "dev", "wan0", "root"] + _tbf(bps, self.forwarder))
        if self.forwarder is None:
            for host_if in self.host_ifs:
                _run(["tc", "qdisc", verb, "dev", host_if, "root"] + _tbf(bps, None))

    def _cut(self, down):
        """Cut every cluster's link (``down``) or restore it: the host side of each veth leaves
        the bridge (what a cluster sends goes nowhere) or, with TUN devices, the forwarder drops
        every packet. Each namespace's ``wan0`` stays up with its carrier, as a host's interface
        does when a link further away fails: MPI can still start on it (a cluster alone needs
        no WAN), connections stay open, and TCP retransmits once the link is back."""
        if self.forwarder is not None:
            self.forwarder.down = down
        else:
            for host_if in self.host_ifs:
                _run(["ip", "link", "set", host_if] + (["nomaster"] if down else ["master", self.bridge]))
        self.down = down

    def _follow_schedule(self):
        start = time.monotonic()
        for at, bps in self.schedule:
            if self._stop.wait(max(0.0, at - (time.monotonic() - start))):
                return
            try:
                if bps == LINK_DOWN:
                    self._cut(True)
                    print("stellarun: WAN link down (t=%.0f s, unix time %.3f): cross-cluster packets are dropped "
                          "until the schedule's next entry" % (at, time.time()), flush=True)
                else:
                    was_down = self.down
                    if was_down:
                        self._cut(False)
                    self._shape("change", bps)
                    self.rate_bps = bps
                    print("stellarun: WAN rate now %.0f Mbit/s%s (t=%.0f s, unix time %.3f)"
                          % (bps / 1e6, ", the link is up again" if was_down else "", at, time.time()), flush=True)
                self.changes.append((time.monotonic() - start, bps))
            except RuntimeError as e:
                print("stellarun: could not change the WAN link: %s" % e, flush=True)

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
                print("stellarun: WAN delay forwarder: %d packets forwarded, %d dropped (queue over %d ms, "
                      "unknown destination or not IPv4)" % (name.forwarded, name.dropped, QUEUE_LIMIT_MS), flush=True)
            elif kind == "fd":
                os.close(name)   # a TUN device goes away with its last fd
            elif kind == "netns":
                _run(["ip", "netns", "del", name], check=False)
            elif kind == "netns-etc":
                shutil.rmtree(name, ignore_errors=True)
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


# what an emulation creates, named after its launcher's pid: namespaces stella<pid>c<i>, links
# stbr<pid> (bridge), sth<pid>_<i> (veth, host side); TUN devices stt<pid>_<i> leave with their fds
_NS_RE = re.compile(r"stella(\d+)c\d+")
NETNS_ETC = "/etc/netns"   # ip netns exec mounts NETNS_ETC/<namespace>/<file> over /etc/<file>
_LINK_RE = re.compile(r"\d+: (st(?:br|h|t)(\d+)(?:_\d+)?)[@:]")


def _made():
    """[(name, kind, launcher pid)] of every namespace and link an emulation made that exists now."""
    out = []
    for ns in _run(["ip", "netns", "list"], check=False).stdout.split():
        m = _NS_RE.fullmatch(ns)
        if m:
            out.append((ns, "netns", int(m.group(1))))
    for m in _LINK_RE.finditer(_run(["ip", "-o", "link", "show"], check=False).stdout):
        out.append((m.group(1), "link", int(m.group(2))))
    return out


def leftovers(pid=None):
    """Names of stella namespaces and links still present, of launcher ``pid`` or of any (for
    tests and clean-up checks)."""
    return [name for name, _, owner in _made() if pid is None or owner == pid]


def reap_stale():
    """Remove what launchers that no longer run left behind (a launcher killed with SIGKILL
    cannot clean up after itself): processes still in their namespaces, the namespaces (which
    takes their veth pairs along) and their bridges. Returns what was removed."""
    removed = []
    for name, kind, owner in _made():
        if os.path.exists("/proc/%d" % owner):
            continue
        if kind == "netns":
            kill_namespace_processes(name)
            _run(["ip", "netns", "del", name], check=False)
            shutil.rmtree(os.path.join(NETNS_ETC, name), ignore_errors=True)
        elif _run(["ip", "link", "del", name], check=False).returncode != 0:
            continue   # went with its namespace
        removed.append(name)
    # hosts files whose namespace is gone (a launcher killed between removing the two)
    if os.path.isdir(NETNS_ETC):
        for name in os.listdir(NETNS_ETC):
            m = _NS_RE.fullmatch(name)
            if m and not os.path.exists("/proc/%d" % int(m.group(1))):
                shutil.rmtree(os.path.join(NETNS_ETC, name), ignore_errors=True)
                removed.append(os.path.join(NETNS_ETC, name))
    return removed
