"""Topology queries (Horovod's meanings, plus the cluster level) and capability queries
(answered truthfully for this build)."""
import torch
from mpi4py import MPI

from ..comm.intra import gloo_usable
from ..core import state
from ..core.process_sets import global_process_set


def _topo(what):
    state.current(what)
    return global_process_set.topology


def size():
    return state.current("hvd.size()").size


def rank():
    return state.current("hvd.rank()").rank


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


def mpi_built():
    return True


def mpi_enabled():
    return True


def gloo_built():
    return gloo_usable()


def gloo_enabled():
    """Whether gloo carries intra-cluster traffic in this job."""
    if not state.is_initialized():
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
