"""mkdocs hook: the Results pages are generated from ``bench/results/*.json`` when the site is built.

A page under ``docs/results/`` asks for results with a marker line::

    <!-- bench-results: parity_*.json parity_cpu_*.json -->

and the hook puts in its place, for each JSON file whose name matches one of the patterns (in name
order): the file's name and command, its key figures as tables (the shapes the benches write are
known: parity variants, time-to-loss modes, per-route overhead rows, GPU selection and steps, chaos
soak trials; any other JSON gets a generic summary of its top-level keys), its provenance (commit,
Python, torch, mpi4py, MPI library, machine, cores, GPU: "not recorded" where the file has none),
and the PNG of the same name when there is one. ``<!-- bench-results: rest -->`` stands for every
JSON no other page's marker claims, so a new result always shows up somewhere.

The PNGs in ``bench/results/`` are added to the site as ``results/img/NAME.png``. No plugin
package is needed: mkdocs loads this file through the ``hooks:`` key of ``mkdocs.yml``.
"""
import fnmatch
import glob
import json
import os
import re
import statistics

from mkdocs.structure.files import File

MARKER = re.compile(r"^<!--\s*bench-results:\s*(.*?)\s*-->\s*$", re.M)
IMG_DIR = "results/img"
PROVENANCE_FIELDS = [("commit", "commit"), ("dirty", "uncommitted changes"), ("python", "Python"),
                     ("torch", "torch"), ("mpi4py", "mpi4py"), ("mpi", "MPI library"),
                     ("machine", "machine"), ("cores", "cores"), ("gpu", "GPU"), ("platform", "platform"),
                     ("run", "run")]
MAX_ROWS = 40   # a list of records longer than this is summarised, not tabled

_claims = {}    # page src_uri -> the patterns of its markers


def _results_dir(config):
    return os.path.join(os.path.dirname(os.path.abspath(config.config_file_path)), "bench", "results")


def _json_names(config):
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(_results_dir(config), "*.json")))


def _png_names(config):
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(_results_dir(config), "*.png")))


def on_files(files, config):
    """Add bench/results' PNGs to the site, and note which results each page's markers ask for."""
    for name in _png_names(config):
        uri = "%s/%s" % (IMG_DIR, name)
        if files.get_file_from_path(uri) is None:
            files.append(File.generated(config, uri, abs_src_path=os.path.join(_results_dir(config), name)))
    _claims.clear()
    for f in files.documentation_pages():
        if f.abs_src_path and os.path.exists(f.abs_src_path):
            with open(f.abs_src_path, encoding="utf-8") as fh:
                patterns = [p for m in MARKER.finditer(fh.read()) for p in m.group(1).split()]
            if patterns:
                _claims[f.src_uri] = patterns
    return files


def on_serve(server, config, builder):
    """mkdocs serve rebuilds when a result changes."""
    if os.path.isdir(_results_dir(config)):
        server.watch(_results_dir(config))
    return server


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri not in _claims:
        return markdown
    names = _json_names(config)
    pngs = set(_png_names(config))
    depth = page.file.src_uri.count("/")
    img_prefix = "../" * depth + IMG_DIR + "/"

    def replace(match):
        patterns = match.group(1).split()
        if patterns == ["rest"]:
            claimed = [p for pats in _claims.values() for p in pats if p != "rest"]
            chosen = [n for n in names if not any(fnmatch.fnmatch(n, p) for p in claimed)]
        else:
            chosen = [n for n in names if any(fnmatch.fnmatch(n, p) for p in patterns)]
        if not chosen:
            return "*No file in `bench/results/` matches %s in this checkout.*\n" % ", ".join(
                "`%s`" % p for p in patterns)
        return "\n".join(render_file(os.path.join(_results_dir(config), n), pngs, img_prefix) for n in chosen)

    return MARKER.sub(replace, markdown)


# --- rendering ---------------------------------------------------------------------------------

