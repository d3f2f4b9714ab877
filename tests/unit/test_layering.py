"""The house rules, checked on the source: sub-packages import only lower layers (lazy imports
in functions included), no module imports itself through a cycle, stella_mpi and the stellarun
launcher never load each other, and every STELLA_* variable the launcher sets is one the
runtime's config reads (or one it only tells the job's own scripts)."""
import ast
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# stella_mpi's rooms, lowest first: a module may import its own room and the rooms before it.
LAYERS = ["base", "_native", "compression", "comm", "core", "api", "adjust", "optim"]
TOP = len(LAYERS)   # the package itself (stella_mpi/__init__.py) re-exports from every room


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


def _imports(name, path, source=None):
    """Modules of ours that importing ``name`` makes Python import (every Import/ImportFrom node,
    at any depth; the packages on the way to a target, except ``name``'s own ancestors)."""
    tree = ast.parse(open(path).read() if source is None else source, path)
    here = name if _is_package(name) else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            for a in node.names:
                sub = "%s.%s" % (mod, a.name)
                targets.add(sub if sub in MODULES else mod)
    ancestors = {".".join(name.split(".")[:i]) for i in range(1, len(name.split(".")))}
    out = set()
    for t in targets:
        parts = t.split(".")
        for i in range(1, len(parts) + 1):
            m = ".".join(parts[:i])
            if m in MODULES and m not in ancestors and m != name:
                out.add(m)
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(name):
    parts = name.split(".")
    if parts[0] != "stella_mpi":
        return None
    if len(parts) == 1:
        return TOP
    return LAYERS.index(parts[1])


def test_every_room_has_a_layer():
    rooms = {n.split(".")[1] for n in MODULES if n.startswith("stella_mpi.")}
    assert rooms == set(LAYERS), "rooms without a layer (add them to LAYERS): %s" % sorted(rooms - set(LAYERS))


def test_imports_go_down_the_layers():
    wrong = sorted("%s imports %s" % (a, b) for a, targets in GRAPH.items() for b in targets
                   if _layer(a) is not None and _layer(b) is not None and _layer(b) > _layer(a))
    assert not wrong, "a lower layer imports a higher one (layers: %s):\n%s" % (" < ".join(LAYERS), "\n".join(wrong))


def test_launcher_and_runtime_never_import_each_other():
    crossing = sorted("%s imports %s" % (a, b) for a, targets in GRAPH.items() for b in targets
                      if a.split(".")[0] != b.split(".")[0])
    assert not crossing, "\n".join(crossing)


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


def test_no_import_cycle():
    assert not _cycles(GRAPH), "import cycles: %s" % _cycles(GRAPH)


def test_the_checks_catch_what_they_look_for():
    """The checker itself: a cycle and an upward import planted in a copy of the graph are found."""
    g = {k: set(v) for k, v in GRAPH.items()}
    g["stella_mpi.base.errors"].add("stella_mpi.core.state")
    assert any("stella_mpi.base.errors" in c for c in _cycles(g))
    assert _layer("stella_mpi.core.state") > _layer("stella_mpi.base.errors")
    assert "stella_mpi.optim.buckets" in GRAPH["stella_mpi.optim.cpu_engine"]
    # a function-level (lazy) import counts, relative or absolute, with the packages on its way
    lazy = "def f():\n    from ..core import state\n    import stella_mpi.optim.buckets\n"
    found = _imports("stella_mpi.comm.hierarchy", MODULES["stella_mpi.comm.hierarchy"], lazy)
    assert {"stella_mpi.core", "stella_mpi.core.state", "stella_mpi.optim", "stella_mpi.optim.buckets"} <= found


@pytest.mark.parametrize("code", [
    "import stella_mpi, sys; bad = sorted(m for m in sys.modules if m.split('.')[0] == 'stellarun'); "
    "assert not bad, bad",
    "import stellarun.cli, stellarun.wan, stellarun.tunlink, sys; "
    "bad = sorted(m for m in ('stella_mpi', 'torch', 'mpi4py', 'numpy') if m in sys.modules); assert not bad, bad",
], ids=["stella_mpi-loads-no-launcher", "launcher-loads-no-runtime"])
def test_import_isolation(code):
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr


class _Namespaces:
    """What build_wan_command asks of a WanEmulation (addresses, a command prefix)."""

    def address(self, c):
        return "10.213.0.%d" % (c + 1)

    def exec_prefix(self, c):
        return ["ip", "netns", "exec", "ns%d" % c]


def test_every_variable_the_launcher_sets_is_read_by_the_config():
    from stellarun import cli
    written = set()
    for argv, emu in ((["-np", "4", "--clusters", "2", "--wan", "100mbit", "--wan-delay", "30ms", "--timeout", "9",
                        "python", "x.py"], None),
                      (["-np", "4", "--clusters", "2", "--wan", "100mbit", "python", "x.py"], _Namespaces())):
        cmd = cli.build_wan_command(cli.parse(argv), emu)
        written |= {cmd[i + 1] for i, a in enumerate(cmd) if a in ("-genv", "-env")}
    cmd = cli.build_command(cli.parse(["-np", "4", "--clusters", "2", "--cluster-of", "a=x", "--timeout", "5",
                                       "python", "x.py"]))
    written |= {cmd[i + 1] for i, a in enumerate(cmd) if a == "-genv"}
    config = open(os.path.join(ROOT, "stella_mpi", "base", "config.py")).read()
    read = set(re.findall(r'"((?:STELLA|HOROVOD|GLOO)_[A-Z_]+)"', config))
    ours = {v for v in written if v.startswith(("STELLA_", "GLOO_"))}
    assert {"STELLA_CLUSTER", "STELLA_CLUSTERS", "STELLA_WAN_PACE_BPS"} <= ours
    unknown = sorted(ours - read - set(cli.JOB_INFO_ENV))
    assert not unknown, "stellarun sets %s, which stella_mpi.base.config does not read" % unknown
