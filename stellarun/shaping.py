"""The emulated link's numbers: rates, delays and rate schedules as written on the command line,
and the shaping constants shared by tc's tbf and the delay forwarder."""
import re

_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}


def _parse_quantity(text, units, what, example):
    """'<number><unit>' -> number * units[unit]; a clear ValueError otherwise."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in units:
        raise ValueError("%s %r: use a non-negative number and one of %s (e.g. %s)"
                         % (what, text, ", ".join(units), example))
    return float(m.group(1)) * units[m.group(2).lower()]


def parse_rate(text):
    """'100mbit' -> 100e6 bits per second."""
    bps = _parse_quantity(text, _UNITS, "rate", "100mbit")
    if bps <= 0:
        raise ValueError("rate %r must be positive" % text)
    return bps


LINK_DOWN = 0.0   # a schedule's rate while the link is down ("SECONDS:down")


def parse_schedule(text):
    """'0:500mbit,60:100mbit' -> [(0.0, 500e6), (60.0, 100e6)], times ascending; 'down' as a
    rate cuts the link (LINK_DOWN) until the next entry, e.g. '30:down,40:100mbit'."""
    out = []
    for item in str(text).split(","):
        t, sep, rate = item.strip().partition(":")
        if not sep:
            raise ValueError("schedule entry %r: use SECONDS:RATE, e.g. 60:100mbit (or 60:down)" % item)
        try:
            at = float(t)
        except ValueError:
            raise ValueError("schedule entry %r: %r is not a number of seconds" % (item, t))
        if at < 0:
            raise ValueError("schedule entry %r: the time must be >= 0" % item)
        out.append((at, LINK_DOWN if rate.strip().lower() == "down" else parse_rate(rate)))
    if [t for t, _ in out] != sorted(t for t, _ in out):
        raise ValueError("schedule times must ascend: %r" % text)
    return out


_DELAY_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def parse_delay(text):
    """'30ms' -> 0.03 seconds (units us, ms, s; '0' is no delay)."""
    if re.fullmatch(r"\s*0*\.?0*\s*", str(text)) and "0" in str(text):
        return 0.0
    seconds = _parse_quantity(text, _DELAY_UNITS, "delay", "30ms")
    if seconds > 10:
        raise ValueError("delay %r is more than 10 s" % (text,))
    return seconds


def burst_bytes(bps):
    """tbf's burst at ``bps`` (also the delay forwarder's shaper)."""
    # tbf needs at least rate/HZ bytes of burst; more keeps TCP from stalling at high rates
    return max(32 * 1024, int(bps / 8 / 200))


QUEUE_LIMIT_MS = 200   # the longest a packet may wait for the link (tbf's latency, the forwarder's limit)
