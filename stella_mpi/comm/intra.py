"""Collectives inside one cluster, where the network is fast.

Two interchangeable backends over the same cluster membership:

* ``MpiIntra``: MPI non-blocking collectives on the cluster communicator;
* ``TorchIntra``: a torch.distributed process group (gloo for CPU tensors,
  NCCL for CUDA tensors) created without any address or port from the user:
  the cluster leader opens a TCPStore on a free port of the one address the
  members reach it on (loopback when the cluster is one host; never every
  interface), and the address travels to the other members over MPI.

All methods take flat, contiguous tensors in the reduction dtype (see
``hierarchy.compute_dtype``) and return only when the data is in place.
"""
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
from mpi4py import MPI

from .buffers import displacements, mpi_view
from .messages import allreduce_max, bcast_json

MPI_OPS = {"sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "product": MPI.PROD}
TORCH_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX,
             "product": dist.ReduceOp.PRODUCT}


class MpiIntra:
    name = "mpi"
    reduce_scatter_is_allreduce = False   # (each backend says: Hierarchy counts a reduction's time by it)

    def __init__(self, comm, deadline):
        self.comm = comm
        self.deadline = deadline
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()

    def allreduce(self, buf, op):
        self.deadline.wait(self.comm.Iallreduce(MPI.IN_PLACE, mpi_view(buf), op=MPI_OPS[op]),
                           "intra-cluster allreduce")

    def reduce_scatter(self, buf, counts, op, out=None):
        shard = torch.empty(counts[self.rank], dtype=buf.dtype) if out is None else out
        self.deadline.wait(self.comm.Ireduce_scatter(mpi_view(buf), mpi_view(shard), counts, op=MPI_OPS[op]),
                           "intra-cluster reduce-scatter")
        return shard

    def allgather_into(self, shard, counts, out):
        self.deadline.wait(self.comm.Iallgatherv(mpi_view(shard), [mpi_view(out), (counts, displacements(counts))]),
                           "intra-cluster allgather")

    def reduce(self, buf, op, root):
        view = mpi_view(buf)
        send = MPI.IN_PLACE if self.rank == root else view
        self.deadline.wait(self.comm.Ireduce(send, view if self.rank == root else None, op=MPI_OPS[op], root=root),
                           "intra-cluster reduce")

    def bcast(self, buf, root):
        self.deadline.wait(self.comm.Ibcast(mpi_view(buf), root=root), "intra-cluster broadcast")

    def free(self):
        pass


def store_host(members_on_one_node, ifname):
    if members_on_one_node:
        return "127.0.0.1"
    if ifname:
        import fcntl
        import struct
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", ifname[:15].encode()))  # SIOCGIFADDR
            return socket.inet_ntoa(packed[20:24])
        finally:
            s.close()
    return socket.gethostbyname(socket.gethostname())


def rendezvous_store(rank, size, host, timeout, share):
    """A torch.distributed TCPStore for ``size`` ranks, with no address or port from the user:
    rank 0 listens on a free port of ``host`` (its argument; the others pass None), and
    ``share(addr)`` (an MPI broadcast from rank 0: rank 0 passes its address, the others None)
    gives every rank that address. The store listens on that address only (torch's own would
    listen on every address of the machine)."""
    store = None
    if rank == 0:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.bind((host, 0))
            listener.listen(128)
            port = listener.getsockname()[1]
        except OSError:
            listener.close()
            raise
        fd = listener.detach()   # the store owns the socket from then on
        try:
            store = dist.TCPStore(host, port, size, True, timeout=timeout, wait_for_workers=False,
                                  master_listen_fd=fd)
        except BaseException:
            os.close(fd)
            raise
        addr = (host, store.port)
    else:
        addr = None
    host, port = share(addr)
    if store is None:
        store = dist.TCPStore(host, port, size, False, timeout=timeout)
    return store


# dtypes gloo cannot reduce; they go through MPI on the same cluster communicator
_GLOO_UNSUPPORTED = (torch.int16,)


def _with_fallback(method):
    name = method.__name__

    def wrapper(self, buf, *args, **kwargs):
        if buf.dtype in _GLOO_UNSUPPORTED and self.name == "gloo":
            return getattr(self.fallback, name)(buf, *args, **kwargs)
        return method(self, buf, *args, **kwargs)
    wrapper.__name__ = name
    wrapper.__doc__ = method.__doc__
    return wrapper