def _fmt(value):
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value != value:
            return "NaN"
        if value == 0:
            return "0"
        if abs(value) >= 1e5 or abs(value) < 1e-3:
            return "%.3g" % value
        return "%.4g" % value
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):   # text from a JSON never turns into markup (a link, a tag, emphasis)
        return _MD_SPECIAL.sub(lambda m: _MD_ESCAPES.get(m.group(0), "\\" + m.group(0)),
                               value.replace("\n", " "))
    if isinstance(value, list):
        if not value:
            return "none"
        if all(_scalar(v) for v in value) and len(value) <= 6:
            return ", ".join(_fmt(v) for v in value)
        return "%d items" % len(value)
    if isinstance(value, dict):
        return "%d keys" % len(value)
    return _fmt(str(value))


_MD_SPECIAL = re.compile(r"[\\`*_\[\]<>|&]")
_MD_ESCAPES = {"<": "&lt;", ">": "&gt;", "&": "&amp;"}


def _code(text):
    """``text`` as a code span (a backtick inside it becomes a quote)."""
    return _Raw("`%s`" % str(text).replace("`", "'"))


def _scalar(value):
    return value is None or isinstance(value, (bool, int, float, str))


def _table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_fmt(c) if not isinstance(c, _Raw) else str(c) for c in row) + " |" for row in rows]
    return "\n".join(out) + "\n"


class _Raw(str):
    """A cell already formatted."""


def _kv_table(mapping, key_title="key", value_title="value"):
    return _table([key_title, value_title], [(_code(k), v) for k, v in mapping.items()])


def _flatten(record, prefix="", depth=0):
    """A record's scalar fields, nested dicts (one or two levels) flattened as ``a.b``."""
    out = {}
    for k, v in record.items():
        key = prefix + str(k)
        if isinstance(v, dict) and depth < 2:
            out.update(_flatten(v, key + ".", depth + 1))
        elif _scalar(v) or isinstance(v, list):
            out[key] = v
    return out


def _records_table(records, first=None, skip=(), label=None):
    """A table of a list (or dict, keyed by ``label``) of records: one row each, one column per
    field any record has (long strings and nested lists left out)."""
    if isinstance(records, dict):
        rows = [dict({label or "name": k}, **_flatten(v)) for k, v in records.items() if isinstance(v, dict)]
    else:
        rows = [_flatten(r) for r in records if isinstance(r, dict)]
    cols = []
    for r in rows:
        for k, v in r.items():
            if k in skip or k in cols:
                continue
            if isinstance(v, str) and len(v) > 80:
                continue
            if isinstance(v, list) and not all(_scalar(x) for x in v):
                continue
            cols.append(k)
    if first:
        cols = [c for c in first if c in cols] + [c for c in cols if c not in first]
    if len(cols) > 12 and len(rows) <= 6:   # few records of many fields: one column per record
        key = cols[0]
        return _table([_code(key)] + [_fmt(r.get(key)) for r in rows],
                      [[_code(c)] + [r.get(c) for r in rows] for c in cols[1:]])
    return _table([_code(c) for c in cols], [[r.get(c) for c in cols] for r in rows])


def _summary_of_records(records):
    """A long list of records: its length, and per field the counts of each value (booleans and
    strings with few values) or the range (numbers)."""
    rows = [_flatten(r) for r in records if isinstance(r, dict)]
    fields = []
    for r in rows:
        fields += [k for k in r if k not in fields]
    lines = []
    for k in fields:
        values = [r.get(k) for r in rows if k in r]
        nums = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if all(isinstance(v, bool) or v is None for v in values):
            lines.append((k, "yes %d, no %d%s" % (sum(v is True for v in values), sum(v is False for v in values),
                                                  ", unset %d" % values.count(None) if None in values else "")))
        elif nums and len(nums) == len([v for v in values if v is not None]):
            lines.append((k, "min %s, median %s, max %s" % (_fmt(min(nums)), _fmt(statistics.median(nums)),
                                                             _fmt(max(nums)))))
        elif all(isinstance(v, str) or v is None for v in values) and any(len(v) > 60 for v in values if v):
            lines.append((k, "text, %d of %d non-empty" % (sum(bool(v) for v in values), len(values))))
        elif all(isinstance(v, str) or v is None for v in values) and len(set(values)) <= 12:
            counts = {}
            for v in values:
                counts[v] = counts.get(v, 0) + 1
            lines.append((k, ", ".join("%s %d" % (_fmt(v), n) for v, n in sorted(counts.items(), key=lambda x: -x[1]))))
    return "%d records.\n\n" % len(rows) + _table(["field", "values"], [(_code(k), _Raw(v)) for k, v in lines])


