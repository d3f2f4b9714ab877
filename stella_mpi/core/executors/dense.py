"""Executors of the dense collectives: what the collective thread runs for each op.

Each executor is a function of (process set, description, inputs, joined), and each has a
neutral-input builder: the description alone fixes what moves, so a rank that has joined
(``hvd.join``) can take part with neutral inputs.
"""
import numpy as np
import torch

from ...base.devices import route_for
from ...comm.buffers import split_counts
from ...comm.hierarchy import compute_dtype
from ..dtypes import DTYPES, identity
from ..fusion import fuse, scale, unfuse


# ---------------- allreduce (one or a group of tensors) ----------------

def on_device(pset, device, run):
    """Run ``run()`` for tensors of ``device``: on a CUDA device, with the intra-cluster route
    prepared (NCCL or staged), every kernel queued on the device's side stream, and that stream
    finished before returning (base/devices.py); on the CPU, as it is."""
    if device.type != "cuda":
        return run()
    pset.hierarchy.prepare_device(device)
    route = route_for(device)
    with route.context():
        result = run()
    route.finish()
    return result


def execute_allreduce(pset, desc, inputs, joined):
    """inputs: (tensors, outputs). Tensors of one dtype are fused into one buffer (on their
    device: CUDA tensors are reduced there, see :func:`on_device`)."""
    tensors, outputs = inputs
    if desc["op"] == "adasum":
        return _adasum(pset, desc, tensors, outputs)
    return on_device(pset, tensors[0].device, lambda: _allreduce(pset, desc, tensors, outputs))


def _allreduce(pset, desc, tensors, outputs):
    dtype = DTYPES[desc["dtype"]]
    op = desc["op"]
    buf, direct = fuse(tensors, outputs, compute_dtype(dtype), pset.hierarchy.scratch)
    if desc["prescale"] != 1.0:
        scale(buf, desc["prescale"])
    wire = dtype if dtype in (torch.float16, torch.bfloat16) else None   # 16-bit floats cross the WAN at 16 bits
    pset.hierarchy.allreduce(buf, "sum" if op == "average" else op, wire)
    factor = desc["postscale"]
    if op == "average":
        factor = factor / pset.nranks
    if factor != 1.0:
        scale(buf, factor)
    if not direct:
        unfuse(buf, outputs)
    return outputs


def _adasum(pset, desc, tensors, outputs):
    """op=Adasum: each tensor combined on its own (comm/adasum.py), in float64."""
    buf, direct = fuse(tensors, outputs, torch.float64)
    spans, pos = [], 0
    for t in tensors:
        spans.append((pos, pos + t.numel()))
        pos += t.numel()
    if desc["prescale"] != 1.0:
        scale(buf, desc["prescale"])
    pset.hierarchy.adasum(buf, spans)
    if desc["postscale"] != 1.0:
        scale(buf, desc["postscale"])
    if not direct:
        unfuse(buf, outputs)
    return outputs


_JOINED_ON = {"cuda": None}   # the GPU a joined rank trained on (hvd.join records it on the caller's thread)


def record_join_device(index):
    """hvd.join(): the CUDA device index this rank's neutral inputs go on (None: not known)."""
    _JOINED_ON["cuda"] = index


def neutral_device(desc):
    """Where a joined rank builds its neutral inputs: the collective's device kind, on the GPU
    the rank trained on (the collective thread's own current device is cuda:0 whatever the
    caller set)."""
    if desc.get("device") == "cuda":
        index = _JOINED_ON["cuda"]
        return torch.device("cuda", torch.cuda.current_device() if index is None else index)
    return torch.device("cpu")


def neutral_allreduce(desc):
    dtype = DTYPES[desc["dtype"]]
    fill = identity(desc["op"], dtype)
    tensors = [torch.full(tuple(s), fill, dtype=dtype, device=neutral_device(desc)) for s in desc["shapes"]]
    return (tensors, [torch.empty_like(t) for t in tensors])


# ---------------- allgather ----------------

def _exchange_counts(pset, mine, what):
    counts = np.zeros(pset.nranks, dtype=np.int64)
    pset.deadline.wait(pset.comms.comm.Iallgather(np.array([mine], dtype=np.int64), counts), what)
    return counts.tolist()


