"""Settings read from the environment: the one place that names and reads each variable.

Horovod's own variable names are accepted where one exists, so job scripts written for
Horovod keep their tuning. ``stellarun`` (a separate package that never imports stella_mpi)
writes some of these variables for the ranks it launches: ``STELLA_CLUSTER``,
``STELLA_CLUSTERS``, ``STELLA_CLUSTER_MAP``, ``STELLA_TIMEOUT``, ``GLOO_SOCKET_IFNAME`` and the
pacing pair ``STELLA_WAN_PACE_BPS``/``STELLA_WAN_PACE_DELAY_S``; ``tests/unit/test_layering.py``
checks that every variable it writes is one read here.
"""
import math
import os
from dataclasses import dataclass

CPU_CORES_VAR = "STELLA_CPU_CORES"
CPU_THREADS_VAR = "STELLA_CPU_THREADS"


def _finite(v):
    x = float(v)
    if not math.isfinite(x):
        raise ValueError(v)
    return x


_FORMATS = {"_finite": "finite number", "_bool": "boolean (1/0, true/false, yes/no, on/off)", "int": "integer",
            "float": "number", "str": "string"}


def _env(names, default, cast):
    if cast is float:
        cast = _finite   # nan would switch a deadline off, inf overflow the waits that take one
    for name in names:
        v = os.environ.get(name)
        if v not in (None, ""):
            try:
                return cast(v)
            except ValueError:
                raise ValueError("environment variable %s=%r is not a valid %s"
                                 % (name, v, _FORMATS.get(cast.__name__, cast.__name__))) from None
    return default


def _bool(v):
    s = str(v).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise ValueError(v)


def _choice(name, default, choices):
    v = _env([name], default, str).lower()
    if v not in choices:
        raise ValueError("%s must be %s or %s, not %r" % (name, ", ".join(choices[:-1]), choices[-1], v))
    return v


def _non_negative(name, default=0.0):
    v = _env([name], float(default), float)
    if v < 0:
        raise ValueError("%s must not be negative, not %r" % (name, v))
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
    nonfinite: str = "skip"   # a NaN/Inf gradient: "skip" the step everywhere, "raise", or "off" (no check)
    wan_pace_bps: float = 0.0     # user-space pacing of cross-cluster sends (stellarun --wan without namespaces)
    wan_pace_delay_s: float = 0.0  # one-way delay added per paced message round
    negotiation: str = "name"      # "name": ops matched by name, as Horovod; "order": in submission order
    cycle_time_s: float = 2e-4     # HOROVOD_CYCLE_TIME (ms in the environment): one negotiation round per cycle
    cache_capacity: int = 1020     # HOROVOD_CACHE_CAPACITY: names the negotiation remembers (one bit each)
    stall_check_s: float = 60.0    # HOROVOD_STALL_CHECK_TIME_SECONDS (0 or HOROVOD_STALL_CHECK_DISABLE: off)
    stall_shutdown_s: float = 0.0  # HOROVOD_STALL_SHUTDOWN_TIME_SECONDS: end the job after a stall this long
    timeline: str = ""             # HOROVOD_TIMELINE: the Chrome trace rank 0 writes ("{rank}" in it: every rank)
    timeline_mark_cycles: bool = False   # HOROVOD_TIMELINE_MARK_CYCLES
    timeline_max_bytes: int = 1 << 30    # STELLA_TIMELINE_MAX_MB: the file's cap
    nccl: str = "auto"             # STELLA_NCCL: "auto" (NCCL for CUDA tensors where every cluster rank has its GPU) or "off"
    cluster_channel: bool = True   # STELLA_CLUSTER_CHANNEL: local steps' inner steps reduce off the negotiation

    @classmethod
    def from_env(cls):
        """The settings of a run, read at ``hvd.init()``."""
        intra = _choice("STELLA_INTRA_BACKEND", "auto", ("auto", "mpi", "gloo"))
        timeout = timeout_setting()
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
            sparse_algorithm=_choice("STELLA_SPARSE_ALGO", "auto", ("auto", "allgather", "tree")),
            nonfinite=_choice("STELLA_NONFINITE", "skip", ("skip", "raise", "off")),
            wan_pace_bps=_non_negative("STELLA_WAN_PACE_BPS"),
            wan_pace_delay_s=_non_negative("STELLA_WAN_PACE_DELAY_S"),
            negotiation=_choice("STELLA_NEGOTIATION", "name", ("name", "order")),
            cycle_time_s=_non_negative("HOROVOD_CYCLE_TIME", 0.2) / 1000.0,
            cache_capacity=int(_non_negative("HOROVOD_CACHE_CAPACITY", 1020)),
            stall_check_s=0.0 if _env(["HOROVOD_STALL_CHECK_DISABLE"], False, _bool) else
            _non_negative("HOROVOD_STALL_CHECK_TIME_SECONDS", 60.0),
            stall_shutdown_s=_non_negative("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"),
            nccl=_choice("STELLA_NCCL", "auto", ("auto", "off")),
            cluster_channel=_env(["STELLA_CLUSTER_CHANNEL"], True, _bool),
            timeline=_env(["HOROVOD_TIMELINE"], "", str),
            timeline_mark_cycles=_env(["HOROVOD_TIMELINE_MARK_CYCLES"], False, _bool),
            timeline_max_bytes=int(_non_negative("STELLA_TIMELINE_MAX_MB", 1024) * (1 << 20)),
        )


