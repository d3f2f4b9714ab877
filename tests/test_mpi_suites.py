"""Launch the per-rank suites in tests/mpi under mpirun, over several layouts:
one and two clusters, 2, 3 and 4 ranks, uneven clusters, interleaved cluster labels,
and both intra-cluster backends. (-m "" also runs the layouts marked slow: each repeats what
a layout of the default run covers.)"""
import pytest

from mpi_launch import run_mpi, run_mpmd

pytestmark = pytest.mark.mpi

ALL = ["-m", "pytest", "-q", "-s", "-x", "-p", "no:cacheprovider", "tests/mpi"]
# the device route's comparisons (test_device_route.py) run only in the layouts given ALL or DEVICE
PYTEST = ALL + ["--ignore", "tests/mpi/test_device_route.py"]
DEVICE = ["tests/mpi/test_device_route.py"]
DENSE = PYTEST[:7] + ["tests/mpi/test_collectives.py", "tests/mpi/test_optimizer.py"]
SPARSE = PYTEST[:7] + ["tests/mpi/test_sparse.py", "tests/mpi/test_thc.py", "tests/mpi/test_chunked.py"]
FRAGMENTS = "tests/mpi/test_local_steps_fragments.py"
CHANNEL = "tests/mpi/test_local_steps_channel.py"

# (name, ranks, environment, suites): the dense suites run on every layout, the sparse
# route on the layouts where it differs (two clusters, uneven, three clusters); the layouts marked
# slow repeat what another layout of the default run covers (they run with -m "")
LAYOUTS = [
    ("np2-one-cluster", 2, {}, PYTEST),
    # (local steps' agreement and refusals, and their fragments, run in np3-uneven-2+1: two clusters, one of two
    # ranks; the fragments also in np4-2x2-fragments)
    # (slow: two clusters of one rank each are in the default run's labels a,b,a, beside a cluster of two)
    pytest.param("np2-two-clusters", 2, {"STELLA_CLUSTERS": "2"},
                 ALL + ["--ignore", "tests/mpi/test_local_steps_safety.py", "--ignore", FRAGMENTS],
                 marks=pytest.mark.slow),
    pytest.param("np3-one-cluster", 3, {}, DENSE, marks=pytest.mark.slow),
    # (every suite on uneven clusters runs by default with interleaved labels: test_suites_on_uneven_interleaved_clusters)
    pytest.param("np3-uneven-2+1", 3, {"STELLA_CLUSTERS": "2", "STELLA_INTRA_BACKEND": "mpi"}, ALL,
                 marks=pytest.mark.slow),
    pytest.param("np3-uneven-2+1-gloo", 3, {"STELLA_CLUSTERS": "2", "STELLA_INTRA_BACKEND": "gloo"}, DENSE,
                 marks=pytest.mark.slow),   # gloo runs in np2-one-cluster, uneven clusters in np3-uneven-2+1
    # three clusters, an odd count for the tree's rounds: 15 s against 20 s for four clusters on
    # 2 cores, and fewer cases skipped (41 passed, 1 skipped against 35 and 7)
    ("np3-three-clusters-tree", 3, {"STELLA_CLUSTERS": "3", "STELLA_SPARSE_ALGO": "tree"}, SPARSE),
    # (slow: the sparse route's default exchange over three clusters, and the tree over four, repeat
    # what np3-three-clusters-tree and the two-cluster layouts cover)
    pytest.param("np3-three-clusters", 3, {"STELLA_CLUSTERS": "3"}, SPARSE, marks=pytest.mark.slow),
    pytest.param("np4-four-clusters-tree", 4, {"STELLA_CLUSTERS": "4", "STELLA_SPARSE_ALGO": "tree"}, SPARSE,
                 marks=pytest.mark.slow),
    pytest.param("np4-2x2-mpi", 4, {"STELLA_CLUSTERS": "2", "STELLA_INTRA_BACKEND": "mpi"}, PYTEST,
                 marks=pytest.mark.slow),   # every suite with the mpi backend runs in np3-uneven-2+1
    # 59 s on a 2-core CI machine (4 ranks oversubscribed): gloo inside clusters of 2 runs by
    # default ("auto") in np2-one-cluster (the dense suites) and np4-2x2-device-path (2 x 2)
    pytest.param("np4-2x2-gloo", 4, {"STELLA_CLUSTERS": "2", "STELLA_INTRA_BACKEND": "gloo"}, DENSE,
                 marks=pytest.mark.slow),
    # Streaming DiLoCo's fragments, and the inner steps' channel, on two clusters of two ranks (in the
    # default run they go with the device path's layout, one launch less)
    pytest.param("np4-2x2-fragments", 4, {"STELLA_CLUSTERS": "2", "STELLA_INTRA_BACKEND": "mpi"},
                 PYTEST[:7] + [FRAGMENTS, CHANNEL], marks=pytest.mark.slow),
    # the CUDA route's code (torch-op selection, device-side scatter) on CPU tensors: every sparse
    # and CPU-engine check of the host route must hold on it too
    ("np4-2x2-device-path", 4, {"STELLA_CLUSTERS": "2", "STELLA_DEVICE_PATH": "torch"},
     SPARSE + ["tests/mpi/test_cpu_engine.py"] + DEVICE + [FRAGMENTS, CHANNEL]),
]


def _check(proc, what):
    tail = (proc.stdout[-6000:] + "\n" + proc.stderr[-6000:])
    assert proc.returncode == 0, "%s failed (exit %d):\n%s" % (what, proc.returncode, tail)
    assert " passed" in proc.stdout, tail


@pytest.mark.parametrize("name,np_,env,suites", LAYOUTS, ids=[x.values[0] if hasattr(x, "values") else x[0]
                                                               for x in LAYOUTS])
def test_suites_on_layout(name, np_, env, suites):
    _check(run_mpi(np_, suites, env=env, timeout=400), name)


def test_suites_on_uneven_interleaved_clusters():
    """STELLA_CLUSTER labels a,b,a with the mpi intra backend: two clusters, one of two ranks
    that are not consecutive (0 and 2), one of rank 1 alone; every suite but the device route's.
    Uneven and interleaved clusters in one job of three ranks (it stands for np3-uneven-2+1 and
    the four-rank interleaved layout below in the default run)."""
    # (the device route's comparisons run in np4-2x2-device-path)
    parts = [(1, {"STELLA_CLUSTER": lab}, PYTEST) for lab in ("a", "b", "a")]
    _check(run_mpmd(parts, timeout=400, env={"STELLA_INTRA_BACKEND": "mpi"}), "labels a,b,a")


@pytest.mark.slow   # interleaved labels run by default in test_suites_on_uneven_interleaved_clusters
def test_suites_with_interleaved_cluster_labels():
    """STELLA_CLUSTER labels a,b,a,b: clusters are not blocks of consecutive ranks. The suites
    whose routes map ranks to clusters: collectives, the optimizer (automatic route, local steps,
    mode switch), the sparse route and the CPU engine's shards."""
    suites = DENSE + ["tests/mpi/test_sparse.py", "tests/mpi/test_cpu_engine.py"]
    parts = [(1, {"STELLA_CLUSTER": lab}, suites) for lab in ("a", "b", "a", "b")]
    _check(run_mpmd(parts, timeout=400), "labels a,b,a,b")


@pytest.mark.slow   # uneven clusters are in the default run as np3-uneven-2+1
def test_suites_with_uneven_labels():
    parts = [(3, {"STELLA_CLUSTER": "site-a"}, DENSE), (1, {"STELLA_CLUSTER": "site-b"}, DENSE)]
    _check(run_mpmd(parts, timeout=400), "labels 3+1")
