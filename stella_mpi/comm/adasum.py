"""Adasum (Maleki et al., "Scaling Distributed Training with Adaptive Summation", MLSys 2021),
Horovod's ``op=hvd.Adasum``.

Two vectors combine as::

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

so orthogonal gradients add up, and parallel ones are averaged. Each tensor of a group is
combined on its own, with its own dot products. The ranks of a communicator combine in a
binary tree over their rank order: (0, 1), (2, 3), ..., then (01, 23), and so on. This is the
tree Horovod's recursive halving computes. Here it is reached by recursive doubling, where
every rank exchanges its whole vector at each level. Both partners compute
``adasum(lower rank's, higher rank's)``, so the result is identical on every rank, bit for
bit.

For a number of ranks that is not a power of two, the ranks above the largest power of two
``p`` first hand their vector to rank ``r - p``, which combines it with its own, and receive the
result at the end. Horovod requires a power of two; this is an extension.

The arithmetic is in float64: dot products, norms and the combination alike.
"""
import torch

from .buffers import mpi_view

_TAG = 78


def combine(a, b, spans):
    """adasum(a, b) for each tensor of flat float64 buffers ``a``, ``b``. ``spans``: [(start, end)]."""
    out = torch.empty_like(a)
    for start, end in spans:
        x, y = a[start:end], b[start:end]
        dot = float(torch.dot(x, y))
        nx = float(torch.dot(x, x))
        ny = float(torch.dot(y, y))
        cx = 1.0 if nx == 0.0 else 1.0 - dot / (2.0 * nx)
        cy = 1.0 if ny == 0.0 else 1.0 - dot / (2.0 * ny)
        torch.add(x * cx, y, alpha=cy, out=out[start:end])
    return out


def reference(vectors, spans):
    """The tree over the vectors in rank order, in one process (tests check against it)."""
    vs = [v.to(torch.float64) for v in vectors]
    n = len(vs)
    p = 1
    while p * 2 <= n:
        p *= 2
    for r in range(p, n):
        vs[r - p] = combine(vs[r - p], vs[r], spans)
    vs = vs[:p]
    while len(vs) > 1:
        vs = [combine(vs[i], vs[i + 1], spans) for i in range(0, len(vs), 2)]
    return vs[0]


def adasum_allreduce(buf, spans, comm, deadline):
    """Replace ``buf`` (flat float64, this rank's vector) by the Adasum of every rank's over
    ``comm``, in place. ``spans``: each tensor's [start, end) in ``buf``."""
    n = comm.Get_size()
    if n == 1 or buf.numel() == 0:
        return
    me = comm.Get_rank()
    p = 1
    while p * 2 <= n:
        p *= 2
    other = torch.empty_like(buf)

    def exchange(peer, send, recv, what):
        reqs = []
        if send is not None:
            reqs.append(comm.Isend(mpi_view(send), dest=peer, tag=_TAG))
        if recv is not None:
            reqs.append(comm.Irecv(mpi_view(recv), source=peer, tag=_TAG))
        deadline.wait_all(reqs, what)

    if me >= p:   # folded in: hand the vector over, get the result back
        exchange(me - p, buf, None, "Adasum: folding in")
        exchange(me - p, None, buf, "Adasum: the result")
        return
    if me + p < n:
        exchange(me + p, None, other, "Adasum: folding in")
        buf.copy_(combine(buf, other, spans))
    distance = 1
    while distance < p:
        peer = me ^ distance
        exchange(peer, buf, other, "Adasum: level %d" % distance.bit_length())
        lower, higher = (buf, other) if me < peer else (other, buf)
        buf.copy_(combine(lower, higher, spans))
        distance *= 2
    if me + p < n:
        exchange(me + p, buf, None, "Adasum: the result")
