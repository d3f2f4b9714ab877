"""User-space WAN emulation of the data path (``stellarun --wan`` without network namespaces):
the one interface through which the cross-cluster sends are paced."""
import time


class Pacer:
    """Stretches a cross-cluster exchange to the time it would take at ``bps`` bits per second,
    plus the one-way ``delay_s`` once per message round. ``bps <= 0``: no pacing (a real link,
    or namespaces shaping it). The runtime builds one from ``Config.wan_pace_bps`` and
    ``Config.wan_pace_delay_s`` (``STELLA_WAN_PACE_BPS``, ``STELLA_WAN_PACE_DELAY_S``)."""

    def __init__(self, bps=0.0, delay_s=0.0):
        self.bps = float(bps)
        self.delay_s = float(delay_s)

    def pace(self, nbytes, started, rounds=1):
        """Sleep until an exchange of ``nbytes`` that began at ``started`` (time.monotonic())
        has taken as long as the emulated link needs (``rounds``: messages that must arrive one
        after the other, e.g. sizes then payload)."""
        if self.bps <= 0 or nbytes <= 0:
            return
        left = nbytes * 8 / self.bps + rounds * self.delay_s - (time.monotonic() - started)
        if left > 0:
            time.sleep(left)
