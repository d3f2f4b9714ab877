"""``hvd.barrier`` and ``hvd.join``."""
from ..base.errors import HorovodInternalError
from ..core.collective_thread import Op
from ..core.process_sets import global_process_set
from .handles import auto_name, collective_thread, submit, synchronize
from .validation import checked_process_set


def barrier(process_set=global_process_set):
    """Wait until every rank of the process set has reached the barrier."""
    collective_thread("hvd.barrier")
    pset = checked_process_set(process_set, "hvd.barrier")
    synchronize(submit("barrier", auto_name("barrier", pset), {"kind": "barrier", "name": "barrier"}, (), pset,
                       None))


def join(device=-1):
    """Declare that this rank has no more batches: until every rank has joined it takes part in
    the others' allreduces with zeros (Average still divides by the full size). Returns the
    rank that joined last."""
    thread = collective_thread("hvd.join")
    if thread.negotiator is None and not thread.config.check_collectives:
        raise HorovodInternalError("hvd.join() needs the agreement round; unset STELLA_CHECK_COLLECTIVES=0")
    hid = thread.submit(Op("join", auto_name("join"), {"kind": "join", "name": "join"}, (), None, global_process_set))
    return thread.wait(hid)
