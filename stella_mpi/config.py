"""Settings read from the environment: the one place that names each variable.

Horovod's own variable names are accepted where one exists, so job scripts
written for Horovod keep their tuning.
"""
import os
from dataclasses import dataclass


def _env(names, default, cast):
    for name in names:
        v = os.environ.get(name)
        if v not in (None, ""):
            try:
                return cast(v)
            except ValueError:
                raise ValueError("environment variable %s=%r is not a valid %s" % (name, v, cast.__name__)) from None
    return default


def _bool(v):
    s = str(v).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise ValueError(v)


def _sparse_algorithm():
    v = _env(["STELLA_SPARSE_ALGO"], "auto", str).lower()
    if v not in ("auto", "allgather", "tree"):
        raise ValueError("STELLA_SPARSE_ALGO must be auto, allgather or tree, not %r" % v)
    return v


@dataclass(frozen=True)
class Config:
    timeout_s: float          # deadline of every wait on a peer
    fusion_threshold: int     # bytes per gradient bucket
    check_collectives: bool   # verify that all ranks submit the same collective
    intra_backend: str        # "auto" | "mpi" | "gloo" for CPU tensors inside a cluster
    cluster_label: str        # STELLA_CLUSTER (per rank) or ""
    clusters_per_node: int    # STELLA_CLUSTERS (0: unset)
    cluster_map: str          # STELLA_CLUSTER_MAP "host=label,host=label" (stellarun --cluster-of)
    gloo_ifname: str          # interface gloo binds to ("" = pick)
    log_level: str
    seed: int                 # seed shared by all ranks (random-k draws)
    sparse_algorithm: str     # "auto" | "allgather" | "tree": summing selections across clusters

    @classmethod
    def from_env(cls):
        intra = _env(["STELLA_INTRA_BACKEND"], "auto", str).lower()
        if intra not in ("auto", "mpi", "gloo"):
            raise ValueError("STELLA_INTRA_BACKEND must be auto, mpi or gloo, not %r" % intra)
        timeout = _env(["STELLA_TIMEOUT"], 120.0, float)
        if timeout <= 0:
            raise ValueError("STELLA_TIMEOUT must be positive seconds, not %r" % timeout)
        clusters = _env(["STELLA_CLUSTERS"], 0, int)
        if clusters < 0:
            raise ValueError("STELLA_CLUSTERS must be a positive number of clusters per node")
        return cls(
            timeout_s=timeout,
            fusion_threshold=_env(["STELLA_FUSION_THRESHOLD", "HOROVOD_FUSION_THRESHOLD"], 64 * 1024 * 1024, int),
            check_collectives=_env(["STELLA_CHECK_COLLECTIVES"], True, _bool),
            intra_backend=intra,
            cluster_label=_env(["STELLA_CLUSTER"], "", str),
            clusters_per_node=clusters,
            cluster_map=_env(["STELLA_CLUSTER_MAP"], "", str),
            gloo_ifname=_env(["STELLA_GLOO_IFNAME", "GLOO_SOCKET_IFNAME"], "", str),
            log_level=_env(["STELLA_LOG_LEVEL", "HOROVOD_LOG_LEVEL"], "warning", str),
            seed=_env(["STELLA_SEED"], 0, int),
            sparse_algorithm=_sparse_algorithm(),
        )
