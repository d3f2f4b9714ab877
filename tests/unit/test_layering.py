"""The house rules, checked on the source: sub-packages import only lower layers (lazy imports
in functions included), no module imports itself through a cycle, stella_mpi and the stellarun
launcher never load each other (nor does the launcher load torch, MPI or numpy), and every
STELLA_* variable the launcher names is one the runtime's config reads (or one it only tells
the job's own scripts), and no program of ours calls an mpi4py reduction that holds the GIL
while it waits."""
import ast
import os
import re
import subprocess
import sys
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# stella_mpi's rooms, lowest first: a module may import its own room and the rooms before it.
LAYERS = ["base", "_native", "compression", "comm", "core", "api", "adjust", "optim", "elastic", "ddp", "plan"]
TOP = len(LAYERS)   # the package itself (stella_mpi/__init__.py) re-exports from every room
LAUNCHER_NEVER_LOADS = ("stella_mpi", "torch", "mpi4py", "numpy")


def _modules(package):
    """{dotted module name: path} of every .py file of ``package``."""
    out = {}
    base = os.path.join(ROOT, package)
    for dirpath, _, files in os.walk(base):
        for f in files:
            if not f.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            out[".".join(rel)] = os.path.join(dirpath, f)
    return out


MODULES = {**_modules("stella_mpi"), **_modules("stellarun")}


def _is_package(name):
    return MODULES.get(name, "").endswith("__init__.py")


def _named_imports(name, tree):
    """Every module name an Import/ImportFrom node (at any depth) or an import_module/__import__
    call names, relative names resolved; a dynamic import of a computed name is an error."""
    here = name if _is_package(name) else name.rpartition(".")[0]
    named = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            named.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            for a in node.names:
                sub = "%s.%s" % (mod, a.name)
                named.add(sub if sub in MODULES else mod)
        elif isinstance(node, ast.Call):
            f = node.func
            fname = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if fname in ("import_module", "__import__"):
                arg = node.args[0] if node.args else None
                if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
                    raise AssertionError("%s: %s() of a computed name: the layering check cannot follow it"
                                         % (name, fname))
                named.add(arg.value)
    return named


def _imports(name, path, source=None):
    """Modules of ours that importing ``name`` makes Python import: every module it names, and
    the packages on the way to each (except its own ancestors, already imported; a package it
    names explicitly counts, ancestor or not)."""
    tree = ast.parse(open(path).read() if source is None else source, path)
    ancestors = {".".join(name.split(".")[:i]) for i in range(1, len(name.split(".")))}
    out = set()
    for t in _named_imports(name, tree):
        parts = t.split(".")
        for i in range(1, len(parts) + 1):
            m = ".".join(parts[:i])
            if m in MODULES and m != name and (m == t or m not in ancestors):
                out.add(m)
    return out


def _third_party(path, source=None):
    """Top-level names of everything a module imports (at any depth)."""
    tree = ast.parse(open(path).read() if source is None else source, path)
    return {n.split(".")[0] for n in _named_imports("stellarun.x", tree)}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(name):
    parts = name.split(".")
    if parts[0] != "stella_mpi":
        return None
    return TOP if len(parts) == 1 else LAYERS.index(parts[1])


def _upward(graph):
    return sorted("%s imports %s" % (a, b) for a, targets in graph.items() for b in targets
                  if _layer(a) is not None and _layer(b) is not None and _layer(b) > _layer(a))


def _crossing(graph):
    return sorted("%s imports %s" % (a, b) for a, targets in graph.items() for b in targets
                  if a.split(".")[0] != b.split(".")[0])