class TorchIntra:
    """A gloo (or NCCL) process group of one cluster, built over an MPI rendezvous."""
    reduce_scatter_is_allreduce = True   # gloo's wants equal chunks: the whole buffer is reduced

    def __init__(self, comm, deadline, one_node, ifname="", backend="gloo", device=None):
        self.fallback = MpiIntra(comm, deadline)
        self.comm = comm
        self.deadline = deadline
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()
        self.name = backend
        timeout = timedelta(seconds=deadline.timeout_s)
        store = rendezvous_store(self.rank, self.size, store_host(one_node, ifname) if self.rank == 0 else None,
                                 timeout, lambda addr: bcast_json(comm, addr, 0, deadline, "gloo rendezvous"))
        self.store = store
        if backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            if ifname:
                opts._devices = [dist.ProcessGroupGloo.create_device(interface=ifname)]
            elif one_node:
                opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            else:
                opts._devices = [dist.ProcessGroupGloo.create_default_device()]
            self.pg = dist.ProcessGroupGloo(store, self.rank, self.size, opts)
        elif backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            # later than stella's own deadline and its diagnosis: NCCL's watchdog counts from the
            # enqueue and would abort the process with no message naming the rank
            opts._timeout = timeout + timedelta(seconds=deadline.grace_s + 10)
            self.pg = dist.ProcessGroupNCCL(store, self.rank, self.size, opts)
        else:
            raise ValueError("unknown torch.distributed backend %r" % backend)

    def _wait(self, work, what):
        self.deadline.wait_work(work, what)

    @_with_fallback
    def allreduce(self, buf, op):
        opts = dist.AllreduceOptions()
        opts.reduceOp = TORCH_OPS[op]
        self._wait(self.pg.allreduce([buf], opts), "intra-cluster allreduce (%s)" % self.name)

    @_with_fallback
    def reduce_scatter(self, buf, counts, op, out=None):
        # gloo's reduce-scatter wants equal chunks: reduce the whole buffer, keep our shard
        self.allreduce(buf, op)
        start = sum(counts[:self.rank])
        mine = buf[start:start + counts[self.rank]]
        if out is None:
            return mine.clone()
        out.copy_(mine)
        return out

    @_with_fallback
    def allgather_into(self, shard, counts, out):
        width = max(counts) if counts else 0
        padded = torch.zeros(width, dtype=shard.dtype, device=shard.device)
        padded[:shard.numel()] = shard
        outs = [torch.empty(width, dtype=shard.dtype, device=shard.device) for _ in counts]
        self._wait(self.pg.allgather([outs], [padded]), "intra-cluster allgather (%s)" % self.name)
        start = 0
        for c, piece in zip(counts, outs):
            out[start:start + c] = piece[:c]
            start += c

    @_with_fallback
    def reduce(self, buf, op, root):
        opts = dist.ReduceOptions()
        opts.reduceOp = TORCH_OPS[op]
        opts.rootRank = root
        self._wait(self.pg.reduce([buf], opts), "intra-cluster reduce (%s)" % self.name)

    @_with_fallback
    def bcast(self, buf, root):
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        self._wait(self.pg.broadcast([buf], opts), "intra-cluster broadcast (%s)" % self.name)

    def free(self):
        try:
            self.pg.shutdown()
        except Exception:  # noqa: BLE001 - best effort at shutdown
            pass
        self.pg = None
        self.store = None


def gloo_usable():
    return dist.is_available() and hasattr(dist, "ProcessGroupGloo")


