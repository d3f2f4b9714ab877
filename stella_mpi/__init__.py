"""stella_mpi: Horovod's API for PyTorch, for GPUs spread over clusters joined by slow links.

Use it as ``import stella_mpi as hvd`` in a Horovod script and launch with
``mpirun -np N`` (or ``srun``, or ``stellarun``).
"""
from .api import (Adasum, Average, Max, Min, Product, Sum, allgather, allgather_async, allreduce,  # noqa: F401
                  allreduce_, allreduce_async, allreduce_async_, alltoall, alltoall_async, barrier, broadcast,
                  broadcast_, broadcast_async, broadcast_async_, grouped_allgather, grouped_allreduce,
                  grouped_allreduce_, grouped_allreduce_async, grouped_allreduce_async_, grouped_reducescatter,
                  join, poll, reducescatter, reducescatter_async, sparse_allreduce_async, synchronize)
from .adjuster import Adjuster  # noqa: F401
from .compression import Compression  # noqa: F401
from .errors import HorovodInternalError, HostsUpdatedInterrupt, TensorMismatchError  # noqa: F401
from .functions import (allgather_object, broadcast_object, broadcast_optimizer_state,  # noqa: F401
                        broadcast_parameters)
from .optimizer import DistributedOptimizer  # noqa: F401
from .runtime import (ProcessSet, add_process_set, ccl_built, cluster_id, cluster_rank, cluster_size,  # noqa: F401
                      cross_rank, cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled, global_process_set,
                      init, is_homogeneous, is_initialized, local_rank, local_size, mpi_built, mpi_enabled,
                      mpi_threads_supported, nccl_built, num_clusters, rank, remove_process_set, rocm_built,
                      shutdown, size, start_timeline, stats, stop_timeline)

__version__ = "0.1.0"
