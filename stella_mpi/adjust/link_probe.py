"""A measurement of the link between clusters before the first step (the automatic route's
start): the latency of a tiny exchange, then the bandwidth of exchanges growing 8x at a time
until one takes at least ``TARGET_S`` (or ``MAX_BYTES``), over the same route and pacing the
gradients take (``Hierarchy.cross_reduce`` on the shard communicator: every pair of shard
owners at once, as a step loads the link; the cluster leaders with clusters of unequal size).

Every rank of the set agrees on each round's time (the slowest pair's, one MAX all-reduce),
so every rank takes the next size, and the result, alike. It runs on the collective thread,
as an op of its own, before the optimizer's first collective. The bytes it moves are counted
in ``hvd.stats()`` like any other."""
import time
from dataclasses import dataclass

import numpy as np
import torch
from mpi4py import MPI

from ..api.handles import synchronize
from ..comm.hierarchy import allreduce_bytes
from ..core import state
from ..core.collective_thread import Op

TARGET_S = 0.05            # a round long enough that the latency is small beside it
START_BYTES = 64 << 10
MAX_BYTES = 8 << 20


@dataclass(frozen=True)
class LinkProbe:
    """The link between clusters as measured: bits per second of all pairs of shard owners
    together (they share the link, as a step's exchanges do) and of one pair (the bottleneck),
    the latency of a tiny exchange (seconds), and the bytes of the round the bandwidth came
    from."""
    bandwidth_bps: float
    pair_bps: float
    latency_s: float
    nbytes: int


def execute_link_probe(pset, desc, inputs, joined):
    """Collective thread: the rounds of the module's documentation; returns a LinkProbe."""
    hier = pset.hierarchy
    topo = hier.topo
    comm = pset.comms.shard if topo.uniform_clusters else pset.comms.leaders
    mine = comm is not None and comm != MPI.COMM_NULL

    def round_trip(nbytes):
        """Seconds of one cross-cluster reduction of ``nbytes``, the slowest pair's."""
        took = np.zeros(1)
        if mine:
            buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
            t0 = time.perf_counter()
            hier.cross_reduce(buf, "sum", comm)
            took[0] = time.perf_counter() - t0
        out = np.empty(1)
        pset.deadline.wait(pset.comms.comm.Iallreduce(took, out, op=MPI.MAX), "measuring the link between clusters")
        return float(out[0])

    latency = min(round_trip(16), round_trip(16))
    nbytes = START_BYTES
    while True:
        took = round_trip(nbytes)
        if took - latency >= TARGET_S or nbytes >= MAX_BYTES:
            break
        nbytes = min(8 * nbytes, MAX_BYTES)
    moved = allreduce_bytes(nbytes, topo.num_clusters)
    pair = 8.0 * moved / max(took - latency, 1e-6)
    pairs = topo.cluster_size if topo.uniform_clusters else 1   # the shard owners exchange at once
    return LinkProbe(bandwidth_bps=pair * pairs, pair_bps=pair, latency_s=latency, nbytes=nbytes)


def probe_link(pset):
    """Measure the link of ``pset``'s clusters (collective over the set: every rank calls it at
    the same point, as it builds its optimizer)."""
    rt = state.current("measuring the link between clusters")
    name = rt.auto_name("link_probe", pset)
    return synchronize(rt.collective_thread.submit(Op("link_probe", name, {"kind": "link_probe", "name": name}, (),
                                                      execute_link_probe, pset)))
