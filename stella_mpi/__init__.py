"""stella_mpi: Horovod's API for PyTorch, for GPUs spread over clusters joined by slow links.

Use it as ``import stella_mpi as hvd`` in a Horovod script and launch with
``mpirun -np N`` (or ``srun``, or ``stellarun``). The rooms, lowest layer first (a layer
imports only layers below it; tests/unit/test_layering.py checks it): ``base`` (errors,
settings), ``_native`` (the C core's binding), ``compression``, ``comm`` (deadlines, topology,
intra-cluster backends, the two-level route), ``core`` (state, process sets, the collective
thread, executors), ``api`` (Horovod's functions), ``adjust`` (the bandwidth-driven
adjuster), ``optim`` (DistributedOptimizer). The launcher is the separate package ``stellarun``.
"""
from .adjust.settings import Adjuster  # noqa: F401
from .api import (Adasum, Average, Max, Min, Product, Sum, add_process_set, allgather,  # noqa: F401
                  allgather_async, allgather_object, allreduce, allreduce_, allreduce_async, allreduce_async_,
                  alltoall, alltoall_async, barrier, broadcast, broadcast_, broadcast_async, broadcast_async_,
                  broadcast_object, broadcast_optimizer_state, broadcast_parameters, ccl_built, cluster_id,
                  cluster_rank, cluster_size, cross_rank, cross_size, cuda_built, ddl_built, gloo_built,
                  gloo_enabled, grouped_allgather, grouped_allreduce, grouped_allreduce_, grouped_allreduce_async,
                  grouped_allreduce_async_, grouped_reducescatter, init, is_homogeneous, is_initialized, join,
                  local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, num_clusters,
                  poll, rank, reducescatter, reducescatter_async, remove_process_set, rocm_built, shutdown, size,
                  sparse_allreduce_async, start_timeline, stats, stop_timeline, synchronize)
from .base.errors import HorovodInternalError, HostsUpdatedInterrupt, TensorMismatchError  # noqa: F401
from .compression import Compression  # noqa: F401
from .core.process_sets import ProcessSet, global_process_set  # noqa: F401
from .optim.factory import DistributedOptimizer  # noqa: F401

__version__ = "0.1.0"
