"""bench/report.py (the report command) draws any bench JSON: records become line panels (one per unit), numbers
outside them bar panels, ratios apart."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench"))
import report  # noqa: E402

SAMPLE = {
    "command": "bench/bench_x.py --steps 3",
    "curve": [{"mode": "sparse", "seconds": t, "validation_loss": 5 - t, "step": 10 * t} for t in range(4)]
    + [{"mode": "dense", "seconds": t, "validation_loss": 5 - t / 2, "step": t} for t in range(4)],
    "summary": {"sparse_vs_dense": 0.4, "dense": {"step_s": 0.9, "bytes": 4.7e6}, "label": "text is skipped"},
    "selection": [{"n": 1 << 20, "torch_topk_s": 0.008, "cacheaware_s": 0.002, "cacheaware_vs_torch_topk": 0.25}],
}


def test_panels_of_a_result():
    panels = report.panels_of(SAMPLE)
    titles = [t for _, t, _ in panels]
    assert "curve: validation_loss" in titles and "curve: step" in titles
    assert "selection: seconds" in titles and "selection: ratio" in titles
    bars = dict((t, c) for k, t, c in panels if k == "bars")
    assert bars["ratios (1 = the baseline)"] == [("summary.sparse_vs_dense", 0.4)]
    assert ("summary.dense.step_s", 0.9) in bars["values"]
    assert not any("label" in p for p, _ in bars["values"])


def test_draws_a_png_per_file(tmp_path):
    pytest.importorskip("matplotlib")
    files = []
    for name, data in (("a", SAMPLE), ("b", {"results": [{"trial": i, "ms": i * 2.0} for i in range(5)]})):
        path = tmp_path / (name + ".json")
        path.write_text(json.dumps(data))
        files.append(str(path))
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"command": "nothing numeric"}))
    assert report.main(files + [str(empty), "--out-dir", str(tmp_path / "png")]) == 0
    for name in ("a", "b"):
        png = tmp_path / "png" / (name + ".png")
        assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 5000
    assert not (tmp_path / "png" / "empty.png").exists()


def test_a_broken_file_is_reported(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert report.main([str(bad)]) == 1
    assert "bad.json" in capsys.readouterr().err