def _generic(data, skip=("command", "provenance")):
    """Any JSON: its top-level scalars in one table, then each list or dict in its own."""
    if not isinstance(data, dict):
        return "A JSON %s of %d items.\n" % (type(data).__name__, len(data)) if isinstance(data, list) else \
            "A JSON value: %s\n" % _fmt(data)
    parts = []
    scalars = {k: v for k, v in data.items() if k not in skip and (_scalar(v) or (
        isinstance(v, list) and all(_scalar(x) for x in v) and len(v) <= 6))}
    if scalars:
        parts.append(_kv_table(scalars))
    for k, v in data.items():
        if k in skip or k in scalars:
            continue
        parts.append("**%s**\n" % _code(k))
        if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            parts.append(_records_table(v) if len(v) <= MAX_ROWS else _summary_of_records(v))
        elif isinstance(v, dict) and v and all(isinstance(x, dict) for x in v.values()):
            parts.append(_records_table(v) if len(v) <= MAX_ROWS else "%d entries.\n" % len(v))
        elif isinstance(v, dict):
            flat = {a: b for a, b in _flatten(v).items() if not isinstance(b, str) or len(b) <= 200}
            parts.append(_kv_table(flat) if flat else "%d keys: %s\n" % (len(v), ", ".join(map(str, v))))
        elif isinstance(v, list):
            parts.append("%d items.\n" % len(v))
    return "\n".join(parts)


def _parity(data):
    settings = data.get("settings") or {}
    parts = []
    if settings:
        parts.append("Settings: " + ", ".join("%s %s" % (k, _fmt(v)) for k, v in settings.items()
                                              if k not in ("out", "variants")) + ".\n")
    rows = []
    for r in data["results"]:
        ratio = r.get("loss_vs_dense")
        rows.append((_code(r.get("variant")), r.get("validation_loss"),
                     _Raw("%+.1f %%" % ((ratio - 1) * 100)) if isinstance(ratio, (int, float)) else None,
                     _Raw("%.1f" % (r["wan_bytes_per_step"] / 1000)) if isinstance(
                         r.get("wan_bytes_per_step"), (int, float)) else None))
    parts.append(_table(["variant", "held-out loss", "vs dense", "WAN KB sent per step, rank 0"], rows))
    return "\n".join(parts)


def _time_to_loss(data):
    table = data["table"]
    parts = []
    head = {k: v for k, v in table.items() if _scalar(v)}
    head = dict({"rate": data.get("rate")}, **head) if "rate" in data else head
    if head:
        parts.append(_kv_table(head))
    rows = []
    for mode, m in table.get("modes", {}).items():
        if not isinstance(m, dict):
            continue
        if m.get("error"):
            rows.append((_code(mode), _Raw("failed"), None, None, None, None, None, None))
            continue
        rows.append((_code(mode), m.get("final_loss"), m.get("steps"), m.get("ms_per_step"),
                     m.get("wan_mb_per_step"), m.get("time_to_target_s"), m.get("to_peer_loss_s"),
                     m.get("peer_time_over_this")))
    parts.append(_table(["mode", "final held-out loss", "steps", "ms/step", "WAN MB/step", "time to target (s)",
                         "time to the best peer's final loss (s)", "best peer's time / this"], rows))
    for key in ("best_peer", "automatic"):
        if isinstance(table.get(key), dict):
            parts.append("**%s**\n" % _code(key))
            parts.append(_kv_table(table[key]))
    auto = (data.get("runs") or {}).get("auto")
    if isinstance(auto, dict) and auto.get("route_changes"):
        parts.append("**The automatic route's changes** (step, route, reason)\n")
        parts.append(_table(["step", "route", "reason"], [tuple(c) + (None,) * (3 - len(c))
                                                          for c in auto["route_changes"] if isinstance(c, list)]))
    return "\n".join(parts)


def _overhead(data):
    parts = [_kv_table({k: v for k, v in data.items() if k not in ("command", "provenance", "rows") and _scalar(v)})]
    parts.append(_records_table(data["rows"], first=["size", "route", "parameters", "step_s", "wire_s", "vs_wire",
                                                     "wan_bytes_per_step"]))
    return "\n".join(parts)


