"""Process sets (Horovod's ``hvd.ProcessSet``): a set of ranks, and once registered, its
communicators, topology, intra-cluster backend and two-level route."""
import logging

import numpy as np
from mpi4py import MPI

from ..comm.deadline import Deadline, world_ranks
from ..comm.hierarchy import Hierarchy
from ..comm.intra import MpiIntra, TorchIntra, gloo_usable, pick_cpu_backend
from ..comm.topology import Communicators, build_topology

log = logging.getLogger("stella_mpi")


class ProcessSet:
    """A set of ranks that run collectives together (Horovod's ``hvd.ProcessSet``).

    Before ``init()`` (or ``add_process_set``) it only holds the rank list; once
    registered it owns its communicators, topology and two-level route."""

    def __init__(self, ranks_or_comm=None):
        self.process_set_id = None
        self._mpi_comm = None
        self.ranks = None
        self.nonfinite_policy = "skip"   # set from the config when the set is built
        if ranks_or_comm is None:
            pass
        elif isinstance(ranks_or_comm, MPI.Comm):
            self._mpi_comm = ranks_or_comm
        else:
            self.ranks = sorted(int(r) for r in ranks_or_comm)
            if len(set(self.ranks)) != len(self.ranks):
                raise ValueError("a process set lists a rank twice: %s" % self.ranks)
        self.comms = None
        self.hierarchy = None
        self.intra = None
        self.deadline = None
        self.is_global = False
        self._world_rank = None

    # -- built collectively by every rank of the world --
    def _build(self, world, config, label_of, is_global, stats, pacer):
        world_rank = world.Get_rank()
        if self.ranks is None:
            self.ranks = list(range(world.Get_size()))
        if any(r < 0 or r >= world.Get_size() for r in self.ranks):
            raise ValueError("process set ranks %s are outside 0..%d" % (self.ranks, world.Get_size() - 1))
        self.is_global = is_global
        self._world_rank = world_rank
        self.nonfinite_policy = config.nonfinite   # what an executor does with a sum that is not finite
        if world_rank not in self.ranks:
            return
        self.deadline = Deadline(config.timeout_s, world_rank, peers=world_ranks(world, self.ranks))
        whole = world.Get_group()
        group = whole.Incl(self.ranks)
        with self.deadline.guard("creating process set %s" % self.ranks):
            comm = world.Create_group(group)
        group.Free()
        whole.Free()
        topo = build_topology(comm, label_of, self.deadline)
        self.comms = Communicators(comm, topo, self.deadline)
        self.intra = self._intra_backend(topo, config)
        self.hierarchy = Hierarchy(self.comms, self.intra, self.deadline, self.ranks, stats, pacer,
                                   config.sparse_algorithm, config.nccl, config.gloo_ifname)

    def _intra_backend(self, topo, config):
        """MPI or gloo inside this rank's cluster: the one the setting names, or the faster."""
        intra = MpiIntra(self.comms.cluster, self.deadline)
        if topo.cluster_size > 1 and config.intra_backend != "mpi" and gloo_usable():
            gloo = TorchIntra(self.comms.cluster, self.deadline, self._cluster_on_one_node(topo), config.gloo_ifname,
                              "gloo")
            if config.intra_backend == "gloo":
                return gloo
            intra, timings = pick_cpu_backend(self.comms.cluster, intra, gloo, self.deadline)
            log.debug("cluster intra backend timings: mpi %.4f s, gloo %.4f s -> %s", timings[0], timings[1],
                      intra.name)
            if intra is not gloo:
                gloo.free()
        elif config.intra_backend == "gloo" and topo.cluster_size > 1:
            raise RuntimeError("STELLA_INTRA_BACKEND=gloo, but this torch build has no gloo")
        return intra

    def _cluster_on_one_node(self, topo):
        nodes = np.zeros(topo.cluster_size, dtype=np.int64)
        self.deadline.wait(self.comms.cluster.Iallgather(np.array([topo.node_id], dtype=np.int64), nodes),
                           "cluster node layout")
        return len(set(nodes.tolist())) == 1

    @property
    def topology(self):
        return self.comms.topo if self.comms else None

    @property
    def nranks(self):
        return len(self.ranks)

    @property
    def set_rank(self):
        """This rank's index in the set (its rank in the set's communicator)."""
        return self.comms.topo.rank

    def size(self):
        """Number of ranks in the set (None before it is registered), as in Horovod."""
        return None if self.process_set_id is None else len(self.ranks)

    def rank(self):
        """This rank's rank within the set (None when not registered or not a member)."""
        return None if self.process_set_id is None or self.comms is None else self.comms.topo.rank

    def included(self):
        """Whether this rank belongs to the set (Horovod's ``ProcessSet.included()``). Ranks
        count in the runtime's world (``init(comm=...)``), or COMM_WORLD before ``init()``."""
        if self.ranks is None:
            return False
        if global_process_set.process_set_id is None:
            return MPI.COMM_WORLD.Get_rank() in self.ranks
        return global_process_set._world_rank in self.ranks

    @property
    def mpi_comm(self):
        return self.comms.comm if self.comms else self._mpi_comm

    def _free(self):
        if self.comms is not None:
            self.hierarchy.free_devices()
            self.intra.free()
            comm = self.comms.comm
            self.comms.free()
            if comm not in (MPI.COMM_WORLD, MPI.COMM_NULL):
                comm.Free()
            self.comms = None
            self.hierarchy = None
            self.intra = None

    def __repr__(self):
        return "ProcessSet(process_set_id=%s, ranks=%s)" % (self.process_set_id, self.ranks)


global_process_set = ProcessSet()
