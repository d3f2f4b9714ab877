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
from .._native import thc as thc_kernels
from ..base import timeline
from ..base.devices import route_for
from ..compression import TensorContext
from .hierarchy import allreduce_bytes
from .sparse_exchange import PeerPayloadError, sender_rank, residual_key


THC_MESSAGES = 2   # the scale round, then the words


def thc_bytes(comp, n, nclusters):
    """(bytes of the scale round, bytes of the words) one rank sends (and receives) to sum ``n``
    entries over ``nclusters`` clusters through ``comp``, as counted: each round an allreduce
    (:func:`.hierarchy.allreduce_bytes`) of the float32 block maxima plus the NaN flag, then of
    the uint64 words whose lanes are wide enough for the sum over the clusters."""
    scales = thc_kernels.scale_count(n, comp.block_log2) + 1
    words = thc_kernels.words_for(n, comp.lane_bits(nclusters))
    return allreduce_bytes(4 * scales, nclusters), allreduce_bytes(8 * words, nclusters)


def thc_reduce(hier, host, comp, memory, key, step, seed, comm, kind):
    """Sum the float32 vector ``host`` (CPU, or on the device route a GPU's) over the clusters
    on ``comm`` through ``comp`` (a THCCompressor), in place; error feedback in ``memory``
    unless it is None."""
    n = host.numel()
    nclusters, me = comm.Get_size(), comm.Get_rank()
    ctx = TensorContext(name=key, step=step, shape=(n,), seed=seed)
    dl = hier.deadline
    grad_sq = float(torch.dot(host, host)) if n else 0.0
    t0 = time.perf_counter()
    work = comp.begin(host, ctx, memory, scratch=hier.scratch("thc.rotated", n, torch.float32, host.device))
    t1 = time.perf_counter()
    # the block maxima, then the NaN flag: one MAX over the clusters, on the float32 bit patterns
    # as int32 (for values >= 0 the same order; integer MAX is exact and associative, so a peer's
    # NaN or negative value cannot give ranks different results whatever the reduction order)
    agreed = np.append(work.absmax, np.float32(1.0 if work.nonfinite else 0.0)).astype(np.float32)
    if hier.tamper is not None:
        agreed = hier.tamper(agreed)
    started = time.monotonic()
    dl.wait(comm.Iallreduce(MPI.IN_PLACE, [agreed.view(np.int32), MPI.INT32_T], op=MPI.MAX), "THC scales of %r" % key)
    scale_bytes, word_bytes = thc_bytes(comp, n, nclusters)
    hier.pacer.pace(scale_bytes, started)
    t_scales = time.perf_counter() - t1
    bits = agreed.view(np.int32)
    scales, flag = agreed[:-1], int(bits[-1])
    if not (bool(((bits[:-1] >= 0) & (bits[:-1] < 0x7F800000)).all()) and flag in (0, 0x3F800000)):
        bad = int(np.flatnonzero((bits[:-1] < 0) | (bits[:-1] >= 0x7F800000))[0]) if flag in (0, 0x3F800000) else -1
        raise PeerPayloadError("THC scales of %r (step %d): the clusters' ranks %s agreed on %s, not finite scales "
                               ">= 0 and a flag of 0 or 1; a peer sent garbage" % (
                                   key, step, _ranks(hier, comm, kind),
                                   "flag %r" % float(agreed[-1]) if bad < 0 else
                                   "scale %r for block %d" % (float(scales[bad]), bad)))
    if flag:   # some cluster holds a NaN or Inf (the executor refuses the result): nothing is sent
        comp.skip_nonfinite(work, memory)
        host.fill_(float("nan"))
        hier.stats.add(wan_bytes_sent=scale_bytes, wan_bytes_received=scale_bytes, wan_messages=1,
                       exchange_s=t_scales)
        return
    scales = np.ascontiguousarray(scales)
    words = comp.quantize(work, scales, nclusters, me)
    if isinstance(words, torch.Tensor):   # the device route: only the lanes cross PCIe (pinned)
        words = route_for(words.device).to_host(words, "thc.words").numpy().view(np.uint64)
    t2 = time.perf_counter()
    started = time.monotonic()
    dl.wait(comm.Iallreduce(MPI.IN_PLACE, [words, MPI.UINT64_T], op=MPI.SUM), "THC lanes of %r" % key)
    hier.pacer.pace(word_bytes, started)   # (the quantization between the two rounds is not link time)
    moved = word_bytes + scale_bytes
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
    # exchange: the two rounds (scales, words); encode: begin and quantize, without the scale round
    hier.stats.add(wan_bytes_sent=moved, wan_bytes_received=moved, wan_messages=THC_MESSAGES, elements=n, entries_sent=n,
                   encode_s=t2 - t0 - t_scales, exchange_s=t_scales + t3 - t2, decode_s=t4 - t3, select_s=t1 - t0)
    res = memory.get(key) if memory is not None else None
    hier.stats.add_norms(float(torch.dot(res, res)) if res is not None and res.numel() else 0.0, grad_sq)


def _ranks(hier, comm, kind):
    """The ranks behind ``comm``'s positions (for messages)."""
    return [sender_rank(hier, kind, i) for i in range(comm.Get_size())]


def thc_cross_step(hier, comp, memory, name, step, seed, scale):
    """The ``cross`` of :meth:`.hierarchy.Hierarchy.reduce_across_clusters` for a THC
    compressor: the piece becomes the sum over clusters times ``scale``. A CUDA piece stays on
    its device (compression/device_thc.py, on the route's side stream): the block maxima and the
    integer lanes are all that cross PCIe, and its residual lives on the device."""
    def cross(piece, comm, kind):
        thc_reduce(hier, piece, comp, memory, residual_key(name, kind, hier.topo), step, seed, comm, kind)
        if scale != 1.0:
            piece.mul_(scale)
    return cross