def _gpu(data):
    parts = [_kv_table({k: v for k, v in data.items() if k not in ("command", "provenance") and _scalar(v)})]
    for key, label in (("selection", "n"), ("steps", "model"), ("cpu_engine", "model")):
        if data.get(key):
            parts.append("**%s**\n" % _code(key))
            parts.append(_records_table(data[key], label=label))
    return "\n".join(parts)


def _chaos(data):
    trials = [t for t in data["trials"] if isinstance(t, dict)]
    parts = [_kv_table({k: v for k, v in data.items() if k not in ("command", "provenance", "trials") and _scalar(v)})]
    ok = sum(bool(t.get("ok")) for t in trials)
    parts.append("%d trials, %d passed.\n" % (len(trials), ok))
    failed = [t for t in trials if not t.get("ok")]
    if failed:
        parts.append("**The trials that failed**\n")
        parts.append(_table(["trial", "route", "fault", "launcher", "why", "replay"],
                            [(t.get("trial"), t.get("route"), t.get("fault"), t.get("launcher"),
                              "; ".join(map(str, t.get("why") or [])), _code(t.get("replay")))
                             for t in failed]))
    parts.append("**Every trial, by field**\n")
    parts.append(_summary_of_records(trials))
    return "\n".join(parts)


# the top-level keys each known shape renders (its scalars too where it says "scalars"); any other
# key of such a file gets the generic summary after it
_parity.handles = {"settings", "results"}
_time_to_loss.handles = {"settings", "rate", "table", "runs"}
_overhead.handles = {"rows", "scalars"}
_gpu.handles = {"selection", "steps", "cpu_engine", "scalars"}
_chaos.handles = {"trials", "scalars"}


def _leftover(data, render):
    handles = getattr(render, "handles", None)
    if handles is None or not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if k not in ("command", "provenance") and k not in handles
            and not ("scalars" in handles and _scalar(v))}


def _shape(data):
    if not isinstance(data, dict):
        return _generic
    if isinstance(data.get("results"), list) and all(isinstance(r, dict) and "variant" in r for r in data["results"]):
        return _parity
    if isinstance(data.get("table"), dict) and isinstance(data["table"].get("modes"), dict):
        return _time_to_loss
    if isinstance(data.get("rows"), list) and all(isinstance(r, dict) and "route" in r for r in data["rows"]):
        return _overhead
    if isinstance(data.get("selection"), list) and isinstance(data.get("steps"), dict):
        return _gpu
    if isinstance(data.get("trials"), list):
        return _chaos
    return _generic


def _provenance(data):
    prov = data.get("provenance") if isinstance(data, dict) else None
    if not isinstance(prov, dict):
        return "Provenance: not recorded.\n"
    rows = []
    for key, label in PROVENANCE_FIELDS:
        if key in ("run", "platform") and key not in prov:
            continue
        value = prov.get(key)
        if key not in prov or (value is None and key != "gpu"):
            rows.append((label, _Raw("not recorded")))
        else:
            rows.append((label, _Raw("none") if value is None else value))   # gpu None: it had none
    extra = [k for k in prov if k not in dict(PROVENANCE_FIELDS) and k != "argv"]
    rows += [(k, prov[k]) for k in extra]
    return "Provenance:\n\n" + _table(["", "recorded"], rows)


def render_file(path, pngs=(), img_prefix="img/"):
    name = os.path.basename(path)
    out = ["## %s\n" % _code(name)]
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as e:
        return "\n".join(out + ["*Could not be read: %s*\n" % _fmt(str(e))])
    if isinstance(data, dict) and data.get("command"):
        out.append("Command: %s\n" % _code(data["command"]))
    render = _shape(data)
    try:
        out.append(render(data))
        rest = _leftover(data, render)
        if rest:
            out.append(_generic(rest))
    except Exception as e:   # a known shape with a surprise in it still gets the generic summary
        out.append("*(%s: %s; generic summary instead)*\n" % (type(e).__name__, _fmt(str(e))))
        out.append(_generic(data))
    png = os.path.splitext(name)[0] + ".png"
    if png in pngs:
        out.append("![%s](%s%s)\n" % (png, img_prefix, png))
    out.append(_provenance(data))
    return "\n".join(out)
