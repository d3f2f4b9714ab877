"""Ground truth of the wire model: the real runtime (every route of bench/plan_ground_truth.py,
one mpirun launch per layout, a real torch model under hvd.DistributedOptimizer) records
hvd.stats()["last_step"] on every rank after every step; wire.step_traffic must give the same
integers, every rank, every step. The 16-rank layouts (8 equal clusters; 3,3,2,2,2,2,1,1) are slow:
run them with ``pytest -m slow tests/test_plan_ground_truth.py`` (about 4 minutes on 2 cores)."""
import importlib.util
import os
import tempfile

import pytest

from mpi_launch import ROOT

pytestmark = pytest.mark.mpi

_spec = importlib.util.spec_from_file_location("plan_ground_truth", os.path.join(ROOT, "bench", "plan_ground_truth.py"))
gt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gt)


def _check(timeout, **layout):
    with tempfile.TemporaryDirectory() as tmp:
        routes = gt.run_launch(os.path.join(tmp, "records.json"), timeout, **layout)
    assert [name for name, _, _ in gt.routes()] == list(routes)
    for name, r in routes.items():
        for step, (want, got) in enumerate(zip(r["predicted"], r["measured"])):
            for rank, (w, g) in enumerate(zip(want, got)):
                assert w == g, "%s %s step %d rank %d: predicted %s, measured %s" % (layout, name, step, rank, w, g)
        assert r["match"]


def test_four_ranks_in_two_clusters():
    _check(300, np_=4, clusters=2)


@pytest.mark.slow   # (the default run keeps 4 ranks in 2 clusters)
def test_four_ranks_in_four_clusters():
    _check(300, np_=4, clusters=4)


@pytest.mark.slow
def test_three_ranks_in_unequal_clusters():
    _check(300, sizes=(2, 1))


@pytest.mark.slow
def test_sixteen_ranks_in_eight_clusters():
    _check(600, np_=16, clusters=8)


@pytest.mark.slow
def test_sixteen_ranks_in_unequal_clusters():
    _check(600, sizes=gt.UNEQUAL_16)
