"""bench/provenance.py says what produced a bench result (commit, versions, machine), and every
JSON a bench writes carries it under "provenance": a static check of bench/*.py, no bench run."""
import ast
import glob
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

from provenance import provenance  # noqa: E402

FIELDS = ("commit", "dirty", "date", "python", "torch", "cuda", "gpu", "numpy", "mpi4py", "mpi_library", "cores",
          "machine", "processor", "platform", "argv")


def test_provenance_names_the_commit_versions_and_machine():
    had_mpi = "mpi4py.MPI" in sys.modules
    p = provenance()
    assert set(FIELDS) <= set(p), set(FIELDS) - set(p)
    json.dumps(p)   # plain JSON values only
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode == 0:
        assert p["commit"] == head.stdout.strip() and isinstance(p["dirty"], bool)
    import numpy
    import torch
    assert p["python"] == "%d.%d.%d" % sys.version_info[:3]
    assert p["torch"] == torch.__version__ and p["numpy"] == numpy.__version__
    assert p["cuda"] == torch.version.cuda
    assert (p["gpu"] is None) == (not torch.cuda.is_available())
    assert p["cores"] == os.cpu_count() and p["machine"] and p["date"][:2] == "20"
    assert p["mpi_library"] and "MPICH" in p["mpi_library"]   # the mpich wheel
    assert ("mpi4py.MPI" in sys.modules) == had_mpi, "provenance() must not import (so initialise) MPI"


def _assigned_in(func, name):
    """The source of the assignments to ``name`` in ``func``."""
    return [n.value for n in ast.walk(func) if isinstance(n, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == name for t in n.targets)]


def _dump_calls(path):
    """[(enclosing function name, call node, its source)] for every json.dump in ``path``."""
    src = open(path).read()
    out = []

    def visit(node, func):
        for child in ast.iter_child_nodes(node):
            inner = child if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            if (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute) and child.func.attr == "dump"
                    and isinstance(child.func.value, ast.Name) and child.func.value.id == "json"):
                out.append((inner, child, src))
            visit(child, inner)
    visit(ast.parse(src), None)
    return out


def test_every_bench_json_carries_provenance():
    """Each json.dump in bench/ writes "provenance": provenance() (in the call, or in the dict it
    dumps), except in a function named ``worker``: the ranks of a two-cluster bench hand their
    rows to the same file's launcher side, whose JSON records it."""
    writers, missing = [], []
    for path in sorted(glob.glob(os.path.join(ROOT, "bench", "*.py"))):
        calls = _dump_calls(path)
        if calls:
            writers.append(os.path.basename(path))
        for func, call, src in calls:
            where = "%s:%d" % (os.path.relpath(path, ROOT), call.lineno)
            if func is not None and func.name == "worker":
                assert "provenance()" in src, where + ": a worker's launcher side must record provenance"
                continue
            text = ast.get_source_segment(src, call)
            if "provenance" in text:
                continue
            arg = call.args[0]
            if isinstance(arg, ast.Name) and func is not None and any(
                    "provenance()" in ast.get_source_segment(src, v) for v in _assigned_in(func, arg.id)):
                continue
            missing.append(where)
    assert len(writers) >= 15, writers   # (the search found the writers at all)
    assert not missing, "bench JSON written without provenance: %s" % missing


def test_report_does_not_draw_provenance():
    import report
    data = {"provenance": provenance(), "speed_vs_dense": 2.0, "runs": [{"step": 1, "loss": 2.0}]}
    assert [p for p, _ in report.scalars(data)] == ["speed_vs_dense"]
