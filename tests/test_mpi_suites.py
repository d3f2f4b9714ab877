"""Launch the per-rank suites in tests/mpi under mpirun, over several layouts:
one and two clusters, 2, 3 and 4 ranks, uneven clusters, interleaved cluster labels,
and both intra-cluster backends."""
import pytest

from mpi_launch import run_mpi, run_mpmd

pytestmark = pytest.mark.mpi

PYTEST = ["-m", "pytest", "-q", "-s", "-x", "-p", "no:cacheprovider", "tests/mpi"]

LAYOUTS = [
    ("np2-one-cluster", 2, {}),
    ("np2-two-clusters", 2, {"STELLA_CLUSTERS": "2"}),
    ("np3-one-cluster", 3, {}),
    ("np3-uneven-2+1", 3, {"STELLA_CLUSTERS": "2"}),
    ("np4-2x2-mpi", 4, {"STELLA_CLUSTERS": "2", "STELLA_INTRA_BACKEND": "mpi"}),
    ("np4-2x2-gloo", 4, {"STELLA_CLUSTERS": "2", "STELLA_INTRA_BACKEND": "gloo"}),
]


def _check(proc, what):
    tail = (proc.stdout[-6000:] + "\n" + proc.stderr[-6000:])
    assert proc.returncode == 0, "%s failed (exit %d):\n%s" % (what, proc.returncode, tail)
    assert " passed" in proc.stdout, tail


@pytest.mark.parametrize("name,np_,env", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_suites_on_layout(name, np_, env):
    _check(run_mpi(np_, PYTEST, env=env, timeout=400), name)


def test_suites_with_interleaved_cluster_labels():
    """STELLA_CLUSTER labels a,b,a,b: clusters are not blocks of consecutive ranks."""
    parts = [(1, {"STELLA_CLUSTER": lab}, PYTEST) for lab in ("a", "b", "a", "b")]
    _check(run_mpmd(parts, timeout=400), "labels a,b,a,b")


def test_suites_with_uneven_labels():
    parts = [(3, {"STELLA_CLUSTER": "site-a"}, PYTEST), (1, {"STELLA_CLUSTER": "site-b"}, PYTEST)]
    _check(run_mpmd(parts, timeout=400), "labels 3+1")
