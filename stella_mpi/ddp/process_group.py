"""torch.distributed's default process group, made from the MPI job stella_mpi runs in: the
rank and size are MPI's, and the rendezvous travels over MPI (no MASTER_ADDR, MASTER_PORT or
init_method from the user), as the gloo groups inside each cluster are made
(:func:`..comm.intra.rendezvous_store`)."""
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from ..api.functions import broadcast_object
from ..api.lifecycle import init, is_initialized
from ..comm.intra import rendezvous_store, store_host
from ..core import state
from ..core.process_sets import global_process_set


def default_backend(ranks_on_host=1):
    """NCCL where every rank of this host has a GPU of its own (DDP's advice; NCCL refuses two
    ranks on one GPU), gloo otherwise."""
    own_gpu = torch.cuda.is_available() and torch.cuda.device_count() >= ranks_on_host
    return "nccl" if own_gpu and dist.is_nccl_available() else "gloo"


def init_process_group(backend=None, timeout=None):
    """Initialise torch.distributed from the MPI job (calling ``hvd.init()`` first if needed):
    ``dist.get_rank() == hvd.rank()`` and ``dist.get_world_size() == hvd.size()``.

    ``backend``: "gloo", "nccl" or any string torch accepts (default: NCCL where every rank of a
    host has a GPU of its own, else gloo; gloo reduces CUDA tensors too). ``timeout``: seconds or a timedelta (default: ``STELLA_TIMEOUT``). The
    store's address is rank 0's: loopback when the job runs on one host, else the address of
    ``STELLA_GLOO_IFNAME`` (``GLOO_SOCKET_IFNAME``, ``stellarun --network-interface``), else the
    host name's. Returns the default process group. Calling it again after a success returns
    the same group; a torch.distributed already initialised some other way is accepted only
    when its rank and size are MPI's."""
    if not is_initialized():
        init()
    rt = state.current("stella_mpi.ddp.init_process_group")
    if dist.is_initialized():
        if dist.get_rank() != rt.rank or dist.get_world_size() != rt.size:
            raise RuntimeError(
                "stella_mpi.ddp.init_process_group: torch.distributed is already initialised as rank %d of %d, "
                "but this is MPI rank %d of %d; initialise it once, with stella_mpi.ddp.init_process_group() "
                "alone" % (dist.get_rank(), dist.get_world_size(), rt.rank, rt.size))
        return dist.group.WORLD
    if timeout is None:
        timeout = timedelta(seconds=rt.config.timeout_s)
    elif not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    pset = global_process_set
    topo = pset.topology
    backend = backend or default_backend(topo.local_size)
    one_host = topo.local_size == rt.size
    ifname = rt.config.gloo_ifname or os.environ.get("GLOO_SOCKET_IFNAME", "")
    host = store_host(one_host, ifname) if rt.rank == 0 else None
    store = rendezvous_store(rt.rank, rt.size, host, timeout,
                             lambda addr: broadcast_object(addr, 0, name="stella_mpi.ddp.rendezvous"))
    dist.init_process_group(backend, store=store, rank=rt.rank, world_size=rt.size, timeout=timeout)
    return dist.group.WORLD
