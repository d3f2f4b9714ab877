"""The planner's prediction from a calibration record (the arithmetic of stella_mpi/plan/predict.py
and report.py, no MPI): it follows the link, the oversubscription of a host, revocations and
prices, and refuses what it cannot predict with the reason."""
import copy
import math

import pytest
import torch

from stella_mpi.comm.buffers import split_counts
from stella_mpi.plan import routes as route_table
from stella_mpi.plan import wire
from stella_mpi.plan.gpus import load_table
from stella_mpi.plan.predict import Cluster, Layout, Machine, predict, time_to_target
from stella_mpi.plan.report import plan, table_text

PARAMS = [8192, 262144, 256, 65536, 256, 65536, 256]


def calibration(**over):
    rec = {"step_s": 0.03, "compute_s": 0.01, "optimizer_call_s": 0.02, "exchange_s": 0.01, "cpu_s": 0.004,
           "wan_bytes_sent": 20000.0, "wan_bytes_received": 20000.0, "wan_messages": 4.0, "residual_ratio": 1.0}
    c = {"ranks": 2, "clusters": 2, "link": {"latency_s": 1e-4, "pair_bps": 1e9, "bandwidth_bps": 1e9},
         "fabric_bps": 2e10, "kernel_costs": None, "global_batch": 64, "per_rank_batch": 32,
         "param_numels": PARAMS, "optimizer_s": 0.002,
         "compute": [{"per_sample_s": 2e-4, "intercept_s": 1e-3, "flops_per_sample": 3e6}] * 2,
         "routes": {r.name: {"ranks": [dict(rec)] * 2, "curve": [(0, 5.5), (50, 4.0), (100, 3.0)], "steps": 100,
                             "step_s": 0.03, "steps_to_target": 75.0} for r in route_table.ROUTES}}
    c.update(over)
    return c


def layout(link=100e6, sizes=(2, 2), kind="here", cores=2, **kw):
    return Layout([Cluster(count=n, kind=kind, link_bps=link, **kw) for n in sizes], global_batch=64, cores=cores)


def test_a_slower_link_costs_exactly_its_bytes():
    m = Machine(calibration())
    dense = route_table.BY_NAME["dense"]
    fast, slow = (predict(dense, layout(rate), m, PARAMS) for rate in (100e6, 20e6))
    assert slow["cluster_uplink_bytes_per_step"] == fast["cluster_uplink_bytes_per_step"] > 0
    extra = 8 * fast["cluster_uplink_bytes_per_step"] * (1 / 20e6 - 1 / 100e6)
    assert slow["step_s"] - fast["step_s"] == pytest.approx(extra, rel=1e-9)
    assert slow["utilisation"] < fast["utilisation"] <= 1


def test_ranks_sharing_a_host_slow_each_other():
    m = Machine(calibration())
    dense = route_table.BY_NAME["dense"]
    two = predict(dense, layout(sizes=(1, 1), cores=2), m, PARAMS)
    eight = predict(dense, layout(sizes=(4, 4), cores=2), m, PARAMS)
    # the same global batch over 4x the ranks, each rank with a quarter of a core
    per_rank = lambda n: 1e-3 + 2e-4 * 64 / n
    assert two["compute_s"] == pytest.approx(per_rank(2))
    assert eight["compute_s"] == pytest.approx(per_rank(8) * 4)


def test_local_steps_pay_the_exchange_once_per_period():
    m = Machine(calibration())
    p8 = predict(route_table.BY_NAME["local-8-thc4"], layout(), m, PARAMS)
    p32 = predict(route_table.BY_NAME["local-32-thc4"], layout(), m, PARAMS)
    assert p32["wan_bytes_per_step"] == pytest.approx(p8["wan_bytes_per_step"] / 4, rel=1e-6)
    assert p32["step_s"] < p8["step_s"]


