"""The baseline's process group: torch.distributed gloo over every rank of the MPI job, as a
user of DDP would set it up. Rank 0 picks a free port and tells the others over MPI (the
benchmark's own number, not peer data); the address is rank 0's WAN address under
``stellarun --wan`` and loopback otherwise."""
import os
import socket
from datetime import timedelta

import torch.distributed as dist
from mpi4py import MPI


def init_gloo_world(timeout_s=600):
    comm = MPI.COMM_WORLD
    port = None
    if comm.Get_rank() == 0:
        s = socket.socket()
        s.bind(("", 0))
        port = s.getsockname()[1]
        s.close()
    port = comm.bcast(port, root=0)
    addr = os.environ.get("STELLA_WAN_MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", init_method="tcp://%s:%d" % (addr, port), rank=comm.Get_rank(),
                            world_size=comm.Get_size(), timeout=timedelta(seconds=timeout_s))
