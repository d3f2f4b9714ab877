"""Where a long bench is, on stderr: a line when each run starts ("[2/6] 20mbit adapt: started")
and one when it ends, with its elapsed time ("[2/6] 20mbit adapt: done in 84.2 s (bench 171 s
in): held-out loss 2.1032"). stdout keeps the results."""
import sys
import time


class Progress:
    def __init__(self, total):
        self.total = total
        self.index = 0
        self.t0 = time.monotonic()
        self._started = {}

    def _say(self, text):
        try:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            pass

    def start(self, label):
        self.index += 1
        self._started[label] = (self.index, time.monotonic())
        self._say("[%d/%d] %s: started (bench %.0f s in)" % (self.index, self.total, label,
                                                            time.monotonic() - self.t0))

    def end(self, label, note="", failed=False):
        index, t = self._started.pop(label, (self.index, self.t0))
        now = time.monotonic()
        self._say("[%d/%d] %s: %s in %.1f s (bench %.0f s in)%s" % (index, self.total, label,
                                                                    "failed" if failed else "done", now - t,
                                                                    now - self.t0, ": " + note if note else ""))