def test_replicas_of_one_rank_reduce_inside_the_cluster_once_a_period():
    """local-32-thc4-rank (``LocalSteps(inner="rank")``): the same WAN bytes as local-32-thc4, and
    a step shorter by the cluster's dense reduction at 31 of every 32 steps (the exchange still
    reduces the pseudo-gradient inside the cluster, once); with clusters of one rank, nothing
    to save."""
    m = Machine(calibration())
    cluster, rank = route_table.BY_NAME["local-32-thc4"], route_table.BY_NAME["local-32-thc4-rank"]
    assert rank.wire.inner == "rank" and rank.wire.every == 32
    for sizes in ((2, 2), (4, 4)):
        c, r = (predict(x, layout(sizes=sizes, cores=8), m, PARAMS) for x in (cluster, rank))
        assert r["wan_bytes_per_step"] == c["wan_bytes_per_step"] and c["intra_s"] > 0
        assert r["intra_s"] == pytest.approx(c["intra_s"] / 32, rel=1e-12)
        assert c["step_s"] - r["step_s"] == pytest.approx(c["intra_s"] * 31 / 32, rel=1e-9)
    c, r = (predict(x, layout(sizes=(1, 1)), m, PARAMS) for x in (cluster, rank))
    assert r["intra_s"] == c["intra_s"] == 0 and r["step_s"] == pytest.approx(c["step_s"], rel=1e-12)


def test_local_sparseloco_sends_what_its_encoder_writes_once_per_period():
    """local-8-sparseloco1 on clusters of two: each rank sends, once per 8 steps, the payload the
    real SparseLoCo encoder writes for its shard of each pseudo-gradient bucket (and its 8-byte
    size), gathered by the other cluster."""
    m = Machine(calibration())
    route = route_table.BY_NAME["local-8-sparseloco1"]
    comp = route.wire.pseudo.make_compressor()
    gen = torch.Generator().manual_seed(0)
    sent = 0
    for n in wire.pseudo_buckets(PARAMS):
        shard = split_counts(n, 2)[0]   # rank 0's, the largest
        sent += wire.measured_payload(comp, torch.randn(shard, generator=gen)).bytes + 8
    pred = predict(route, layout(), m, PARAMS)
    assert pred["wan_bytes_per_step"] == pytest.approx(sent / 8, rel=1e-12)
    assert predict(route_table.BY_NAME["local-32-sparseloco1"], layout(), m, PARAMS)["wan_bytes_per_step"] == \
        pytest.approx(sent / 32, rel=1e-12)
    thc = predict(route_table.BY_NAME["local-8-thc4"], layout(), m, PARAMS)
    assert pred["wan_bytes_per_step"] < thc["wan_bytes_per_step"] / 5


def _fragments(delay):
    return route_table.PlanRoute("f4-delay%d" % delay, wire.Route(kind="local", every=8, fragments=4, delay=delay,
                                                                   pseudo=wire.Route(kind="thc", bits=4)))


def test_fragments_send_a_period_s_bytes_and_hide_one_pass_per_exchange():
    """local-8-f4-thc4: the period's bytes are the whole model's (4 exchanges of a fragment
    each); with a delay each exchange hides behind one inner step's pass, no more: on a link so
    slow that every fragment's wire outlasts a pass, the delay saves 4 passes per 8 steps."""
    m = Machine(calibration())
    f4 = predict(route_table.BY_NAME["local-8-f4-thc4"], layout(), m, PARAMS)
    whole = predict(route_table.BY_NAME["local-8-thc4"], layout(), m, PARAMS)
    assert f4["wan_bytes_per_step"] == pytest.approx(whole["wan_bytes_per_step"], rel=0.01)
    assert f4["messages_per_step"] > whole["messages_per_step"]
    slow = layout(link=1e4)
    blocking, delayed = (predict(_fragments(d), slow, m, PARAMS) for d in (0, 1))
    assert delayed["wan_bytes_per_step"] == blocking["wan_bytes_per_step"]
    assert blocking["step_s"] - delayed["step_s"] == pytest.approx(4 * delayed["compute_s"] / 8, rel=1e-9)
    # on a fast link each exchange's wire hides whole: what remains is its CPU work
    fast = layout(link=1e12)
    blocking, delayed = (predict(_fragments(d), fast, m, PARAMS) for d in (0, 1))
    assert delayed["step_s"] < blocking["step_s"]
    assert delayed["step_s"] == pytest.approx(blocking["step_s"] - blocking["wire_s"]
                                              - blocking["messages_per_step"] * m.calib["link"]["latency_s"],
                                              rel=1e-9)


def test_revocations_and_prices():
    lay = layout(price=2.0, revocations=0.5)
    pred = {"step_s": 1.0}
    t = time_to_target(pred, 3600, lay, commit_every=100)
    # 4 GPUs x 0.5 per hour = 2 revocations per hour, each losing 50 steps + the reset
    share = 2 / 3600 * (50 + 5.0)
    assert t["seconds_with_revocations"] == pytest.approx(3600 / (1 - share))
    assert t["cost_usd"] == pytest.approx(t["seconds_with_revocations"] / 3600 * 4 * 2.0)
    doomed = time_to_target(pred, 3600, layout(revocations=1000.0), commit_every=100)
    assert math.isinf(doomed["seconds_with_revocations"]) and "commit more often" in doomed["revocation_note"]


