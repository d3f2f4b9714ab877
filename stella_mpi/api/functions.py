"""Horovod's helpers built on the collectives: parameters, optimizer state and Python objects."""
import io
import pickle

import torch

from ..core import state
from ..core.process_sets import global_process_set
from .allgather import allgather
from .broadcast import broadcast_, broadcast_async_
from .handles import auto_name, synchronize


def broadcast_parameters(params, root_rank, prefix=None):
    """Overwrite ``params`` on every rank with ``root_rank``'s values, in place.

    ``params`` is a ``state_dict()``, or a list of tensors or (name, tensor) pairs
    (``list(model.named_parameters())``)."""
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, list):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError("invalid params of type: %s" % type(params))
    handles = []
    for name, p in items:
        if not isinstance(p, torch.Tensor):
            continue
        full = None if name is None else ("%s.%s" % (prefix, name) if prefix else "broadcast_parameters." + name)
        handles.append(broadcast_async_(p.data if p.requires_grad else p, root_rank, full))
    for h in handles:
        synchronize(h)


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """Return ``root_rank``'s ``obj`` on every rank (serialized with pickle).

    Only for objects from a trusted job: unpickling runs code chosen by the sender. Unnamed, it
    takes the next auto name (Horovod names it by the object's type, which differs between the
    root's object and the others' None, so the ranks waited for each other until the deadline)."""
    name = name or auto_name("broadcast_object", process_set)
    is_root = state.current("hvd.broadcast_object()").rank == root_rank
    if is_root:
        buf = io.BytesIO()
        pickle.dump(obj, buf, protocol=pickle.HIGHEST_PROTOCOL)
        payload = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    broadcast_(size, root_rank, "broadcast_object.%s.sz" % name, process_set)
    if not is_root:
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
    broadcast_(payload, root_rank, "broadcast_object.%s.t" % name, process_set)
    if is_root:
        return obj
    return pickle.loads(payload.numpy().tobytes())


def allgather_object(obj, name=None, process_set=global_process_set):
    """A list with every rank's ``obj`` (pickle; as ``broadcast_object``, for trusted jobs;
    unnamed, the next auto name, not the object's type, which may differ by rank)."""
    name = name or auto_name("allgather_object", process_set)
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    sizes = allgather(torch.tensor([payload.numel()], dtype=torch.int64), "allgather_object.%s.sz" % name,
                      process_set).tolist()
    gathered = allgather(payload, "allgather_object.%s.t" % name, process_set).numpy().tobytes()
    out, pos = [], 0
    for n in sizes:
        out.append(pickle.loads(gathered[pos:pos + n]))
        pos += n
    return out


def broadcast_optimizer_state(optimizer, root_rank, model=None):
    """Make every rank's optimizer state (tensors, step counters and param-group options)
    equal to ``root_rank``'s. A state that is still empty is created first by a zero-gradient
    step, so that every rank has the same tensors to overwrite."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    extra = getattr(optimizer, "_stella_sync_state", None)
    if extra is not None:   # state of stella's own outside torch's per-parameter state (local steps)
        extra(root_rank)
    if getattr(optimizer, "_stella_sharded_state", False):   # all of it was (the CPU engine)
        return
    base = getattr(optimizer, "_stella_base_class", None)
    state_dict = optimizer.state_dict()
    if not state_dict["state"]:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
        if base is not None:
            base.step(optimizer)  # no allreduce: every rank stepped with zeros
        else:
            optimizer.step()
        state_dict = optimizer.state_dict()
    if not state_dict["state"]:
        return

    scalars = {}
    tensors = []
    for gi, group in enumerate(state_dict["param_groups"]):
        for key, value in group.items():
            if key != "params":
                scalars["group.%d.%s" % (gi, key)] = value
    for pid in sorted(state_dict["state"]):
        for key in sorted(state_dict["state"][pid]):
            value = state_dict["state"][pid][key]
            full = "state.%s.%s" % (pid, key)
            if isinstance(value, torch.Tensor):
                tensors.append((full, value))
            else:
                scalars[full] = value
    broadcast_parameters(tensors, root_rank, prefix="broadcast_optimizer_state")
    scalars = broadcast_object(scalars, root_rank, "broadcast_optimizer_state.scalars")
    for gi, group in enumerate(state_dict["param_groups"]):
        for key in list(group):
            if key != "params":
                group[key] = scalars["group.%d.%s" % (gi, key)]
    for pid, st in state_dict["state"].items():
        for key in st:
            full = "state.%s.%s" % (pid, key)
            if full in scalars:
                st[key] = scalars[full]
    optimizer.load_state_dict(state_dict)
