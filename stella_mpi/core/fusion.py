"""Fusion buffers: several tensors reduced as one flat buffer, and scaling in place."""
import torch


def fuse(tensors, outputs, cdt, scratch=None):
    """(flat buffer in dtype ``cdt``, direct). Direct: one contiguous tensor already in ``cdt``
    is reduced in its output itself, with no fusion buffer and no copy back. ``scratch(slot, n,
    dtype, device)`` (the hierarchy's): the buffer is reused from op to op instead of allocated
    (a fresh 50 MB CPU buffer costs its page faults on every step: the copy into it measured 5x
    a memcpy's time, bench/bench_overhead.py)."""
    if len(tensors) == 1 and tensors[0].dtype == cdt and outputs[0].is_contiguous():
        buf = outputs[0].view(-1)
        if outputs[0] is not tensors[0]:
            buf.copy_(tensors[0].reshape(-1))
        return buf, True
    n = sum(t.numel() for t in tensors)
    if scratch is not None:
        buf = scratch("fusion", n, cdt, tensors[0].device)
    else:
        buf = torch.empty(n, dtype=cdt, device=tensors[0].device)
    if len(tensors) > 8 and all(t.dtype == cdt for t in tensors):   # many small tensors: one kernel
        torch.cat([t.reshape(-1) for t in tensors], out=buf)
        return buf, False
    pos = 0
    for t in tensors:
        buf[pos:pos + t.numel()].copy_(t.reshape(-1))
        pos += t.numel()
    return buf, False


def unfuse(buf, outputs):
    """Copy the reduced buffer back into the outputs (casting to their dtype)."""
    if len(outputs) > 8 and all(o.is_contiguous() and o.dtype == buf.dtype for o in outputs):
        torch._foreach_copy_([o.view(-1) for o in outputs], list(buf.split([o.numel() for o in outputs])))
        return
    pos = 0
    for out in outputs:
        n = out.numel()
        if out.is_contiguous():
            out.view(-1).copy_(buf[pos:pos + n])
        else:
            out.copy_(buf[pos:pos + n].view(out.shape))
        pos += n


def scale(buf, factor):
    """Multiply in place; integer tensors are scaled in float64 and truncated toward zero,
    as Horovod does."""
    if buf.dtype.is_floating_point:
        buf.mul_(factor)
    else:
        buf.copy_((buf.to(torch.float64) * factor).trunc().to(buf.dtype))
