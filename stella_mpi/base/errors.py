"""Exception types. Names follow Horovod so that existing ``except`` clauses keep working."""


class NotInitializedError(ValueError):
    """A query was called before ``init()`` (Horovod raises ValueError here)."""

    def __init__(self, what="this operation"):
        super().__init__("stella_mpi has not been initialized; use hvd.init() before %s." % what)


class HorovodInternalError(RuntimeError):
    """A collective failed (Horovod's name, kept so that ``except`` clauses work)."""


class CollectiveNotInitializedError(HorovodInternalError, NotInitializedError):
    """A collective was called before ``init()`` (Horovod raises HorovodInternalError here)."""

    def __init__(self, what="this operation"):
        NotInitializedError.__init__(self, what)


class CollectiveRefused(HorovodInternalError):
    """Every rank of the collective refused it alike before any data moved; the ranks are
    still in step and the job can go on."""


class TensorMismatchError(CollectiveRefused, ValueError):
    """Ranks submitted different collectives (name, shape, dtype or op) at the same point."""


class NonFiniteGradientError(CollectiveRefused, ValueError):
    """A rank's gradient held NaN or Inf: the collective was refused on every rank alike before
    any data moved (the policy ``STELLA_NONFINITE=raise``, or a sparse allreduce outside the
    optimizer); the ranks are still in step."""


class StellaTimeoutError(HorovodInternalError, TimeoutError):
    """A wait passed its deadline (``STELLA_TIMEOUT``). ``silent_ranks``: the COMM_WORLD ranks
    that did not answer the deadline's diagnosis (None when they could not be asked)."""
    silent_ranks = None


class HostsUpdatedInterrupt(RuntimeError):
    """Hosts were added or removed (``stellarun --elastic``'s discovery): raised on every rank at
    the same ``commit()`` or ``check_host_updates()``, as in Horovod's elastic mode.
    ``skip_sync``: only hosts were added (the survivors' state needs no rollback)."""

    def __init__(self, skip_sync=False):
        super().__init__("the hosts of the elastic job changed")
        self.skip_sync = skip_sync