def _spec(**over):
    s = {"model": {"source": "x.py"}, "clusters": [{"count": 2, "kind": "here", "link": 100e6}] * 2,
         "global_batch": 64, "target_loss": 3.5, "target_steps": None, "budget_hours": None, "commit_every": 100,
         "routes": None, "fusion_threshold_mb": None, "cores": 2, "link_delay_s": 0.0}
    s.update(over)
    return s


def test_the_plan_recommends_the_soonest_and_says_what_cannot_reach():
    calib = calibration()
    calib["routes"]["dense"]["steps_to_target"] = None
    result = plan(_spec(), calib, load_table())
    rows = {r["route"]: r for r in result["predictions"]}
    assert rows["dense"]["unreachable"] == "not reached in the calibration's 100 steps"
    best = min((r for r in rows.values() if "to_target" in r), key=lambda r: r["to_target"]["seconds"])
    assert result["recommendation"]["route"] == best["route"]
    text = table_text(result)
    assert "recommended: %s" % best["route"] in text and "not reached" in text


def test_a_budget_too_small_is_said():
    result = plan(_spec(budget_hours=1e-6), calibration(), load_table())
    assert all(r["unreachable"].startswith("needs more than the budget") for r in result["predictions"])
    assert "no route reaches the target within the budget" in result["recommendation"]["why"]


def test_gpu_kinds_take_compute_from_flops_and_an_unknown_kind_is_named():
    calib = calibration()
    result = plan(_spec(clusters=[{"count": 4, "kind": "h100", "link": 1e9}, {"count": 2, "kind": "rtx4090",
                                                                                 "link": 1e9}]), calib, load_table())
    split = result["recommendation"]["batch_split"]
    assert sum(split) == 64 and split[0] > split[-1]   # the faster kind takes more of the batch
    with pytest.raises(ValueError) as e:
        plan(_spec(clusters=[{"count": 1, "kind": "tpu9", "link": 1e9}] * 2), copy.deepcopy(calib), load_table())
    assert "tpu9" in str(e.value) and "h100" in str(e.value) and "--gpu-table" in str(e.value)


def test_steps_to_a_target_interpolate_between_evaluations():
    from stella_mpi.plan.predict import steps_to
    curve = [(0, 5.5), (50, 4.0), (100, 3.0)]
    assert steps_to(curve, 3.5) == pytest.approx(75.0)
    assert steps_to(curve, 6.0) == 0.0 and steps_to(curve, 2.9) is None


def test_an_all_reduce_over_three_clusters_takes_the_probes_goodput_a_transfer_does_not():
    calib = calibration(link={"latency_s": 1e-4, "pair_bps": 1e9, "bandwidth_bps": 1e9, "efficiency": 0.9,
                              "allreduce_efficiency": 0.3})
    m = Machine(calib)
    lay = layout(sizes=(1, 1, 1))
    thc, fp16 = (predict(route_table.BY_NAME[n], lay, m, PARAMS) for n in ("thc-4", "fp16"))
    assert thc["wire_s"] == pytest.approx(8 * thc["cluster_uplink_bytes_per_step"] / (100e6 * 0.3))
    assert fp16["wire_s"] == pytest.approx(8 * fp16["cluster_uplink_bytes_per_step"] / (100e6 * 0.9))
    two = predict(route_table.BY_NAME["thc-4"], layout(sizes=(1, 1)), m, PARAMS)   # a swap between two
    assert two["wire_s"] == pytest.approx(8 * two["cluster_uplink_bytes_per_step"] / (100e6 * 0.9))


def test_the_density_warm_up_adds_its_extra_traffic_to_the_time():
    m = Machine(calibration())
    topk = predict(route_table.BY_NAME["topk-1%"], layout(link=20e6), m, PARAMS)
    assert topk["warmup_extra_s"] > 0
    t = time_to_target(topk, 100, layout(link=20e6), commit_every=100)
    assert t["seconds"] == pytest.approx(100 * topk["step_s"] + topk["warmup_extra_s"])
    assert predict(route_table.BY_NAME["thc-4"], layout(), m, PARAMS)["warmup_extra_s"] == 0
