"""``hvd.elastic``: Horovod's elastic API (``run``, ``State``, ``ObjectState``, ``TorchState``,
``ElasticSampler``) over restartable MPI jobs (``stellarun --elastic``); see :mod:`.worker`."""
from .sampler import ElasticSampler  # noqa: F401
from .state import ObjectState, State, TorchState  # noqa: F401
from .worker import run  # noqa: F401

__all__ = ["ElasticSampler", "ObjectState", "State", "TorchState", "run"]
