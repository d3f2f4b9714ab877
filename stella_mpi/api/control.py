"""``hvd.barrier`` and ``hvd.join``."""
import torch

from ..base.errors import HorovodInternalError
from ..core.collective_thread import Op
from ..core.executors.dense import record_join_device
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
    # the GPU of the zeros this rank sends while joined: Horovod's ``device``, else the one the
    # caller's thread uses (CUDA ops of the others go through there)
    if isinstance(device, bool) or not isinstance(device, int):
        raise ValueError("hvd.join(device=...) takes a CUDA device index, or -1, not %r" % (device,))
    record_join_device(device if device >= 0 else
                       torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized()
                       else None)
    hid = thread.submit(Op("join", auto_name("join"), {"kind": "join", "name": "join"}, (), None, global_process_set))
    return thread.wait(hid)
