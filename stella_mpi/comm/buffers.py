"""torch <-> MPI buffer views and the layout of variable-length gathers."""
import numpy as np
import torch


def mpi_view(t):
    """A numpy view of a contiguous CPU tensor that MPI can send or reduce.

    16-bit floats (no MPI type) are viewed as int16: such views may be moved,
    never reduced by MPI (reductions run in float32, see :mod:`.hierarchy`)."""
    if not t.is_contiguous():
        raise ValueError("internal: MPI buffers must be contiguous")
    if t.dtype in (torch.float16, torch.bfloat16):
        return t.view(torch.int16).numpy()
    return t.numpy()


def byte_view(t):
    """The bytes of a contiguous CPU tensor as a uint8 numpy array (for pure data movement)."""
    if t.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return t.contiguous().view(-1).view(torch.uint8).numpy()


def displacements(counts):
    """Start offsets of consecutive pieces of the given lengths."""
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += int(c)
    return out


def split_counts(n, parts):
    """Sizes of ``parts`` consecutive groups of ``n`` items, the first ones larger by one
    (shards of a buffer, rows of a reduce-scatter, ranks of a node's clusters)."""
    q, r = divmod(n, parts)
    return [q + (1 if i < r else 0) for i in range(parts)]
