"""``import stella_mpi as hvd`` exposes exactly these names (besides its sub-packages and
dunders): Horovod's API and stella_mpi's additions. Changing the list is changing the public API."""
import subprocess
import sys

from mpi_launch import ROOT

PUBLIC = {
    "Adasum", "Adjuster", "Average", "Compression", "CpuEngine", "DistributedOptimizer", "HorovodInternalError",
    "HostsUpdatedInterrupt", "LocalSteps", "Max", "Min", "ProcessSet", "Product", "Sum", "SyncBatchNorm",
    "TensorMismatchError", "add_process_set", "allgather", "allgather_async", "allgather_object", "allreduce",
    "allreduce_", "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async", "barrier", "broadcast",
    "broadcast_", "broadcast_async", "broadcast_async_", "broadcast_object", "broadcast_optimizer_state",
    "broadcast_parameters", "ccl_built", "cluster_id", "cluster_rank", "cluster_size",
    "compressed_allreduce_async", "cross_rank", "cross_size", "cuda_built", "ddl_built", "global_process_set",
    "gloo_built", "gloo_enabled", "grouped_allgather", "grouped_allgather_async", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter",
    "grouped_reducescatter_async", "init", "is_homogeneous", "is_initialized", "join", "local_rank",
    "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "num_clusters", "poll",
    "rank", "reducescatter", "reducescatter_async", "remove_process_set", "rocm_built", "shutdown", "size",
    "sparse_allreduce_async", "start_timeline", "stats", "stop_timeline", "synchronize"
}

SCRIPT = r'''
import types, stella_mpi as hvd
print(" ".join(sorted(n for n in dir(hvd) if not n.startswith("_") and not isinstance(getattr(hvd, n), types.ModuleType))))
'''


def test_public_names_are_exactly_horovods_and_ours():
    # a child process: importing stella_mpi loads mpi4py, and the test runner stays free of MPI
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    names = set(proc.stdout.split())
    assert not PUBLIC - names, "public names gone: %s" % sorted(PUBLIC - names)
    assert not names - PUBLIC, "new public names (add them here if meant): %s" % sorted(names - PUBLIC)
