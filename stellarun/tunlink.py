"""One-way delay on the emulated WAN without netem (``stellarun --wan-delay``).

Each cluster namespace gets a TUN interface instead of a veth to the bridge. The launcher holds
the TUN file descriptors and a :class:`DelayForwarder` thread moves every IPv4 packet that one
cluster sends to the TUN of the cluster owning the destination address, ``delay`` seconds
after it was read. A thread in the launcher rather than a separate process: it cannot outlive
the launcher, and the TUN devices (not persistent) vanish with the launcher's descriptors,
whatever way it exits.

The TUN devices get a large MTU so that a 100 Mbit/s stream is a few hundred packets per second,
which Python forwards easily.
"""
import fcntl
import heapq
import os
import selectors
import socket
import struct
import threading
import time

from .shaping import QUEUE_LIMIT_MS, burst_bytes

_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000
TUN_MTU = 65000
QUEUE_LIMIT_S = QUEUE_LIMIT_MS / 1000.0


def open_tun(name):
    """Create TUN interface ``name`` (in this process's namespace) and return its fd.

    The device is not persistent: it is removed when the fd is closed."""
    if len(name.encode()) > 15:
        raise ValueError("interface name %r is longer than 15 bytes" % name)
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH22x", name.encode(), _IFF_TUN | _IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


class DelayForwarder:
    """Forwards packets between TUN fds by IPv4 destination, each ``delay_s`` after arrival.

    ``routes`` maps a destination address ("10.213.5.2") to the fd of the TUN in the namespace
    that owns it. Packets for unknown destinations and non-IPv4 packets are dropped.

    tbf shapes what a cluster sends; the forwarder shapes what a cluster receives, at
    ``rate_bps`` with ``burst`` bytes of tolerance (a GCRA shaper per destination), so that with
    3+ clusters two senders cannot push more than the link rate into one cluster; a packet that
    would wait longer than QUEUE_LIMIT_S is dropped. A packet
    leaves at max(arrival + delay, the time its destination's link is free, the previous
    packet's leave time for that destination), so packets keep their order also across a rate
    change."""

    def __init__(self, routes, delay_s, rate_bps):
        self.routes = {socket.inet_aton(a): fd for a, fd in routes.items()}
        self.delay_s = float(delay_s)
        self.set_rate(rate_bps)
        self.down = False     # the link is cut (a schedule's "down"): every packet is dropped
        self.forwarded = 0
        self.dropped = 0
        self._wake_r, self._wake_w = os.pipe()
        self._stop = False
        self._thread = None

    def set_rate(self, bps):
        """The shaper's rate and burst (also the tbf burst of the TUN devices: tbf drops packets
        larger than its burst). The schedule calls it while the thread runs."""
        self.burst = max(burst_bytes(bps), 2 * TUN_MTU)
        self.rate_bps = float(bps)

    def start(self):
        self._thread = threading.Thread(target=self._loop, name="stella-wan-delay", daemon=True)
        self._thread.start()
        return self

    def stop(self):
        """Stop the thread (packets still held are dropped, as a cut link would)."""
        self._stop = True
        if self._thread is not None:
            os.write(self._wake_w, b"x")
            self._thread.join(5)
        if self._thread is None or not self._thread.is_alive():
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _loop(self):
        sel = selectors.DefaultSelector()
        for fd in set(self.routes.values()):
            sel.register(fd, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        held = []   # (leave at, seq, out fd, packet): seq keeps arrival order among equal times
        seq = 0
        link_free = {}   # out fd -> GCRA theoretical arrival time of its next packet
        last_leave = {}  # out fd -> leave time of its latest packet
        try:
            while not self._stop:
                timeout = max(0.0, held[0][0] - time.monotonic()) if held else None
                for key, _ in sel.select(timeout):
                    if key.fd == self._wake_r:
                        continue
                    due = time.monotonic() + self.delay_s
                    for _ in range(64):   # a bounded batch, so that due packets are not held up
                        try:
                            pkt = os.read(key.fd, 65536)
                        except BlockingIOError:   # nothing more to read now
                            break
                        except OSError:   # the device is gone (shutting down): stop watching it
                            sel.unregister(key.fd)
                            break
                        out = self.routes.get(pkt[16:20]) if len(pkt) >= 20 and pkt[0] >> 4 == 4 else None
                        if out is None or self.down:
                            self.dropped += 1
                            continue
                        tat = max(link_free.get(out, 0.0), due)
                        leave = max(due, tat - self.burst * 8 / self.rate_bps, last_leave.get(out, 0.0))
                        if leave - due > QUEUE_LIMIT_S:   # a full queue drops, as tbf's does
                            self.dropped += 1
                            continue
                        link_free[out] = tat + len(pkt) * 8 / self.rate_bps
                        last_leave[out] = leave
                        heapq.heappush(held, (leave, seq, out, pkt))
                        seq += 1
                now = time.monotonic()
                while held and held[0][0] <= now:
                    _, _, out, pkt = heapq.heappop(held)
                    if self.down:   # in flight when the link was cut
                        self.dropped += 1
                        continue
                    try:
                        os.write(out, pkt)
                        self.forwarded += 1
                    except OSError:
                        self.dropped += 1
        finally:
            sel.close()