WAN_ROUTES = ("auto", "dense")   # STELLA_WAN_ROUTE (stellarun --wan-route)


def wan_route_setting():
    """``STELLA_WAN_ROUTE``: what crosses the WAN when a Horovod script asked for no stella
    compressor. "auto" (the default): the adjuster chooses the route (optim/tuning.py); "dense":
    Horovod's exact dense numerics. Read when the package is imported (an unknown value is
    refused there) and when a DistributedOptimizer is built."""
    value = str(os.environ.get("STELLA_WAN_ROUTE", "")).strip().lower() or "auto"
    if value not in WAN_ROUTES:
        raise ValueError("STELLA_WAN_ROUTE=%r: use %s (or leave it unset for 'auto')"
                         % (os.environ.get("STELLA_WAN_ROUTE"), " or ".join(repr(v) for v in WAN_ROUTES)))
    return value


def cpu_cores_setting():
    """``STELLA_CPU_CORES`` as written ("" when unset), read when a CPU-engine optimizer plans its
    worker pool (stella_mpi._native.pool.plan_cores parses it)."""
    return str(os.environ.get(CPU_CORES_VAR, "")).strip()


def cpu_threads_setting():
    """``STELLA_CPU_THREADS`` as written ("" when unset)."""
    return str(os.environ.get(CPU_THREADS_VAR, "")).strip()


def timeout_setting():
    """``STELLA_TIMEOUT``: seconds any wait on a peer may take (start-up and shutdown included)."""
    timeout = _env(["STELLA_TIMEOUT"], 120.0, float)
    if timeout <= 0:
        raise ValueError("STELLA_TIMEOUT must be positive seconds, not %r" % timeout)
    return timeout


def start_timeout_setting():
    """``STELLA_START_TIMEOUT`` (stellarun/horovodrun's --start-timeout): seconds for every rank of
    the job to start (MPI_Init and ``hvd.init()``); ``STELLA_TIMEOUT`` when unset."""
    timeout = _env(["STELLA_START_TIMEOUT"], 0.0, float)
    if timeout < 0:
        raise ValueError("STELLA_START_TIMEOUT must be positive seconds, not %r" % timeout)
    return timeout or timeout_setting()


def launcher_rank_setting():
    """This process's rank as the launcher numbered it (hydra, Open MPI, Slurm), or -1: what a
    message can name before MPI is up."""
    try:
        return _env(["PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"], -1, int)
    except ValueError:
        return -1


def device_path_setting():
    """STELLA_DEVICE_PATH, read at every call (tests switch it between runs): "torch" sends CPU
    tensors through the CUDA route's code (base/devices.py); "" or "auto": CUDA tensors only."""
    value = str(os.environ.get("STELLA_DEVICE_PATH", "")).strip().lower()
    if value not in ("", "auto", "torch"):
        raise ValueError("STELLA_DEVICE_PATH=%r: use 'torch' (CPU tensors take the CUDA route's torch-op path) "
                         "or 'auto'" % value)
    return value or "auto"


def status_dir_setting():
    """``STELLA_STATUS_DIR``: where stellarun collects how each rank ended ("" = not under stellarun)."""
    return str(os.environ.get("STELLA_STATUS_DIR", "")).strip()


def status_emit_setting():
    """``STELLA_STATUS_EMIT=1``: this rank runs on a host other than stellarun's (its supervisor
    says so); its record goes to stderr as a marker line (stellarun/status.py)."""
    return os.environ.get("STELLA_STATUS_EMIT", "") == "1"


def elastic_setting():
    """What ``stellarun --elastic`` tells each rank (stella_mpi/elastic/worker.py), or None
    outside an elastic launch: the host's commit directory, the launcher's notification file,
    the epoch and the resets this incarnation started with, and the host it runs for."""
    def number(name):
        value = os.environ.get(name, "0")
        try:
            return int(value or 0)
        except ValueError:
            raise ValueError("%s=%r is not an integer (it is stellarun --elastic's)" % (name, value))
    setting = {"dir": str(os.environ.get("STELLA_ELASTIC_DIR", "")).strip(),
               "notify": str(os.environ.get("STELLA_ELASTIC_NOTIFY", "")),
               "epoch": number("STELLA_ELASTIC_EPOCH"), "resets": number("STELLA_ELASTIC_RESETS"),
               "host": str(os.environ.get("HOROVOD_HOSTNAME", ""))}
    return setting if setting["dir"] else None
