"""Process-wide state: ``init``/``shutdown``, process sets and the capability queries.

The state is one explicit object (:class:`Runtime`) created by ``init()``;
the module-level functions of the Horovod API read it through
:func:`current`, which raises Horovod's error when ``init()`` was not called.
"""
import atexit
import logging
import sys
import threading

import torch
from mpi4py import MPI

from .collectives import Hierarchy
from .config import Config
from .engine import Engine
from .errors import NotInitializedError
from .intra import MpiIntra, TorchIntra, gloo_usable, pick_cpu_backend
from .ops import neutral_inputs
from .compression.memory import Memory
from .stats import WanStats
from .topology import Communicators, build_topology, cluster_label
from .transport import Deadline

log = logging.getLogger("stella_mpi")


class ProcessSet:
    """A set of ranks that run collectives together (Horovod's ``hvd.ProcessSet``).

    Before ``init()`` (or ``add_process_set``) it only holds the rank list; once
    registered it owns its communicators, topology and two-level route."""

    def __init__(self, ranks_or_comm=None):
        self.process_set_id = None
        self._mpi_comm = None
        self.ranks = None
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
        self.deadline = None
        self.is_global = False
        self.tamper = None  # tests only: a function applied to this rank's outgoing sparse payloads
        self.sparse_algorithm = "auto"  # cross-cluster sum of selections: auto, allgather or tree

    # -- built collectively by every rank of the world --
    def _build(self, world, config, label_of, is_global):
        world_rank = world.Get_rank()
        if self.ranks is None:
            self.ranks = list(range(world.Get_size()))
        if any(r < 0 or r >= world.Get_size() for r in self.ranks):
            raise ValueError("process set ranks %s are outside 0..%d" % (self.ranks, world.Get_size() - 1))
        group = world.Get_group().Incl(self.ranks)
        comm = world.Create_group(group) if world_rank in self.ranks else MPI.COMM_NULL
        group.Free()
        self.is_global = is_global
        if comm == MPI.COMM_NULL:
            return
        self.deadline = Deadline(config.timeout_s, world_rank)
        topo = build_topology(comm, label_of, self.deadline)
        self.comms = Communicators(comm, topo)
        intra = MpiIntra(self.comms.cluster, self.deadline)
        if topo.cluster_size > 1 and config.intra_backend != "mpi" and gloo_usable():
            one_node = self._cluster_on_one_node(topo)
            gloo = TorchIntra(self.comms.cluster, self.deadline, one_node, config.gloo_ifname, "gloo")
            if config.intra_backend == "gloo":
                intra = gloo
            else:
                intra, timings = pick_cpu_backend(self.comms.cluster, intra, gloo, self.deadline)
                log.debug("cluster intra backend timings: mpi %.4f s, gloo %.4f s -> %s", timings[0], timings[1],
                          intra.name)
                if intra is not gloo:
                    gloo.free()
        elif config.intra_backend == "gloo" and topo.cluster_size > 1:
            raise RuntimeError("STELLA_INTRA_BACKEND=gloo, but this torch build has no gloo")
        self.intra = intra
        self.hierarchy = Hierarchy(self.comms, intra, self.deadline)

    def _cluster_on_one_node(self, topo):
        import numpy as np
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
        """Whether this rank belongs to the set (Horovod's ``ProcessSet.included()``)."""
        if self.ranks is None:
            return False
        return MPI.COMM_WORLD.Get_rank() in self.ranks if _runtime is None else _runtime.rank in self.ranks

    @property
    def mpi_comm(self):
        return self.comms.comm if self.comms else self._mpi_comm

    def _free(self):
        if self.comms is not None:
            self.intra.free()
            comm = self.comms.comm
            self.comms.free()
            if comm not in (MPI.COMM_WORLD, MPI.COMM_NULL):
                comm.Free()
            self.comms = None

    def __repr__(self):
        return "ProcessSet(process_set_id=%s, ranks=%s)" % (self.process_set_id, self.ranks)


global_process_set = ProcessSet()


