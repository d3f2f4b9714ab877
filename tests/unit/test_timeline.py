"""The timeline writer (base/timeline.py): a Chrome trace that loads as JSON, one process per
tensor, phases nested in their op, the size cap, and no cost when off."""
import json
import time

from stella_mpi.base import timeline


def _load(path):
    with open(path) as f:
        return json.load(f)


def test_events_and_names(tmp_path):
    path = tmp_path / "tl.json"
    timeline.start(str(path), mark_cycles=True)
    try:
        with timeline.op_scope("grad.w"):
            with timeline.span("SELECT", compressor="cacheaware") as s:
                s.args["entries"] = 7
            t = time.perf_counter()
            timeline.record("WAN_EXCHANGE", t, t + 0.002, bytes_sent=100)
        timeline.instant("ADJUSTER", density=0.01)
    finally:
        timeline.stop()
    events = _load(path)
    names = {e["args"]["name"]: e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert list(names) == ["grad.w"]
    select = next(e for e in events if e["name"] == "SELECT")
    assert select["ph"] == "X" and select["pid"] == names["grad.w"] and select["args"] == {
        "compressor": "cacheaware", "entries": 7}
    wan = next(e for e in events if e["name"] == "WAN_EXCHANGE")
    assert abs(wan["dur"] - 2000) < 1 and wan["args"]["bytes_sent"] == 100
    adj = next(e for e in events if e["name"] == "ADJUSTER")
    assert adj["ph"] == "i" and adj["args"]["density"] == 0.01


def test_off_costs_nothing_and_records_nothing(tmp_path):
    assert timeline.active() is None
    with timeline.span("SELECT") as s:
        assert s.args is None
    timeline.record("X", 0.0, 1.0)
    timeline.instant("Y")


def test_cap_stops_writing_and_says_so(tmp_path):
    path = tmp_path / "small.json"
    tl = timeline.start(str(path), max_bytes=4000)
    try:
        with timeline.op_scope("t"):
            for i in range(500):
                timeline.record("PHASE", 0.0, 0.001, i=i)
    finally:
        timeline.stop()
    assert tl.full and tl.dropped > 0
    events = _load(path)
    assert path.stat().st_size < 4000 + 400
    assert "cap reached" in events[-1]["name"]


def test_restart_closes_the_previous_file(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    timeline.start(str(a))
    timeline.start(str(b))
    timeline.instant("second")
    timeline.stop()
    assert _load(a) == [] and _load(b)[0]["name"] == "second"


def test_a_cap_below_the_first_event_still_gives_valid_json(tmp_path):
    path = tmp_path / "zero.json"
    timeline.start(str(path), max_bytes=0)
    timeline.instant("dropped")
    timeline.stop()
    events = _load(path)
    assert len(events) == 1 and "cap reached" in events[0]["name"]
