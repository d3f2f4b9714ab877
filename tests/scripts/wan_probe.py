"""Measures cross-cluster and intra-cluster throughput under stellarun --wan (rank 0 prints)."""
import os
import sys
import time

import numpy as np
from mpi4py import MPI

c = MPI.COMM_WORLD
r, n = c.Get_rank(), c.Get_size()
nbytes = int(float(sys.argv[1]) * 1e6) if len(sys.argv) > 1 else 6_250_000
repeat_at = [float(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [0.0]
node_size = c.Split_type(MPI.COMM_TYPE_SHARED).Get_size()
if r == 0:   # MPICH sees each cluster as its own node: shared memory inside it, the link across
    print("rank 0 shares memory with %d ranks" % node_size, flush=True)
buf = np.zeros(nbytes // 8, dtype=np.float64)
start = time.monotonic()
for at in repeat_at:
    while time.monotonic() - start < at:
        time.sleep(0.05)
    for src, dst, what in ((0, 1, "intra"), (0, n - 1, "cross")):
        c.Barrier()
        t0 = time.perf_counter()
        if r == src:
            c.Send(buf, dest=dst)
        elif r == dst:
            c.Recv(buf, source=src)
        c.Barrier()
        dt = time.perf_counter() - t0
        if r == 0:
            print("%s at %.0f s: %.1f Mbit/s mode=%s" % (what, at, nbytes * 8 / dt / 1e6, os.environ.get("STELLA_WAN_MODE")),
                  flush=True)
