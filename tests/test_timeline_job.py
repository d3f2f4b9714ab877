"""Horovod's timeline of a real 2-cluster job (2 clusters x 2 ranks under mpirun): the file loads
as a Chrome trace and holds, per tensor, its negotiation and queueing, the intra-cluster phases,
the sparse route's select / encode / exchange (with bytes) / decode / merge, the CPU engine's
update and the adjuster's decisions."""
import json
import os

import pytest

from mpi_launch import ROOT, run_mpi

pytestmark = pytest.mark.mpi
SCRIPT = os.path.join(ROOT, "tests", "scripts", "timeline_job.py")


def _run(tmp_path, env, args=()):
    proc = run_mpi(4, [SCRIPT] + list(args), env=dict({"STELLA_CLUSTERS": "2"}, **env), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _events(path):
    with open(path) as f:
        return json.load(f)


def _check(events):
    tensors = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    phases = {}
    for e in events:
        if e["ph"] == "X":
            phases.setdefault(tensors.get(e["pid"], "?"), {}).setdefault(e["name"], []).append(e)
    plain = phases["plain.allreduce"]
    assert {"QUEUE", "NEGOTIATE", "ALLREDUCE"} <= set(plain)
    # a dense bucket: reduce-scatter inside the cluster, the WAN exchange with its bytes, all-gather
    dense = [p for name, p in phases.items() if "WAN_EXCHANGE" in p and "SELECT" not in p and "cpu_engine" not in name
             and "link_probe" not in name]
    assert dense and all({"INTRA_REDUCE_SCATTER", "INTRA_ALLGATHER"} <= set(p) for p in dense)
    assert all(e["args"]["bytes_sent"] > 0 for p in dense for e in p["WAN_EXCHANGE"])
    sparse = [p for name, p in phases.items() if "SELECT" in p and "cpu_engine" not in name]
    assert sparse
    for p in sparse:
        assert {"SELECT", "ENCODE", "WAN_EXCHANGE", "DECODE", "MERGE", "SCATTER"} <= set(p)
        assert all(e["args"]["bytes_sent"] > 0 and e["args"]["bytes_received"] > 0 for e in p["WAN_EXCHANGE"])
        assert all(e["args"]["compressor"] == "cacheaware" for e in p["SELECT"])
    engine = [p for name, p in phases.items() if name.startswith("cpu_engine")]
    assert engine and all({"CPU_UPDATE", "CPU_OPTIMIZER", "SELECT"} <= set(p) for p in engine)
    # phases lie inside their op's execution
    for p in phases.values():
        for op_kind in ("ALLREDUCE", "SPARSE_ALLREDUCE", "CPU_UPDATE"):
            for outer in p.get(op_kind, []):
                assert outer["dur"] >= 0
    decisions = [e for e in events if e["ph"] == "i" and e["name"] == "ADJUSTER"]
    assert decisions and all("density" in e["args"] for e in decisions)
    # the automatic route: the link measured before its first step, the route it starts with
    probe = [p for name, p in phases.items() if name.startswith("link_probe")]
    assert probe and all("WAN_EXCHANGE" in p for p in probe)
    routes = [e for e in events if e["ph"] == "i" and e["name"] == "ROUTE"]
    assert routes and routes[0]["args"]["step"] == 0 and "link measured at" in routes[0]["args"]["reason"]


def test_horovod_timeline_variable(tmp_path):
    path = tmp_path / "timeline.json"
    _run(tmp_path, {"HOROVOD_TIMELINE": str(path)})
    _check(_events(path))
    assert not [f for f in os.listdir(tmp_path) if f != "timeline.json"]   # rank 0 only, as Horovod


@pytest.mark.slow   # (the default run writes the timeline through HOROVOD_TIMELINE)
def test_start_timeline_every_rank_with_cycles(tmp_path):
    _run(tmp_path, {}, [str(tmp_path / "tl.{rank}.json"), "api"])
    for rank in range(4):
        events = _events(tmp_path / ("tl.%d.json" % rank))
        _check(events)
        assert any(e["name"] == "CYCLE" for e in events)
