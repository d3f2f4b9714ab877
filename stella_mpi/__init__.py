"""stella_mpi: Horovod's API for PyTorch, for GPUs spread over clusters joined by slow links.

Use it as ``import stella_mpi as hvd`` in a Horovod script and launch with
``mpirun -np N`` (or ``srun``, or ``stellarun``). The rooms, lowest layer first (a layer
imports only layers below it; tests/unit/test_layering.py checks it): ``base`` (errors,
settings), ``_native`` (the C core's binding), ``compression``, ``comm`` (deadlines, topology,
intra-cluster backends, the two-level route), ``core`` (state, process sets, the collective
thread, executors), ``api`` (Horovod's functions), ``adjust`` (the bandwidth-driven
adjuster), ``optim`` (DistributedOptimizer), ``elastic`` (Horovod's elastic API), ``ddp`` (torch's
DistributedDataParallel over the job: ``from stella_mpi import ddp``, not imported here), ``plan`` (the
planner's jobs and models, ``stellarun plan``; not imported here). The launcher is the separate package ``stellarun``.
"""
from .base.config import wan_route_setting as _wan_route_setting
from .comm.process_watchdog import import_mpi as _import_mpi

_wan_route_setting()   # an unknown STELLA_WAN_ROUTE is refused here, before any rank waits on MPI
_import_mpi()   # first: MPI_Init waits for every rank, under the STELLA_TIMEOUT deadline

from .adjust.settings import Adjuster  # noqa: F401,E402
from .api.allgather import allgather, allgather_async, grouped_allgather, grouped_allgather_async  # noqa: F401,E402
from .api.allreduce import (allreduce, allreduce_, allreduce_async, allreduce_async_,  # noqa: F401,E402
                            compressed_allreduce_async, grouped_allreduce, grouped_allreduce_, grouped_allreduce_async,
                            grouped_allreduce_async_)
from .api.alltoall import alltoall, alltoall_async  # noqa: F401,E402
from .api.broadcast import broadcast, broadcast_, broadcast_async, broadcast_async_  # noqa: F401,E402
from .api.control import barrier, join  # noqa: F401,E402
from .api.functions import (allgather_object, broadcast_object, broadcast_optimizer_state,  # noqa: F401,E402
                            broadcast_parameters)
from .api.handles import poll, synchronize  # noqa: F401,E402
from .api.lifecycle import (add_process_set, init, is_initialized, remove_process_set, shutdown,  # noqa: F401,E402
                            start_timeline, stats, stop_timeline)
from .api.queries import (ccl_built, cluster_id, cluster_rank, cluster_size, cross_rank, cross_size,  # noqa: F401,E402
                          cuda_built, ddl_built, gloo_built, gloo_enabled, is_homogeneous, local_rank, local_size,
                          mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, num_clusters, rank, rocm_built,
                          size)
from .api.reduce_ops import Adasum, Average, Max, Min, Product, Sum  # noqa: F401,E402
from .api.sparse_tensors import sparse_allreduce_async  # noqa: F401,E402
from .api.sync_batch_norm import SyncBatchNorm  # noqa: F401,E402
from .api.reducescatter import (grouped_reducescatter, grouped_reducescatter_async, reducescatter,  # noqa: F401,E402
                                reducescatter_async)
from .base.errors import HorovodInternalError, HostsUpdatedInterrupt, TensorMismatchError  # noqa: F401,E402
from .compression import Compression  # noqa: F401,E402
from .core.process_sets import ProcessSet, global_process_set  # noqa: F401,E402
from .optim.distributed import DistributedOptimizer  # noqa: F401,E402
from .optim.outer_sync import LocalSteps  # noqa: F401,E402
from .optim.spec import CpuEngine  # noqa: F401,E402
from . import elastic  # noqa: F401,E402

from .base.version import __version__  # noqa: F401,E402  (the one place it is written)