def _cycles(graph):
    """Strongly connected components of more than one module (Tarjan), and self-imports."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_room_has_a_layer_and_the_docs_list_them_in_order():
    rooms = {n.split(".")[1] for n in MODULES if n.startswith("stella_mpi.")}
    assert rooms == set(LAYERS), "rooms without a layer (add them to LAYERS): %s" % sorted(rooms - set(LAYERS))
    page = open(os.path.join(ROOT, "docs", "design", "architecture.md")).read()
    table = re.findall(r"^\| `stella_mpi/(\w+)/` \|", page, re.M)
    assert table == LAYERS, "docs/design/architecture.md's table lists %s; the layers are %s" % (table, LAYERS)
    doc = ast.get_docstring(ast.parse(open(MODULES["stella_mpi"]).read()))
    listed = [r for r in re.findall(r"``(\w+)``", doc) if r in LAYERS]
    assert listed == LAYERS, "stella_mpi/__init__.py's docstring lists %s; the layers are %s" % (listed, LAYERS)


def test_imports_go_down_the_layers():
    assert not _upward(GRAPH), "a lower layer imports a higher one (layers: %s):\n%s" % (
        " < ".join(LAYERS), "\n".join(_upward(GRAPH)))


def test_launcher_and_runtime_never_import_each_other():
    assert not _crossing(GRAPH), "\n".join(_crossing(GRAPH))
    heavy = sorted("%s imports %s" % (name, m) for name, path in MODULES.items() if name.startswith("stellarun")
                   for m in _third_party(path) if m in LAUNCHER_NEVER_LOADS)
    assert not heavy, "the launcher must start without the runtime's weight:\n%s" % "\n".join(heavy)


def test_no_import_cycle():
    assert not _cycles(GRAPH), "import cycles: %s" % _cycles(GRAPH)


def test_the_checks_catch_what_they_look_for():
    """The checker itself, on sources planted in a copy of the graph."""
    def planted(name, source):
        g = {k: set(v) for k, v in GRAPH.items()}
        g[name] |= _imports(name, MODULES[name], source)
        return g
    # a lazy upward import, relative or absolute, with the packages on its way
    lazy = "def f():\n    from ..core import state\n    import stella_mpi.optim.buckets as b\n"
    found = _imports("stella_mpi.comm.hierarchy", MODULES["stella_mpi.comm.hierarchy"], lazy)
    assert {"stella_mpi.core", "stella_mpi.core.state", "stella_mpi.optim", "stella_mpi.optim.buckets"} <= found
    assert _upward(planted("stella_mpi.comm.hierarchy", lazy))
    # names taken from the top package, from below: upward
    assert _upward(planted("stella_mpi.base.config", "from stella_mpi import allreduce\n"))
    assert _upward(planted("stella_mpi.base.config", "from .. import allreduce\n"))
    # a package __init__ importing its own submodule that imports the package back: a cycle
    g = planted("stella_mpi._native", "from .compress import topk\n")
    assert any("stella_mpi._native" in c and "stella_mpi._native.compress" in c for c in _cycles(g))
    # dynamic imports by name count; computed names are refused
    assert _upward(planted("stella_mpi.base.config", "import importlib\nimportlib.import_module('stella_mpi.core')\n"))
    with pytest.raises(AssertionError, match="computed name"):
        _imports("stella_mpi.base.config", MODULES["stella_mpi.base.config"], "import importlib\n"
                 "importlib.import_module(name)\n")
    # the two packages crossing, and the launcher importing torch lazily
    assert _crossing(planted("stella_mpi.core.state", "def f():\n    import stellarun.cli\n"))
    assert _crossing(planted("stellarun.wan", "from stella_mpi.comm import buffers\n"))
    assert "torch" in _third_party(MODULES["stellarun.wan"], "def f():\n    import torch.distributed\n")


@pytest.mark.parametrize("code", [
    "import stella_mpi, sys; bad = sorted(m for m in sys.modules if m.split('.')[0] == 'stellarun'); "
    "assert not bad, bad",
    "import stellarun.cli, stellarun.wan, stellarun.tunlink, sys; "
    "bad = sorted(m for m in %r if m in sys.modules); assert not bad, bad" % (LAUNCHER_NEVER_LOADS,),
], ids=["stella_mpi-loads-no-launcher", "launcher-loads-no-runtime"])
def test_import_isolation(code):
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr


class _Recorder(dict):
    """An environment that notes every variable asked for."""

    def __init__(self):
        super().__init__()
        self.asked = set()

    def get(self, key, default=None):
        self.asked.add(key)
        return default


def test_every_variable_the_launcher_names_is_read_by_the_config(monkeypatch):
    import importlib.util
    from stellarun import cli
    # config.py on its own (importing the package would start MPI in the test runner)
    spec = importlib.util.spec_from_file_location("stella_config_alone", MODULES["stella_mpi.base.config"])
    config = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(config)
    env = _Recorder()
    monkeypatch.setattr(config, "os", types.SimpleNamespace(environ=env))
    config.Config.from_env()
    for name in dir(config):
        if name.endswith("_setting"):
            getattr(config, name)()
    named = set()
    for name, path in MODULES.items():
        if name.startswith("stellarun"):
            named |= set(re.findall(r"\b(STELLA_[A-Z0-9_]+)\b", open(path).read()))
    assert {"STELLA_CLUSTER", "STELLA_CLUSTERS", "STELLA_WAN_PACE_BPS", "STELLA_TIMEOUT"} <= named
    assert "GLOO_SOCKET_IFNAME" in env.asked
    unknown = sorted(named - env.asked - set(cli.JOB_INFO_ENV))
    assert not unknown, "stellarun names %s, which stella_mpi.base.config never reads" % unknown


def test_nothing_from_a_peer_is_unpickled_outside_the_object_helpers():
    """pickle (and its relatives) only in api/functions.py: broadcast_object and allgather_object,
    which are documented as for trusted jobs."""
    users = sorted(name for name, path in MODULES.items()
                   if {"pickle", "cloudpickle", "dill", "marshal", "shelve"} & _third_party(path))
    assert users == ["stella_mpi.api.functions"], users


def _top_level_imports(name):
    """Modules ``name`` imports when it is imported (statements at module level only)."""
    path = MODULES[name]
    tree = ast.parse(open(path).read(), path)
    body = ast.Module(body=[n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))], type_ignores=[])
    return _named_imports(name, body)


def test_mpi_is_started_only_under_its_watchdog():
    """stella_mpi/__init__.py runs import_mpi() (MPI_Init under a deadline) first: nothing that
    import_mpi's module loads may import mpi4py before it does."""
    seen, todo = set(), ["stella_mpi.comm.process_watchdog"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for target in _top_level_imports(name):
            assert target.split(".")[0] != "mpi4py", "%s imports mpi4py before MPI_Init is guarded" % name
            parts = target.split(".")
            todo += [".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in MODULES
                     and ".".join(parts[:i]) != "stella_mpi"]


# mpi4py's pickle-based reductions hold the GIL while they wait for the other ranks, which stops
# stella_mpi's collective thread on that rank (docs/guides/failures.md); the buffer forms do not
GIL_HOLDING = re.compile(r"\b(?:MPI\.COMM_WORLD|comm|world)\.(?:allreduce|gather|reduce)\(")
# (the one place that calls it on purpose: the fault test of exactly that)
GIL_HOLDING_ON_PURPOSE = {os.path.join("tests", "scripts", "faulty_rank.py")}


def test_no_pickle_based_mpi4py_reductions_in_our_programs():
    found = []
    for top in ("stella_mpi", "stellarun", "bench", "examples", "tests"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, ROOT)
                if not f.endswith(".py") or rel in GIL_HOLDING_ON_PURPOSE or rel == os.path.relpath(__file__, ROOT):
                    continue
                with open(path, encoding="utf-8") as fh:
                    for n, line in enumerate(fh, 1):
                        if GIL_HOLDING.search(line) and not line.lstrip().startswith("#"):
                            found.append("%s:%d: %s" % (rel, n, line.strip()))
    assert not found, ("mpi4py's comm.allreduce/gather/reduce hold the GIL while they wait (use comm.Allreduce, "
                       "comm.Gather on buffers, or hvd's collectives):\n" + "\n".join(found))