class Runtime:
    """Everything ``init()`` creates; torn down by ``shutdown()``."""

    def __init__(self, comm, process_sets):
        self.config = Config.from_env()
        logging.basicConfig()
        log.setLevel(self.config.log_level.upper() if self.config.log_level.upper() in
                     ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL") else "WARNING")
        if comm is None:
            comm = MPI.COMM_WORLD
        elif isinstance(comm, (list, tuple)):
            world = MPI.COMM_WORLD
            ranks = sorted(comm)
            group = world.Get_group().Incl(ranks)
            comm = world.Create_group(group)
            group.Free()
        self.world = comm.Dup()
        self.rank = self.world.Get_rank()
        self.size = self.world.Get_size()
        cfg = self.config
        label_of = lambda node_id, lr, ls: cluster_label(cfg, node_id, lr, ls)  # noqa: E731
        self.label_of = label_of
        global_process_set.ranks = list(range(self.size))
        global_process_set._build(self.world, cfg, label_of, is_global=True)
        global_process_set.sparse_algorithm = cfg.sparse_algorithm
        global_process_set.process_set_id = 0
        self.process_sets = {0: global_process_set}
        self.engine = Engine(self.rank, cfg, neutral_inputs)
        self.wan_stats = WanStats()
        self.sparse_memory = Memory()   # error-feedback residuals of hvd.allreduce(..., compression=sparse)
        self.sparse_steps = {}
        global_process_set.hierarchy.stats = self.wan_stats
        for ps in process_sets or []:
            self.add_process_set(ps)
        topo = global_process_set.topology
        log.debug("rank %d: node %d (local %d/%d), cluster %d/%d (cluster rank %d/%d), intra backend %s",
                  self.rank, topo.node_id, topo.local_rank, topo.local_size, topo.cluster_id,
                  topo.num_clusters, topo.cluster_rank, topo.cluster_size, global_process_set.intra.name)

    def add_process_set(self, ps):
        if not isinstance(ps, ProcessSet):
            ps = ProcessSet(ps)
        if ps.process_set_id is not None:
            raise ValueError("%r is already registered" % ps)
        if ps._mpi_comm is not None:
            # a communicator names its members; gather them as world ranks
            import numpy as np
            sub = ps._mpi_comm
            mine = np.array([self.rank], dtype=np.int64)
            members = np.zeros(sub.Get_size(), dtype=np.int64)
            sub.Allgather(mine, members)
            ps.ranks = sorted(members.tolist())
        existing = [p for p in self.process_sets.values() if p.ranks == ps.ranks]
        if existing:
            raise ValueError("a process set with ranks %s already exists (id %d)" % (ps.ranks, existing[0].process_set_id))
        ps._build(self.world, self.config, self.label_of, is_global=False)
        if ps.hierarchy is not None:
            ps.hierarchy.stats = self.wan_stats
        ps.process_set_id = max(self.process_sets) + 1
        self.process_sets[ps.process_set_id] = ps
        return ps

    def remove_process_set(self, ps):
        if ps.process_set_id in (None, 0):
            raise ValueError("cannot remove %r" % ps)
        self.barrier_world()
        del self.process_sets[ps.process_set_id]
        ps._free()
        ps.process_set_id = None
        return True

    def barrier_world(self):
        global_process_set.deadline.wait(self.world.Ibarrier(), "process set change")

    def close(self):
        self.engine.stop()
        for ps in list(self.process_sets.values()):
            ps._free()
            if ps is not global_process_set:
                ps.process_set_id = None
        global_process_set.process_set_id = None
        self.world.Free()


_runtime = None
_lock = threading.Lock()
_prev_excepthook = None


def current(what="this operation"):
    if _runtime is None:
        raise NotInitializedError(what)
    return _runtime


def is_initialized():
    return _runtime is not None


def _abort_on_uncaught(exc_type, exc, tb):
    """An uncaught exception on one rank ends the job on every rank, naming this rank."""
    try:
        rank = MPI.COMM_WORLD.Get_rank()
        sys.stderr.write("stella_mpi: rank %d raised an uncaught %s; ending the job on every rank\n"
                         % (rank, exc_type.__name__))
        (_prev_excepthook or sys.__excepthook__)(exc_type, exc, tb)
        sys.stderr.flush()
    finally:
        if MPI.COMM_WORLD.Get_size() > 1 and not issubclass(exc_type, (SystemExit,)):
            import time
            time.sleep(0.5)  # let the launcher forward the traceback before the job is torn down
            MPI.COMM_WORLD.Abort(1)


def init(comm=None, process_sets=None):
    """Start stella_mpi (idempotent). ``comm``: an mpi4py communicator or a list of world
    ranks to run on (default: all); ``process_sets``: ProcessSets to register now."""
    global _runtime, _prev_excepthook
    with _lock:
        if _runtime is not None:
            for ps in process_sets or []:
                if isinstance(ps, ProcessSet) and ps.process_set_id is None:
                    _runtime.add_process_set(ps)
            return
        if not MPI.Is_initialized():
            MPI.Init_thread(MPI.THREAD_MULTIPLE)
        _runtime = Runtime(comm, process_sets)
        if _prev_excepthook is None:
            _prev_excepthook = sys.excepthook
            sys.excepthook = _abort_on_uncaught


def shutdown():
    """Stop the engine and free every communicator. ``init()`` may be called again."""
    global _runtime
    with _lock:
        if _runtime is None:
            return
        rt, _runtime = _runtime, None
        rt.close()


atexit.register(shutdown)


# ---------------- topology queries ----------------

def _topo(what):
    return global_process_set.topology if current(what) else None


def size():
    return current("hvd.size()").size


def rank():
    return current("hvd.rank()").rank


def local_size():
    return _topo("hvd.local_size()").local_size


def local_rank():
    return _topo("hvd.local_rank()").local_rank


def cross_size():
    return _topo("hvd.cross_size()").cross_size


def cross_rank():
    return _topo("hvd.cross_rank()").cross_rank


def num_clusters():
    return _topo("hvd.num_clusters()").num_clusters


def cluster_id():
    return _topo("hvd.cluster_id()").cluster_id


def cluster_size():
    return _topo("hvd.cluster_size()").cluster_size


def cluster_rank():
    return _topo("hvd.cluster_rank()").cluster_rank


def is_homogeneous():
    """Every node runs the same number of ranks."""
    topo = _topo("hvd.is_homogeneous()")
    return topo.size % topo.local_size == 0 and topo.cross_size * topo.local_size == topo.size


def stats(end_step=False):
    """Counters of the cross-cluster traffic: the last finished step and the totals.

    ``last_step`` holds wan_bytes_sent/received, seconds in select/encode/exchange/decode/merge,
    the density used and the residual's norm relative to the gradient's. DistributedOptimizer
    closes a step at each synchronize(); ``end_step=True`` closes one by hand."""
    rt = current("hvd.stats()")
    if end_step:
        rt.wan_stats.end_step()
    return rt.wan_stats.snapshot()


def add_process_set(process_set):
    return current("hvd.add_process_set()").add_process_set(process_set)


def remove_process_set(process_set):
    return current("hvd.remove_process_set()").remove_process_set(process_set)


# ---------------- capability queries (answered truthfully) ----------------

def mpi_built():
    return True


def mpi_enabled():
    return True


def gloo_built():
    return gloo_usable()


def gloo_enabled():
    """Whether gloo carries intra-cluster traffic in this job."""
    if _runtime is None:
        return False
    return global_process_set.intra.name == "gloo"


def nccl_built():
    """NCCL version code of this torch build (0 without NCCL), as Horovod returns."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_nccl_available()):
        return 0
    try:
        major, minor, patch = torch.cuda.nccl.version()
        return major * 10000 + minor * 100 + patch
    except Exception:  # noqa: BLE001 - built with NCCL but no driver to ask
        return 1


def cuda_built():
    return torch.backends.cuda.is_built() if hasattr(torch.backends, "cuda") else False


def rocm_built():
    return getattr(torch.version, "hip", None) is not None


def ddl_built():
    return False


def ccl_built():
    return False


def mpi_threads_supported():
    return MPI.Query_thread() >= MPI.THREAD_MULTIPLE


def start_timeline(file_path, mark_cycles=False):
    """Horovod's timeline is not implemented yet; accepted and ignored (see hvd.stats())."""
    current("hvd.start_timeline()")


def stop_timeline():
    current("hvd.stop_timeline()")

