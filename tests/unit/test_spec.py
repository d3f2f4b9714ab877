"""What DistributedOptimizer is asked for (stella_mpi/optim/spec.py), without any rank: the
route each spec means, the automatic route's conditions, the defaults that keep quality,
the previous release's keywords (each warns, naming its new place), and the one table of
refusals (each message names the value and the fix)."""
import dataclasses
import os
import subprocess
import sys
import warnings

import pytest
import torch

import stella_mpi as hvd
from stella_mpi.optim.spec import REFUSALS, Spec, build_spec, refuse

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _model():
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def spec(optimizer=None, clusters=1, compression=hvd.Compression.none, passes=1, op=hvd.Average, engine=None,
         local_steps=None, adjuster=None, wan_route=None, **legacy):
    """The spec of a DistributedOptimizer call, as if the job spanned ``clusters`` clusters."""
    optimizer = optimizer or torch.optim.SGD(_model().parameters(), lr=0.1, momentum=0.9)
    s = build_spec(optimizer, compression, passes, op, 1.0, 0, None, False, hvd.global_process_set, engine,
                   local_steps, adjuster, legacy)
    return dataclasses.replace(s, clusters=clusters, **({"wan_route": wan_route} if wan_route else {})), optimizer


def kind(**kw):
    return spec(**kw)[0].route_kind()


def refused(**kw):
    s, opt = spec(**kw)
    with pytest.raises(ValueError) as e:
        refuse(s, opt)
    return str(e.value)


def test_the_route_each_spec_means():
    assert kind() == "dense"                              # one cluster: nothing changes
    assert kind(clusters=2) == "auto"                     # a Horovod script across clusters
    assert kind(clusters=2, compression=hvd.Compression.fp16) == "auto"
    assert kind(clusters=2, wan_route="dense") == "dense"     # STELLA_WAN_ROUTE=dense: Horovod's numerics
    assert kind(clusters=2, op=hvd.Sum) == "dense"            # what the automatic route does not take
    assert kind(clusters=2, passes=2) == "dense"
    assert kind(clusters=2, compression=hvd.Compression.topk(0.01)) == "sparse"   # means what it says
    assert kind(clusters=2, compression=hvd.Compression.thc(bits=4)) == "thc"
    assert kind(clusters=2, engine=hvd.CpuEngine()) == "cpu"
    assert kind(clusters=2, op=hvd.Adasum) == "adasum"
    assert kind(clusters=2, local_steps=hvd.LocalSteps(every=4)) == "dense"       # local steps as asked
    assert kind(clusters=2, local_steps=hvd.LocalSteps(every=4), adjuster=hvd.Adjuster(modes=("sync", "local"))) \
        == "auto"


def test_momentum_correction_is_on_where_it_applies():
    sgd = torch.optim.SGD(_model().parameters(), lr=0.1, momentum=0.9)
    on = spec(sgd, clusters=2, compression=hvd.Compression.cacheaware(0.01))[0]
    assert on.wants_momentum_correction(sgd.param_groups)
    assert spec(sgd, clusters=2)[0].wants_momentum_correction(sgd.param_groups)          # the automatic route
    off = hvd.Compression.cacheaware(0.01, momentum_correction=False)
    assert not spec(sgd, clusters=2, compression=off)[0].wants_momentum_correction(sgd.param_groups)
    plain = torch.optim.SGD(_model().parameters(), lr=0.1)
    assert not spec(plain, clusters=2, compression=hvd.Compression.topk(0.01))[0].wants_momentum_correction(
        plain.param_groups)                                                               # no momentum to correct
    adam = torch.optim.Adam(_model().parameters())
    assert not spec(adam, clusters=2, compression=hvd.Compression.topk(0.01))[0].wants_momentum_correction(
        adam.param_groups)
    thc = spec(sgd, clusters=2, compression=hvd.Compression.thc(bits=4))[0]
    assert not thc.wants_momentum_correction(sgd.param_groups)                            # thc holds nothing back
    local = spec(sgd, clusters=2, compression=hvd.Compression.topk(0.01), local_steps=hvd.LocalSteps(every=2))[0]
    assert not local.wants_momentum_correction(sgd.param_groups)
    assert on.warmup_steps() == 50 and hvd.Compression.cacheaware(0.01).singles == 0.7


