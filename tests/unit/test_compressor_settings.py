"""A sparse compressor rebuilt from its settings (what a joined rank does with a collective's
description) has the same settings, for every built-in sparse compressor; an unknown name or
malformed settings are refused with a clear error."""
import pytest

from stella_mpi.compression.registry import BUILT_IN, get_factory

CASES = [("topk", {}), ("cacheaware", {}), ("cacheaware", {"singles": 0.7, "value_dtype": "float16"}), ("randomk", {}), ("threshold", {"exact": True, "slack": 3.0}),
         ("threshold", {}), ("topk", {"density": 0.5, "value_dtype": "float16", "error_feedback": False})]


@pytest.mark.parametrize("name,kwargs", CASES)
def test_rebuilt_from_settings(name, kwargs):
    comp = BUILT_IN[name](**kwargs)
    again = get_factory(name).from_settings(list(comp.settings()))
    assert type(again) is type(comp) and again.settings() == comp.settings()


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="unknown compressor"):
        get_factory("nope")
    with pytest.raises(ValueError, match="no extra settings"):
        BUILT_IN["topk"].from_settings(["topk", 0.1, "float32", True, "extra"])
