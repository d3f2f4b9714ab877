"""Small control messages over MPI, as JSON (never pickle: peer data is untrusted)."""
import json

import numpy as np
from mpi4py import MPI

from .buffers import displacements


def allgather_json(comm, obj, deadline, what):
    """Allgather a JSON-able value from every rank."""
    data = np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8)
    lengths = np.zeros(comm.Get_size(), dtype=np.int64)
    deadline.wait(comm.Iallgather(np.array([data.size], dtype=np.int64), lengths), what)
    out = np.empty(int(lengths.sum()), dtype=np.uint8)
    displs = displacements(lengths.tolist())
    deadline.wait(comm.Iallgatherv(data, [out, lengths.tolist(), displs, MPI.BYTE]), what)
    result = []
    for off, n in zip(displs, lengths.tolist()):
        try:
            result.append(json.loads(out[off:off + n].tobytes().decode()))
        except (UnicodeDecodeError, ValueError) as e:
            raise ValueError("%s: malformed message from a peer: %s" % (what, e)) from None
    return result


def bcast_json(comm, obj, root, deadline, what):
    """Broadcast a JSON-able value from ``root``."""
    n = np.zeros(1, dtype=np.int64)
    data = None
    if comm.Get_rank() == root:
        data = np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8).copy()
        n[0] = data.size
    deadline.wait(comm.Ibcast(n, root=root), what)
    if data is None:
        data = np.empty(int(n[0]), dtype=np.uint8)
    deadline.wait(comm.Ibcast(data, root=root), what)
    try:
        return json.loads(data.tobytes().decode())
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError("%s: malformed message from rank %d: %s" % (what, root, e)) from None


def allreduce_max(comm, values, deadline, what):
    """Element-wise maximum of a list of floats over ``comm``."""
    arr = np.asarray(values, dtype=np.float64)
    out = np.empty_like(arr)
    deadline.wait(comm.Iallreduce(arr, out, op=MPI.MAX), what)
    return out.tolist()
