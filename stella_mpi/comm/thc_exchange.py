"""The homomorphic cross-cluster step (``Compression.thc``): one rank per cluster, on the
shard it owns after the intra-cluster reduce-scatter (or the leaders, on the whole buffer)::

    acc = shard + residual, rotated; largest |entry| per block  (compression/thc.py, C kernels)
    agree on the scales: MAX over clusters of (each block's |entry|, NaN seen) -> 4 bytes per
                                                                  block of 2**block_log2 entries
    quantize with those scales into integer lanes (uint64 words) -> lane width from the clusters
    sum the words over clusters: MPI allreduce, MPI_UINT64_T SUM -> reduce-scatter/all-gather,
                                                                  no decode at any hop
    check every lane, decode, rotate back; residual = acc - sent
    shard = sum * scale

The words of every cluster have the same length, so each rank moves about 2 (C-1)/C times its
words (as counted: the ring volume; MPI picks its own algorithm), plus one lane bit per
doubling of the number of clusters C; the sparse all-gather moves C-1 payloads. The lane check
catches words out of range, not every corruption: a peer can still send wrong levels."""
import time

import numpy as np
import torch
from mpi4py import MPI

from .._native import MalformedPayloadError
from ..base import timeline
from ..base.devices import route_for
from ..compression import TensorContext
from .hierarchy import allreduce_bytes
from .sparse_exchange import PeerPayloadError, sender_rank, residual_key




def thc_reduce(hier, host, comp, memory, key, step, seed, comm, kind):
    """Sum the CPU float32 vector ``host`` over the clusters on ``comm`` through ``comp``
    (a THCCompressor), in place; error feedback in ``memory`` unless it is None."""
    n = host.numel()
    nclusters, me = comm.Get_size(), comm.Get_rank()
    ctx = TensorContext(name=key, step=step, shape=(n,), seed=seed)
    dl = hier.deadline
    grad_sq = float(torch.dot(host, host)) if n else 0.0
    t0 = time.perf_counter()
    work = comp.begin(host, ctx, memory)
    t1 = time.perf_counter()
    started = time.monotonic()
    # the block maxima, then the NaN flag: one float32 MAX over the clusters
    agreed = np.append(work.absmax, np.float32(1.0 if work.nonfinite else 0.0)).astype(np.float32)
    dl.wait(comm.Iallreduce(MPI.IN_PLACE, [agreed, MPI.FLOAT], op=MPI.MAX), "THC scales of %r" % key)
    scales, flag = agreed[:-1], float(agreed[-1])
    scale_bytes = allreduce_bytes(agreed.nbytes, nclusters)
    if not (bool(np.isfinite(scales).all()) and bool((scales >= 0).all()) and flag in (0.0, 1.0)):
        bad = int(np.flatnonzero(~(np.isfinite(scales) & (scales >= 0)))[0]) if scales.size and flag in (0.0, 1.0) else -1
        raise PeerPayloadError("THC scales of %r (step %d): the clusters' ranks %s agreed on %s, not finite scales "
                               "and a flag of 0 or 1; a peer sent garbage" % (
                                   key, step, _ranks(hier, comm, kind),
                                   "flag %r" % flag if bad < 0 else "scale %r for block %d" % (float(scales[bad]), bad)))
    if flag:   # some cluster holds a NaN or Inf (the executor refuses the result): nothing is sent
        comp.skip_nonfinite(work, memory)
        host.fill_(float("nan"))
        hier.stats.add(wan_bytes_sent=scale_bytes, wan_bytes_received=scale_bytes, wan_messages=1)
        return
    scales = np.ascontiguousarray(scales)
    words = comp.quantize(work, scales, nclusters, me)
    t2 = time.perf_counter()
    dl.wait(comm.Iallreduce(MPI.IN_PLACE, [words, MPI.UINT64_T], op=MPI.SUM), "THC lanes of %r" % key)
    moved = allreduce_bytes(words.nbytes, nclusters) + scale_bytes
    hier.pacer.pace(moved, started, rounds=2)
    t3 = time.perf_counter()
    try:
        comp.finish(work, words, nclusters, scales, memory)
    except MalformedPayloadError as e:
        raise PeerPayloadError("THC lanes of %r (step %d) summed over ranks %s are out of range (a peer sent "
                               "malformed words): %s" % (key, step, _ranks(hier, comm, kind), e)) from None
    t4 = time.perf_counter()
    timeline.record("ENCODE", t0, t2, compressor=comp.name, bits=comp.bits, bytes=words.nbytes)
    timeline.record("WAN_EXCHANGE", t2, t3, bytes_sent=moved, bytes_received=moved, clusters=nclusters)
    timeline.record("DECODE", t3, t4)
    hier.stats.add(wan_bytes_sent=moved, wan_bytes_received=moved, wan_messages=2, elements=n, entries_sent=n,
                   encode_s=t2 - t0, exchange_s=t3 - t2, decode_s=t4 - t3, select_s=t1 - t0)
    res = memory.get(key) if memory is not None else None
    hier.stats.add_norms(float(torch.dot(res, res)) if res is not None and res.numel() else 0.0, grad_sq)


def _ranks(hier, comm, kind):
    """The ranks behind ``comm``'s positions (for messages)."""
    return [sender_rank(hier, kind, i) for i in range(comm.Get_size())]


def thc_cross_step(hier, comp, memory, name, step, seed, scale):
    """The ``cross`` of :meth:`.hierarchy.Hierarchy.reduce_across_clusters` for a THC
    compressor: the piece becomes the sum over clusters times ``scale``. A CUDA piece crosses
    to the host and back (the kernels and the WAN are the CPU's)."""
    def cross(piece, comm, kind):
        key = residual_key(name, kind, hier.topo)
        if piece.device.type == "cuda":
            route = route_for(piece.device)
            host = route.to_host(piece, "thc")
            thc_reduce(hier, host, comp, memory, key, step, seed, comm, kind)
            route.to_device(host, out=piece)
            route.finish()
        else:
            thc_reduce(hier, piece, comp, memory, key, step, seed, comm, kind)
        if scale != 1.0:
            piece.mul_(scale)
    return cross
