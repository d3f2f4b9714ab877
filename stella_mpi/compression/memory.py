"""Error-feedback memory: the residual of every tensor, kept across steps.

A sparse compressor's ``select(tensor, ctx, memory=mem)`` adds the residual
kept under ``ctx.name`` to the gradient, selects from the sum, and leaves what
was not sent in the residual (in place, inside the C kernel).
"""
import threading

import torch

__all__ = ["Memory"]


class Memory:
    """Residuals by tensor name: flat float32 tensors on the device of their gradient
    (CPU or CUDA), created as zeros on first use and updated in place by the selection."""

    def __init__(self):
        self._res = {}
        self._lock = threading.Lock()

    def residual(self, name, numel, device="cpu"):
        """The residual of ``name`` (created as zeros on ``device``). A name reused with another
        size is a new tensor, as in Horovod: its residual starts afresh; one that comes back on
        another device (a model moved) keeps its residual, moved there."""
        device = torch.device(device)
        with self._lock:
            r = self._res.get(name)
            if r is None or r.numel() != numel:
                r = torch.zeros(int(numel), dtype=torch.float32, device=device)
                self._res[name] = r
            elif r.device != device:
                r = r.to(device)
                self._res[name] = r
            return r

    def get(self, name):
        """The residual of ``name`` or None."""
        with self._lock:
            return self._res.get(name)

    def reset(self, name=None):
        """Forget one residual, or all of them."""
        with self._lock:
            if name is None:
                self._res.clear()
            else:
                self._res.pop(name, None)

    def names(self):
        with self._lock:
            return sorted(self._res)

    def __contains__(self, name):
        with self._lock:
            return name in self._res

    def __len__(self):
        with self._lock:
            return len(self._res)

    def state_dict(self):
        """Copies of every residual (for checkpoints)."""
        with self._lock:
            return {k: v.clone() for k, v in self._res.items()}

    def load_state_dict(self, state):
        with self._lock:
            self._res = {k: v.detach().to(torch.float32).contiguous().clone().view(-1) for k, v in state.items()}