def execute_allgather(pset, desc, inputs, joined):
    (tensor,) = inputs
    dtype = DTYPES[desc["dtype"]]
    trailing = tuple(desc["trailing"])
    rows = _exchange_counts(pset, tensor.shape[0] if tensor.dim() else 1, "allgather sizes")
    row_bytes = int(np.prod(trailing, dtype=np.int64)) * tensor.element_size()
    data = tensor.contiguous().reshape(-1).view(torch.uint8) if tensor.numel() else torch.empty(0, dtype=torch.uint8)
    out = pset.hierarchy.allgatherv(data, [r * row_bytes for r in rows])
    result = out.view(dtype) if out.numel() else torch.empty(0, dtype=dtype)
    return result.reshape((sum(rows),) + trailing), rows


def neutral_allgather(desc):
    return ([torch.empty((0,) + tuple(desc["trailing"]), dtype=DTYPES[desc["dtype"]])],)


# ---------------- broadcast ----------------

def execute_broadcast(pset, desc, inputs, joined):
    tensor, output = inputs
    root = desc["root"]
    buf = tensor.detach().contiguous().reshape(-1).clone()
    if buf.numel():
        pset.hierarchy.broadcast(buf.view(torch.uint8), pset.ranks.index(root))
    output.reshape(-1).copy_(buf) if output.is_contiguous() else output.copy_(buf.reshape(output.shape))
    return output


def neutral_broadcast(desc):
    t = torch.zeros(tuple(desc["shape"]), dtype=DTYPES[desc["dtype"]])
    return (t, torch.empty_like(t))


# ---------------- alltoall ----------------

def execute_alltoall(pset, desc, inputs, joined):
    tensor, splits = inputs
    dtype = DTYPES[desc["dtype"]]
    trailing = tuple(desc["trailing"])
    row_bytes = int(np.prod(trailing, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
    data = tensor.contiguous().reshape(-1).view(torch.uint8) if tensor.numel() else torch.empty(0, dtype=torch.uint8)
    out, recv_rows = pset.hierarchy.alltoallv(data, [int(s) for s in splits], row_bytes)
    result = out.view(dtype) if out.numel() else torch.empty(0, dtype=dtype)
    return result.reshape((sum(recv_rows),) + trailing), torch.tensor(recv_rows, dtype=torch.int32)


def neutral_alltoall(desc):
    dtype = DTYPES[desc["dtype"]]
    return (torch.empty((0,) + tuple(desc["trailing"]), dtype=dtype), [0] * desc["size"])


# ---------------- reducescatter ----------------

def execute_reducescatter(pset, desc, inputs, joined):
    """A true reduce-scatter (``Hierarchy.reduce_scatter``): each rank receives only its rows of
    dim 0; the first ``rows % size`` ranks get one more."""
    (tensor,) = inputs
    dtype = DTYPES[desc["dtype"]]
    rows = split_counts(tensor.shape[0], pset.nranks)
    row_elems = int(np.prod(tensor.shape[1:], dtype=np.int64))
    # a copy in the compute dtype (reduced in place: never the caller's tensor)
    buf, _ = fuse([tensor.reshape(-1)], [torch.empty(tensor.numel(), dtype=dtype)], compute_dtype(dtype))
    if desc["prescale"] != 1.0:
        scale(buf, desc["prescale"])
    piece = pset.hierarchy.reduce_scatter(buf, [r * row_elems for r in rows], "sum")
    factor = desc["postscale"] / (pset.nranks if desc["op"] == "average" else 1)
    if factor != 1.0:
        scale(piece, factor)
    me = pset.set_rank
    return piece.to(dtype).reshape((rows[me],) + tuple(tensor.shape[1:]))


def neutral_reducescatter(desc):
    dtype = DTYPES[desc["dtype"]]
    return ([torch.full(tuple(desc["shape"]), identity(desc["op"], dtype), dtype=dtype)],)


# ---------------- barrier ----------------

def execute_barrier(pset, desc, inputs, joined):
    pset.hierarchy.barrier()


def neutral_barrier(desc):
    return ()
