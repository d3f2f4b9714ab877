"""PyTorch's DistributedDataParallel (and PyTorch Lightning's DDP strategy) over a stella_mpi job:
:func:`init_process_group` makes torch.distributed's default group from the MPI job, and
:func:`stella_hook` with a :class:`StellaHookState` sends DDP's gradient buckets through stella's
hierarchy (dense inside each cluster, the cross-cluster route across them). See
``docs/guides/ddp.md``."""
from .hook import StellaHookState, automatic_compression, wrap_optimizer, stella_hook  # noqa: F401
from .process_group import default_backend, init_process_group  # noqa: F401

__all__ = ["StellaHookState", "automatic_compression", "default_backend", "init_process_group", "stella_hook",
           "wrap_optimizer"]
