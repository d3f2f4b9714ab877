"""GPU runs (marker ``gpu``; skipped cleanly without CUDA). On one GPU: two clusters of one rank
sharing it (the CUDA sparse route and the CPU engine end to end, bit for bit against the host
route), and one cluster of two ranks sharing it (NCCL refuses that: the staged route). With two
GPUs or more: one cluster of two ranks on NCCL. Run with ``bash scripts/run_gpu.sh``."""
import pytest
import torch

from mpi_launch import run_mpi

pytestmark = [pytest.mark.gpu, pytest.mark.mpi,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SUITES = ["-m", "pytest", "-q", "-s", "-x", "-p", "no:cacheprovider", "tests/mpi/test_device_route.py",
          "tests/mpi/test_nccl.py"]


def _check(proc, what):
    tail = proc.stdout[-6000:] + "\n" + proc.stderr[-6000:]
    assert proc.returncode == 0, "%s failed (exit %d):\n%s" % (what, proc.returncode, tail)
    assert " passed" in proc.stdout, tail


def test_two_clusters_sharing_one_gpu():
    _check(run_mpi(2, SUITES + ["tests/mpi/test_sparse.py", "tests/mpi/test_cpu_engine.py", "tests/mpi/test_ddp.py"],
                   env={"STELLA_CLUSTERS": "2"}, timeout=600), "2 clusters x 1 rank, CUDA")


def test_one_cluster_sharing_one_gpu_is_staged():
    # one visible GPU whatever the machine has: the two ranks share it, NCCL is not used
    _check(run_mpi(2, SUITES, env={"STELLA_CLUSTERS": "1", "CUDA_VISIBLE_DEVICES": "0"}, timeout=600),
           "1 cluster x 2 ranks on one GPU")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL with 2 ranks needs 2 GPUs")
def test_one_cluster_on_nccl():
    _check(run_mpi(2, SUITES, env={"STELLA_CLUSTERS": "1"}, timeout=600), "1 cluster x 2 ranks, NCCL")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL with 2 ranks per cluster needs 4 GPUs")
def test_two_clusters_on_nccl():
    if torch.cuda.device_count() < 4:
        pytest.skip("2 clusters of 2 ranks on NCCL need 4 GPUs")
    _check(run_mpi(4, SUITES, env={"STELLA_CLUSTERS": "2"}, timeout=600), "2 clusters x 2 ranks, NCCL")
