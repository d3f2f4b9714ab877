"""Executors of the dense collectives: what the engine thread runs for each op.

Each executor is a function of (process set, description, inputs, joined):
the description alone fixes what moves, so a rank that has joined can take
part with neutral inputs built by :func:`neutral_inputs`.
"""
import numpy as np
import torch

from .collectives import compute_dtype

DTYPES = {
    "uint8": torch.uint8, "int8": torch.int8, "int16": torch.int16, "int32": torch.int32,
    "int64": torch.int64, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float32": torch.float32, "float64": torch.float64, "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype):
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise TypeError("stella_mpi does not support tensors of dtype %s; supported: %s"
                        % (dtype, ", ".join(DTYPES))) from None


def _identity(op, dtype):
    """The neutral element of ``op`` in ``dtype`` (what a joined rank contributes)."""
    if op in ("sum", "average"):
        return 0
    if op == "product":
        return 1
    if dtype.is_floating_point:
        return float("inf") if op == "min" else float("-inf")
    info = torch.iinfo(dtype)
    return info.max if op == "min" else info.min


# ---------------- allreduce (one or a group of tensors) ----------------

def _scale(buf, factor):
    """Multiply in place; integer tensors are scaled in float64 and truncated toward zero,
    as Horovod does."""
    if buf.dtype.is_floating_point:
        buf.mul_(factor)
    else:
        buf.copy_((buf.to(torch.float64) * factor).trunc().to(buf.dtype))


def fuse(tensors, outputs, cdt):
    """(flat buffer in dtype ``cdt``, direct). Direct: one contiguous tensor already in ``cdt``
    is reduced in its output itself, with no fusion buffer and no copy back."""
    if len(tensors) == 1 and tensors[0].dtype == cdt and outputs[0].is_contiguous():
        buf = outputs[0].view(-1)
        if outputs[0] is not tensors[0]:
            buf.copy_(tensors[0].reshape(-1))
        return buf, True
    buf = torch.empty(sum(t.numel() for t in tensors), dtype=cdt)
    pos = 0
    for t in tensors:
        buf[pos:pos + t.numel()].copy_(t.reshape(-1))
        pos += t.numel()
    return buf, False


def unfuse(buf, outputs):
    """Copy the reduced buffer back into the outputs (casting to their dtype)."""
    pos = 0
    for out in outputs:
        n = out.numel()
        if out.is_contiguous():
            out.view(-1).copy_(buf[pos:pos + n])
        else:
            out.copy_(buf[pos:pos + n].view(out.shape))
        pos += n


def execute_allreduce(pset, desc, inputs, joined):
    """inputs: (tensors, outputs). Tensors of one dtype are fused into one buffer."""
    tensors, outputs = inputs
    dtype = DTYPES[desc["dtype"]]
    cdt = compute_dtype(dtype)
    op = desc["op"]
    base_op = "sum" if op == "average" else op
    buf, direct = fuse(tensors, outputs, cdt)
    if desc["prescale"] != 1.0:
        _scale(buf, desc["prescale"])
    wire = DTYPES[desc["wire"]] if desc.get("wire") else None
    if wire is None and dtype in (torch.float16, torch.bfloat16):
        wire = dtype
    pset.hierarchy.allreduce(buf, base_op, wire)
    scale = desc["postscale"]
    if op == "average":
        scale = scale / pset.nranks
    if scale != 1.0:
        _scale(buf, scale)
    if not direct:
        unfuse(buf, outputs)
    return outputs


def _neutral_allreduce(desc):
    dtype = DTYPES[desc["dtype"]]
    fill = _identity(desc["op"], dtype)
    tensors = [torch.full(tuple(s), fill, dtype=dtype) for s in desc["shapes"]]
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


def _neutral_allgather(desc):
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


def _neutral_broadcast(desc):
    t = torch.zeros(tuple(desc["shape"]), dtype=DTYPES[desc["dtype"]])
    return (t, torch.empty_like(t))


# ---------------- alltoall ----------------

def execute_alltoall(pset, desc, inputs, joined):
    tensor, splits = inputs
    dtype = DTYPES[desc["dtype"]]
    trailing = tuple(desc["trailing"])
    row_bytes = int(np.prod(trailing, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
    data = tensor.contiguous().reshape(-1).view(torch.uint8) if tensor.numel() else torch.empty(0, dtype=torch.uint8)
    out, recv = pset.hierarchy.alltoallv(data, [int(s) * row_bytes for s in splits])
    recv_rows = [r // row_bytes if row_bytes else 0 for r in recv]
    result = out.view(dtype) if out.numel() else torch.empty(0, dtype=dtype)
    return result.reshape((sum(recv_rows),) + trailing), torch.tensor(recv_rows, dtype=torch.int32)


def _neutral_alltoall(desc):
    dtype = DTYPES[desc["dtype"]]
    return (torch.empty((0,) + tuple(desc["trailing"]), dtype=dtype), [0] * desc["size"])


# ---------------- reducescatter ----------------

def reducescatter_rows(rows, size):
    """Rows of dim 0 each rank receives: the first ``rows % size`` ranks get one more."""
    q, r = divmod(rows, size)
    return [q + (1 if i < r else 0) for i in range(size)]


def execute_reducescatter(pset, desc, inputs, joined):
    (tensor,) = inputs
    full = torch.empty_like(tensor)
    execute_allreduce(pset, dict(desc, shapes=[list(tensor.shape)]), ([tensor], [full]), joined)
    counts = reducescatter_rows(tensor.shape[0], pset.nranks)
    me = pset.set_rank
    start = sum(counts[:me])
    return full[start:start + counts[me]].clone()


def _neutral_reducescatter(desc):
    dtype = DTYPES[desc["dtype"]]
    return ([torch.full(tuple(desc["shape"]), _identity(desc["op"], dtype), dtype=dtype)],)


# ---------------- barrier ----------------

def execute_barrier(pset, desc, inputs, joined):
    pset.hierarchy.barrier()


EXECUTORS = {
    "allreduce": (execute_allreduce, _neutral_allreduce),
    "allgather": (execute_allgather, _neutral_allgather),
    "broadcast": (execute_broadcast, _neutral_broadcast),
    "alltoall": (execute_alltoall, _neutral_alltoall),
    "reducescatter": (execute_reducescatter, _neutral_reducescatter),
    "barrier": (execute_barrier, lambda desc: ()),
}


def neutral_inputs(desc):
    """(inputs, executor) with which a joined rank takes part in ``desc``."""
    try:
        execute, neutral = EXECUTORS[desc["kind"]]
    except KeyError:
        raise ValueError("a peer described an unknown collective %r" % desc.get("kind")) from None
    return neutral(desc), execute
