"""stella_mpi/plan/gpus.py: the GPU table, its JSON extension and the errors that name the fix."""
import json

import pytest

from stella_mpi.plan import gpus


def test_compute_per_sample_is_six_n_t_over_peak_times_mfu():
    h100 = gpus.get_gpu("H100")
    s = h100.compute_s_per_sample(7e9, 2048)
    assert s == pytest.approx(6 * 7e9 * 2048 / (989e12 * 0.40))
    assert gpus.compute_s_per_sample("a100-80gb", 1e9, 1024, mfu=0.5) == pytest.approx(6e9 * 1024 / (312e12 * 0.5))
    for kind in ("rtx3090", "rtx4090", "a10g", "l4", "t4", "v100", "a100-40gb", "a100-80gb", "h100", "h200"):
        g = gpus.get_gpu(kind)
        assert g.tflops > 0 and g.memory_gib > 0 and 0 < g.mfu <= 1 and g.intra_gbps > 0 and g.source


def test_unknown_kind_lists_the_known_ones_and_how_to_add_one(monkeypatch):
    monkeypatch.delenv(gpus.ENV, raising=False)
    with pytest.raises(ValueError) as e:
        gpus.get_gpu("b300")
    msg = str(e.value)
    assert "'b300'" in msg and "h100" in msg and "rtx3090" in msg
    assert "--gpu-table" in msg and gpus.ENV in msg and '"tflops"' in msg


def test_a_json_table_adds_and_overrides_kinds(tmp_path, monkeypatch):
    path = tmp_path / "gpus.json"
    path.write_text(json.dumps({"B200": {"tflops": 2250, "memory_gib": 180, "mfu": 0.4, "intra_gbps": 900},
                                "h100": {"mfu": 0.5}}))
    table = gpus.load_table(str(path))
    assert table["b200"].tflops == 2250 and "gpus.json" in table["b200"].source
    assert table["h100"].mfu == 0.5 and table["h100"].tflops == 989
    monkeypatch.setenv(gpus.ENV, str(path))
    assert gpus.get_gpu("b200").memory_gib == 180


@pytest.mark.parametrize("entry, words", [
    ({"tflops": 100}, ["lacks", "memory_gib"]),
    ({"tflops": -1, "memory_gib": 1, "mfu": 0.3, "intra_gbps": 1}, ["tflops", "-1"]),
    ({"tflops": 1, "memory_gib": 1, "mfu": 1.5, "intra_gbps": 1}, ["mfu", "<= 1"]),
    ({"tflops": 1, "memory_gib": 1, "mfu": 0.3, "intra_gbps": 1, "tflop": 2}, ["unknown fields", "tflop"]),
])
def test_a_bad_table_entry_names_the_field(tmp_path, entry, words):
    path = tmp_path / "gpus.json"
    path.write_text(json.dumps({"x1": entry}))
    with pytest.raises(ValueError) as e:
        gpus.load_table(str(path))
    for w in words:
        assert w in str(e.value)


def test_an_unreadable_table_names_the_file(tmp_path):
    with pytest.raises(ValueError, match="cannot be read"):
        gpus.load_table(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        gpus.load_table(str(bad))
