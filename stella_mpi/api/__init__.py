"""The public API with Horovod's names, signatures and semantics (``horovod.torch`` is the
reference): one module per collective (with its async form and autograd function), the
helpers built on them (:mod:`.functions`), the queries and the lifecycle.

Each call validates its arguments on the calling thread (a clear error, no hang), builds a
description that every rank must agree on, and hands the op to the collective thread
(:mod:`.handles`). ``*_async`` functions return an integer handle for ``poll`` and
``synchronize``; the plain ones wait.
"""
from .allgather import allgather, allgather_async, grouped_allgather  # noqa: F401
from .allreduce import (allreduce, allreduce_, allreduce_async, allreduce_async_, grouped_allreduce,  # noqa: F401
                        grouped_allreduce_, grouped_allreduce_async, grouped_allreduce_async_,
                        sparse_allreduce_async)
from .alltoall import alltoall, alltoall_async  # noqa: F401
from .broadcast import broadcast, broadcast_, broadcast_async, broadcast_async_  # noqa: F401
from .control import barrier, join  # noqa: F401
from .functions import (allgather_object, broadcast_object, broadcast_optimizer_state,  # noqa: F401
                        broadcast_parameters)
from .handles import poll, synchronize  # noqa: F401
from .lifecycle import (add_process_set, init, is_initialized, remove_process_set, shutdown,  # noqa: F401
                        start_timeline, stats, stop_timeline)
from .queries import (ccl_built, cluster_id, cluster_rank, cluster_size, cross_rank, cross_size,  # noqa: F401
                      cuda_built, ddl_built, gloo_built, gloo_enabled, is_homogeneous, local_rank, local_size,
                      mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, num_clusters, rank, rocm_built,
                      size)
from .reduce_ops import Adasum, Average, Max, Min, Product, Sum  # noqa: F401
from .reducescatter import grouped_reducescatter, reducescatter, reducescatter_async  # noqa: F401