def test_the_previous_releases_keywords_warn_naming_the_new_place():
    with pytest.warns(DeprecationWarning, match=r"now lives in the compressor: Compression.<name>\(density=..., "
                                                r"momentum_correction=...\)"):
        s, _ = spec(compression=hvd.Compression.topk(0.01), momentum_correction=True)
    assert s.momentum_correction is True
    with pytest.warns(DeprecationWarning, match=r"warmup=\.\.\."):
        assert spec(compression=hvd.Compression.topk(0.01), density_warmup=7)[0].warmup_steps() == 7
    for name, value in (("dense_below", 100), ("local_clip", 1.0)):
        with pytest.warns(DeprecationWarning, match="measured no gain"):
            spec(compression=hvd.Compression.topk(0.01), **{name: value})
    with pytest.warns(DeprecationWarning, match=r"engine=hvd.CpuEngine\(staleness=...\)"):
        s, _ = spec(engine="cpu", staleness=1)
    assert s.engine == hvd.CpuEngine(staleness=1, warmup=0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'stalenes'"):
        spec(stalenes=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        spec(clusters=2, compression=hvd.Compression.cacheaware(0.01), engine=hvd.CpuEngine(staleness=1))


def test_every_refusal_names_the_value_and_the_fix():
    assert "combines whole deltas; a sparse compressor does not apply" in refused(
        op=hvd.Adasum, compression=hvd.Compression.topk(0.1))
    assert "STELLA_WAN_ROUTE=dense" in refused(clusters=2, wan_route="dense", adjuster=hvd.Adjuster())
    assert "op=hvd.Average of one backward pass" in refused(clusters=2, op=hvd.Sum, adjuster=hvd.Adjuster())
    assert "corrects SGD's momentum; the optimizer is Adam" in refused(
        optimizer=torch.optim.Adam(_model().parameters()), compression=hvd.Compression.topk(0.1, momentum_correction=True))
    with pytest.warns(DeprecationWarning):
        assert "needs a sparse compression" in refused(momentum_correction=True)
    with pytest.warns(DeprecationWarning):
        assert "thc holds none back" in refused(compression=hvd.Compression.thc(bits=4), momentum_correction=True)
    assert "RMSprop is not supported" in refused(optimizer=torch.optim.RMSprop(_model().parameters()),
                                                 engine=hvd.CpuEngine())
    assert "op must be hvd.Average" in refused(local_steps=hvd.LocalSteps(every=2), op=hvd.Sum)
    assert "pass one" in refused(compression=hvd.Compression.fp16,
                                 local_steps=hvd.LocalSteps(every=2, compression=hvd.Compression.fp16))
    assert "overlap=True sends the pseudo-gradient" in refused(compression=hvd.Compression.topk(0.1),
                                                               local_steps=hvd.LocalSteps(every=2, overlap=True))
    assert "must be sparse" in refused(compression=hvd.Compression.thc(bits=2), local_steps=hvd.LocalSteps(every=2),
                                       adjuster=hvd.Adjuster(modes=("sync", "local")))
    assert "engine must be None or hvd.CpuEngine" in refused(engine=object())
    with pytest.raises(ValueError, match="CpuEngine: staleness must be 0 or 1, not 2"):
        hvd.CpuEngine(staleness=2)
    with pytest.raises(ValueError, match="momentum_correction must be 'auto'"):
        hvd.Compression.topk(0.1, momentum_correction="yes")
    with pytest.raises(ValueError, match="warmup is the number of steps"):
        hvd.Compression.cacheaware(0.1, warmup=-1)
    # a spec that asks for nothing impossible passes every refusal
    s, opt = spec(clusters=2)
    assert all(check(s, opt) is None for check in REFUSALS)
    assert isinstance(s, Spec)


def test_an_unknown_wan_route_is_refused_when_the_package_is_imported():
    proc = subprocess.run([sys.executable, "-c", "import stella_mpi"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=dict(os.environ, STELLA_WAN_ROUTE="fast"))
    assert proc.returncode != 0
    assert "STELLA_WAN_ROUTE='fast': use 'auto' or 'dense'" in proc.stderr, proc.stderr[-2000:]


def test_pseudo_rungs_are_refused_where_nothing_chooses_among_them():
    rungs = hvd.Adjuster(pseudo_rungs=(hvd.Compression.thc(bits=4), hvd.Compression.sparseloco(0.01)))
    modes = dataclasses.replace(rungs, modes=("sync", "local"))
    topk = hvd.Compression.topk(0.01)
    assert "pass modes=('sync', 'local'), or leave compression out" in refused(clusters=2, compression=topk,
                                                                             adjuster=rungs)
    assert "compression is given twice" in refused(
        clusters=2, compression=topk, adjuster=modes,
        local_steps=hvd.LocalSteps(every=2, compression=hvd.Compression.fp16))
    assert "overlap sends the pseudo-gradient uncompressed" in refused(
        clusters=2, compression=topk, adjuster=modes, local_steps=hvd.LocalSteps(every=2, overlap=True))
    half = torch.optim.SGD(_model().half().parameters(), lr=0.1)
    assert "hvd.Adjuster(pseudo_rungs=...): a sparse compression takes float32 parameters, got torch.float16" in \
        refused(optimizer=half, clusters=2, adjuster=rungs)
    refuse(*spec(clusters=2, adjuster=rungs))                       # the automatic route chooses among them
    refuse(*spec(clusters=2, compression=topk, adjuster=modes))     # so does the mode switch


def test_fragments_are_refused_where_they_need_the_model_or_a_fixed_h():
    assert ("LocalSteps(fragments=5)): the optimizer has 4 trainable parameters and a fragment holds at least one "
            "whole parameter; pass fragments <= 4") in refused(local_steps=hvd.LocalSteps(every=5, fragments=5))
    modes = hvd.Adjuster(modes=("sync", "local"))
    for ls, got in ((hvd.LocalSteps(every=4, fragments=2), "fragments=2, delay=0"),
                    (hvd.LocalSteps(every=4, delay=1), "fragments=1, delay=1")):
        assert "pass LocalSteps(fragments=1, delay=0) (got %s), or leave modes out" % got in refused(
            clusters=2, compression=hvd.Compression.topk(0.01), local_steps=ls, adjuster=modes)
    for ls in (hvd.LocalSteps(every=4, fragments=4, delay=0), hvd.LocalSteps(every=4, fragments=2, delay=1, mix=0.5),
               hvd.LocalSteps(every=4, fragments=2, fragment_groups=[["0.weight", "2.bias"], ["0.bias", "2.weight"]])):
        s, opt = spec(clusters=2, local_steps=ls)
        refuse(s, opt)
