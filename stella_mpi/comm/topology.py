"""Ranks, nodes and clusters, and the MPI communicators built from them.

Horovod's meanings are kept: ``local_*`` is about the node (ranks sharing
memory), ``cross_*`` about the ranks with the same local rank on other nodes.
The cluster level sits beside them. A cluster's membership comes from the
launcher, never from guessing:

* ``STELLA_CLUSTER=<label>`` on each rank: ranks with the same label form a cluster;
* ``STELLA_CLUSTER_MAP=host=label,...``: ranks on hosts with the same label form a cluster;
* ``STELLA_CLUSTERS=N``: each node's ranks are split into N consecutive groups
  (sizes differ by at most one when N does not divide the node's ranks);
* otherwise one cluster per node.

Clusters are numbered by their lowest rank, so ``cluster_id`` is the same on
every rank whatever the labels are.
"""
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from .buffers import split_counts
from .messages import allgather_json


@dataclass(frozen=True)
class Topology:
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    node_id: int
    cluster_id: int
    num_clusters: int
    cluster_rank: int
    cluster_size: int
    cluster_members: tuple     # cluster_members[c] = the ranks of cluster c, ascending
    cluster_of_rank: tuple     # cluster_of_rank[r] = cluster id of rank r

    @property
    def uniform_clusters(self):
        """All clusters have the same number of ranks (shards line up across clusters)."""
        return len({len(m) for m in self.cluster_members}) == 1


class Communicators:
    """The communicators of one process set. Every rank of ``comm`` builds them collectively
    (splits have no non-blocking form: they run under the deadline's watchdog)."""

    def __init__(self, comm, topo, deadline):
        self.comm = comm
        self.topo = topo
        with deadline.guard("splitting the process set's communicator"):
            self.node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=topo.rank)
            self.cross = comm.Split(color=topo.local_rank, key=topo.rank)
            self.cluster = comm.Split(color=topo.cluster_id, key=topo.rank)
            # cluster leaders, ordered by cluster id: the cross-cluster route for whole buffers
            self.leaders = comm.Split(color=0 if topo.cluster_rank == 0 else MPI.UNDEFINED, key=topo.cluster_id)
            # the ranks owning the same shard in every cluster (only when shards line up)
            if topo.uniform_clusters:
                self.shard = comm.Split(color=topo.cluster_rank, key=topo.cluster_id)
            else:
                comm.Split(color=MPI.UNDEFINED, key=0)  # keep the collective call count equal
                self.shard = None

    def free(self):
        for c in (self.node, self.cross, self.cluster, self.leaders, self.shard):
            if c is not None and c != MPI.COMM_NULL:
                c.Free()
        self.node = self.cross = self.cluster = self.leaders = self.shard = None


def _node_layout(comm, deadline):
    """(node_id, local_rank, local_size) with nodes numbered by their lowest rank."""
    with deadline.guard("node discovery"):
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        local_rank, local_size = node.Get_rank(), node.Get_size()
        lowest = np.zeros(1, dtype=np.int64)
        deadline.wait(node.Iallreduce(np.array([comm.Get_rank()], dtype=np.int64), lowest, op=MPI.MIN),
                      "node discovery")
    finally:
        node.Free()
    every = np.zeros(comm.Get_size(), dtype=np.int64)
    deadline.wait(comm.Iallgather(lowest, every), "node discovery")
    leaders = sorted(set(every.tolist()))
    return leaders.index(int(lowest[0])), local_rank, local_size


def cluster_label(config, node_id, local_rank, local_size):
    """This rank's cluster label from the launcher's settings (see the module docstring)."""
    if config.cluster_label:
        return "label:" + config.cluster_label
    if config.cluster_map:
        import socket
        mapping = {}
        for item in config.cluster_map.split(","):
            host, sep, label = item.strip().partition("=")
            if not sep or not host or not label:
                raise ValueError("STELLA_CLUSTER_MAP entries must be HOST=LABEL, got %r" % item)
            mapping[host] = label
        name = socket.gethostname()
        for candidate in (name, name.split(".")[0]):
            if candidate in mapping:
                return "map:" + mapping[candidate]
        raise ValueError("STELLA_CLUSTER_MAP does not name this host (%s); it names %s"
                         % (name, ", ".join(sorted(mapping))))
    if config.clusters_per_node:
        n = config.clusters_per_node
        if n > local_size:
            raise ValueError("STELLA_CLUSTERS=%d asks for more clusters than the %d ranks on node %d"
                             % (n, local_size, node_id))
        bounds, start = [], 0
        for c in split_counts(local_size, n):
            bounds.append((start, start + c))
            start += c
        group = next(i for i, (a, b) in enumerate(bounds) if a <= local_rank < b)
        return "node:%d/%d" % (node_id, group)
    return "node:%d" % node_id


def build_topology(comm, label_of, deadline):
    """Compute the topology of ``comm``. ``label_of(node_id, local_rank, local_size)`` gives
    this rank's cluster label; labels are gathered so every rank sees the same clusters."""
    rank, size = comm.Get_rank(), comm.Get_size()
    node_id, local_rank, local_size = _node_layout(comm, deadline)
    with deadline.guard("node discovery"):
        cross = comm.Split(color=local_rank, key=rank)
    try:
        cross_rank, cross_size = cross.Get_rank(), cross.Get_size()
    finally:
        cross.Free()
    labels = allgather_json(comm, label_of(node_id, local_rank, local_size), deadline, "cluster discovery")
    kinds = {lab.split(":", 1)[0] for lab in labels}
    if len(kinds) > 1:
        raise ValueError("STELLA_CLUSTER is set on some ranks but not on others; set it on every rank or none")
    first_rank = {}
    for r, lab in enumerate(labels):
        first_rank.setdefault(lab, r)
    ordered = sorted(first_rank, key=first_rank.get)
    cluster_of_rank = tuple(ordered.index(lab) for lab in labels)
    members = tuple(tuple(r for r in range(size) if cluster_of_rank[r] == c) for c in range(len(ordered)))
    cid = cluster_of_rank[rank]
    return Topology(rank=rank, size=size, local_rank=local_rank, local_size=local_size,
                    cross_rank=cross_rank, cross_size=cross_size, node_id=node_id,
                    cluster_id=cid, num_clusters=len(ordered), cluster_rank=members[cid].index(rank),
                    cluster_size=len(members[cid]), cluster_members=members, cluster_of_rank=cluster_of_rank)
