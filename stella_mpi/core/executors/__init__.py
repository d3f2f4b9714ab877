"""The table of executors: what the collective thread runs for each kind of op the public API
submits, and the neutral inputs a joined rank (``hvd.join``) contributes.

Ops of other rooms (the CPU engine's update, the adjuster's telemetry) carry their own
executor in the :class:`~stella_mpi.core.collective_thread.Op`; they are never run by a
joined rank. A new collective adds one row here.
"""
from collections import namedtuple

from . import dense
from .sparse import execute_sparse_allreduce, neutral_sparse_allreduce

Executor = namedtuple("Executor", ["run", "neutral"])   # neutral(desc) -> inputs, or None: not joinable

EXECUTORS = {
    "allreduce": Executor(dense.execute_allreduce, dense.neutral_allreduce),
    "allgather": Executor(dense.execute_allgather, dense.neutral_allgather),
    "broadcast": Executor(dense.execute_broadcast, dense.neutral_broadcast),
    "alltoall": Executor(dense.execute_alltoall, dense.neutral_alltoall),
    "reducescatter": Executor(dense.execute_reducescatter, dense.neutral_reducescatter),
    "barrier": Executor(dense.execute_barrier, dense.neutral_barrier),
    "sparse_allreduce": Executor(execute_sparse_allreduce, neutral_sparse_allreduce),
}


def neutral_inputs(desc):
    """(inputs, executor) with which a joined rank takes part in ``desc``."""
    ex = EXECUTORS.get(desc.get("kind"))
    if ex is None or ex.neutral is None:
        raise ValueError("a joined rank cannot take part in a collective of kind %r" % desc.get("kind"))
    return ex.neutral(desc), ex.run
