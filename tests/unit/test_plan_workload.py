"""The planner's model scripts: a failing script is named with its own error; the entry point's
contract is checked; named sizes list their parameters without allocating them."""
import pytest

from stella_mpi.plan import workload


def test_a_script_that_fails_is_named_with_its_own_error(tmp_path):
    bad = tmp_path / "bad_model.py"
    bad.write_text("def stella_plan(batch_size, rank):\n    raise RuntimeError('no data here')\n")
    with pytest.raises(workload.ModelScriptError) as e:
        workload.load(str(bad), 4, 0)
    assert str(bad) in str(e.value) and "no data here" in str(e.value) and "batch_size=4" in str(e.value)
    broken = tmp_path / "broken.py"
    broken.write_text("import nonexistent_module_xyz\n")
    with pytest.raises(workload.ModelScriptError) as e:
        workload.load(str(broken), 4, 0)
    assert "while loading" in str(e.value) and "nonexistent_module_xyz" in str(e.value)


def test_the_entry_point_contract(tmp_path):
    none = tmp_path / "none.py"
    none.write_text("x = 1\n")
    with pytest.raises(workload.ModelScriptError, match="has no function stella_plan"):
        workload.load(str(none), 4, 0)
    partial = tmp_path / "partial.py"
    partial.write_text("def build(batch_size, rank):\n    return {'model': None}\n")
    with pytest.raises(workload.ModelScriptError, match="returned no next_batch"):
        workload.load(str(partial) + ":build", 4, 0)
    with pytest.raises(ValueError, match="no such script"):
        workload.check_source(str(tmp_path / "missing.py"))
    with pytest.raises(ValueError, match="neither a named size"):
        workload.check_source("13b")


def test_named_sizes_are_llama_shapes():
    counts = {name: sum(size.param_numels()) for name, size in workload.SIZES.items()}
    assert 100e6 < counts["100m"] < 200e6 and 1.0e9 < counts["1b"] < 1.5e9
    assert 6.5e9 < counts["7b"] < 7.0e9 and 68e9 < counts["70b"] < 70e9
