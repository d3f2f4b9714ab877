"""What stellarun waits for, said on stderr once when a wait a person would notice begins:
building the emulated WAN, the ranks starting (MPI_Init, hvd.init()), an elastic job waiting
for hosts. ``stellarun --quiet`` leaves them out (errors and the failure report stay)."""
import sys

QUIET = False


def say(text):
    if QUIET:
        return
    try:
        sys.stderr.buffer.write(("stellarun: %s\n" % text).encode(errors="replace"))
        sys.stderr.buffer.flush()
    except (AttributeError, OSError, ValueError):   # (a stderr without a buffer: pytest's capture)
        try:
            sys.stderr.write("stellarun: %s\n" % text)
            sys.stderr.flush()
        except (OSError, ValueError):
            pass


def start_timeout(args, environ):
    """The seconds each rank has to start: --start-timeout, else STELLA_START_TIMEOUT, else the
    job's STELLA_TIMEOUT (--timeout), else stella_mpi's default of 120 s (base/config.py, which
    this package does not import)."""
    for value in (getattr(args, "start_timeout", None), environ.get("STELLA_START_TIMEOUT"),
                  getattr(args, "timeout", None), environ.get("STELLA_TIMEOUT")):
        try:
            if value is not None and float(value) > 0:
                return float(value)
        except ValueError:
            continue
    return 120.0
