"""Under stellarun --wan: an allreduce across clusters, then rank 0 prints the median round
trip of 1-byte MPI messages to the last rank (another cluster) and to rank 1 (its own)."""
import statistics
import sys
import time

import numpy as np
import torch
from mpi4py import MPI

import stella_mpi as hvd

hvd.init()
total = hvd.allreduce(torch.full((1000,), float(hvd.rank())), op=hvd.Sum, name="x")
expect = sum(range(hvd.size()))
if not torch.equal(total, torch.full((1000,), float(expect))):
    sys.exit("rank %d: allreduce gave %s, expected %s" % (hvd.rank(), total[:4], expect))
c = MPI.COMM_WORLD
r, n = c.Get_rank(), c.Get_size()
buf = np.zeros(1, dtype=np.uint8)
for peer, what in ((n - 1, "cross"), (1, "intra")):
    rtts = []
    for _ in range(6):
        c.Barrier()
        t0 = time.perf_counter()
        if r == 0:
            c.Send(buf, dest=peer)
            c.Recv(buf, source=peer)
        elif r == peer:
            c.Recv(buf, source=0)
            c.Send(buf, dest=0)
        rtts.append((time.perf_counter() - t0) * 1e3)
    if r == 0:
        print("%s rtt ms: %.1f" % (what, statistics.median(rtts[1:])), flush=True)
if r == 0:
    print("allreduce ok: %s" % expect, flush=True)
