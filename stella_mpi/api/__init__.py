"""The public API with Horovod's names, signatures and semantics (``horovod.torch`` is the
reference): one module per collective (with its async form and autograd function), the
helpers built on them (:mod:`.functions`), the queries and the lifecycle.

Each call validates its arguments on the calling thread (a clear error, no hang), builds a
description that every rank must agree on, and hands the op to the collective thread
(:mod:`.handles`). ``*_async`` functions return an integer handle for ``poll`` and
``synchronize``; the plain ones wait.

The package ``stella_mpi`` re-exports the public names from these modules; this ``__init__``
binds none of them, so that ``stella_mpi.api.allreduce`` stays the module.
"""
