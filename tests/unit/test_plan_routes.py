"""stella_mpi/plan/routes.py: each route builds the optimizer whose traffic the wire model counts
(the calibration measures its quality on that optimizer), without MPI: the Horovod functions are
stood in for by ones that record what they were given."""
from types import SimpleNamespace

import pytest

from stella_mpi.compression import Compression
from stella_mpi.compression.sparseloco import SparseLoCoCompressor
from stella_mpi.compression.thc import THCCompressor
from stella_mpi.optim.outer_sync import LocalSteps
from stella_mpi.plan import routes as route_table
from stella_mpi.plan.wire import Route


def built(name):
    """The keyword arguments route ``name`` gives hvd.DistributedOptimizer."""
    hvd = SimpleNamespace(DistributedOptimizer=lambda optimizer, **kw: kw, LocalSteps=LocalSteps,
                          Compression=Compression)
    model = SimpleNamespace(named_parameters=lambda: [])
    return route_table.BY_NAME[name].build(hvd, None, model)


@pytest.mark.parametrize("name,every", [("local-8-sparseloco1", 8), ("local-32-sparseloco1", 32)])
def test_sparseloco_routes_build_sparseloco_s_recipe(name, every):
    kw = built(name)
    ls = kw["local_steps"]
    assert (ls.every, ls.outer, ls.fragments, ls.delay) == (every, "sum", 1, 0)
    comp = ls.compression
    assert isinstance(comp, SparseLoCoCompressor)
    assert (comp.density, comp.chunk, comp.bits, comp.feedback_decay) == (0.01, 4096, 2, 0.95)
    # the compressor the wire model counts is the one built
    assert route_table.BY_NAME[name].wire.pseudo.make_compressor().settings() == comp.settings()


def test_fragments_route_builds_streaming_local_steps():
    ls = built("local-8-f4-thc4")["local_steps"]
    assert (ls.every, ls.fragments, ls.delay, ls.outer) == (8, 4, 1, "average")
    assert isinstance(ls.compression, THCCompressor) and ls.compression.bits == 4


def test_thc_local_steps_keep_their_pseudo_gradient_compression():
    ls = built("local-8-thc4")["local_steps"]
    assert isinstance(ls.compression, THCCompressor) and ls.compression.bits == 4 and ls.outer == "average"
    assert built("thc-2")["compression"].bits == 2


def test_replicas_route_builds_local_steps_with_each_rank_a_replica():
    ls = built("local-32-thc4-rank")["local_steps"]
    assert (ls.every, ls.inner, ls.fragments, ls.delay) == (32, "rank", 1, 0)
    assert isinstance(ls.compression, THCCompressor) and ls.compression.bits == 4
    assert built("local-32-thc4")["local_steps"].inner == "cluster"


def test_route_names_are_unique():
    assert len(route_table.BY_NAME) == len(route_table.ROUTES)
    assert route_table.select("local-8-f4-thc4,local-8-sparseloco1") == [
        route_table.BY_NAME["local-8-f4-thc4"], route_table.BY_NAME["local-8-sparseloco1"]]


@pytest.mark.parametrize("make,match", [
    (lambda: route_table.PlanRoute("x", Route("local", every=2), outer="adam"), "outer must be one of.*'adam'"),
    (lambda: route_table.PlanRoute("x", Route("dense"), outer="sum"), "outer='sum' is local steps'.*'dense'"),
    (lambda: route_table.select("local-8-sparseloco2"), "unknown route.*local-8-sparseloco2.*local-8-sparseloco1"),
])
def test_refusals_name_the_value(make, match):
    with pytest.raises(ValueError, match=match):
        make()