def pick_cpu_backend(comm, mpi_intra, gloo_intra, deadline, nbytes=4 << 20, reps=3, small_reps=20):
    """Time both backends on a bucket-sized allreduce (``nbytes``) and on ``small_reps``
    one-element allreduces (latency); the lower total wins. Every rank of the cluster takes
    the same choice (the slowest rank's timings decide); clusters may choose differently.
    Returns (backend, [mpi seconds, gloo seconds])."""
    import time
    n = nbytes // 4
    times = []
    for backend in (mpi_intra, gloo_intra):
        buf = torch.ones(n, dtype=torch.float32)
        tiny = torch.ones(1, dtype=torch.float32)
        backend.allreduce(buf, "sum")  # warm up connections
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            backend.allreduce(buf, "sum")
            best = min(best, time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(small_reps):
            backend.allreduce(tiny, "sum")
        times.append(best + time.perf_counter() - t0)
    agreed = allreduce_max(comm, times, deadline, "intra backend timing")
    return (mpi_intra if agreed[0] <= agreed[1] else gloo_intra), agreed


class NcclIntra(TorchIntra):
    """NCCL inside a cluster whose ranks each have their own GPU (CUDA tensors only). The
    reduce-scatter and all-gather are NCCL's own (equal chunks: uneven shards are padded), so
    each rank's shard is all that lands on it. Waits are bounded by the deadline on the host
    (NCCL's own watchdog comes later, after the deadline's diagnosis)."""

    reduce_scatter_is_allreduce = False

    def __init__(self, comm, deadline, one_node, ifname=""):
        super().__init__(comm, deadline, one_node, ifname, backend="nccl")

    def _wait(self, work, what):
        work.wait()   # the current (side) stream waits for NCCL's
        self.deadline.poll_work(work, what)

    def _padded(self, buf, counts, width):
        if all(c == width for c in counts) and buf.numel() == width * len(counts):
            return buf
        padded = torch.zeros(width * len(counts), dtype=buf.dtype, device=buf.device)
        start = 0
        for r, c in enumerate(counts):
            padded[r * width:r * width + c] = buf[start:start + c]
            start += c
        return padded

    def reduce_scatter(self, buf, counts, op, out=None):
        width = max(counts) if counts else 0
        mine = torch.empty(width, dtype=buf.dtype, device=buf.device)
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = TORCH_OPS[op]
        self._wait(self.pg._reduce_scatter_base(mine, self._padded(buf, counts, width), opts),
                   "intra-cluster reduce-scatter (nccl)")
        mine = mine[:counts[self.rank]]
        if out is None:
            return mine
        out.copy_(mine)
        return out

    def allgather_into(self, shard, counts, out):
        width = max(counts) if counts else 0
        padded = shard
        if shard.numel() != width:
            padded = torch.zeros(width, dtype=shard.dtype, device=shard.device)
            padded[:shard.numel()] = shard
        if all(c == width for c in counts) and out.is_contiguous():
            self._wait(self.pg._allgather_base(out, padded), "intra-cluster allgather (nccl)")
            return
        whole = torch.empty(width * len(counts), dtype=shard.dtype, device=shard.device)
        self._wait(self.pg._allgather_base(whole, padded), "intra-cluster allgather (nccl)")
        start = 0
        for r, c in enumerate(counts):
            out[start:start + c] = whole[r * width:r * width + c]
            start += c


class StagedIntra:
    """CUDA tensors reduced by the CPU backend (MPI or gloo) through pinned host buffers: the
    route of a cluster whose ranks share a GPU (NCCL refuses that) or that has no NCCL. Each
    call copies device-to-host on the route's side stream, runs the host collective and copies
    back; the pinned buffers are reused, so each call finishes its copies before it returns."""

    def __init__(self, host_intra, route):
        self.host = host_intra
        self.route = route
        self.name = "staged+" + host_intra.name

    @property
    def reduce_scatter_is_allreduce(self):
        return self.host.reduce_scatter_is_allreduce

    def _back(self, host, out):
        self.route.to_device(host, out=out)
        self.route.finish()
        return out

    def allreduce(self, buf, op):
        host = self.route.to_host(buf, "intra.in")
        self.host.allreduce(host, op)
        self._back(host, buf)

    def reduce_scatter(self, buf, counts, op, out=None):
        host = self.route.to_host(buf, "intra.in")
        shard = self.host.reduce_scatter(host, counts, op)
        if out is None:
            out = torch.empty(shard.numel(), dtype=buf.dtype, device=buf.device)
        return self._back(shard, out)

    def allgather_into(self, shard, counts, out):
        host = self.route.to_host(shard, "intra.in")
        whole = self.route.host_buffer("intra.out", out.numel(), out.dtype)
        self.host.allgather_into(host, counts, whole)
        self._back(whole, out)

    def reduce(self, buf, op, root):
        host = self.route.to_host(buf, "intra.in")
        self.host.reduce(host, op, root)
        self._back(host, buf)

    def bcast(self, buf, root):
        host = self.route.to_host(buf, "intra.in")
        self.host.bcast(host, root)
        self._back(host, buf)

    def free(self):
        pass


# what NCCL reduces (bool travels as uint8; int16 and the rest go through StagedIntra)
NCCL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int32,
               torch.int64)


def nccl_usable():
    return torch.cuda.is_available() and dist.is_available() and hasattr(dist, "ProcessGroupNCCL") \
        and dist.is_nccl_available()
