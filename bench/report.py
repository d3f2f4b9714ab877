"""Draw bench results as PNG plots, so that every result can be looked at, not only read:

    python bench/report.py bench/results/*.json [--out-dir DIR]

Each JSON file becomes ``<name>.png`` (beside it, or in --out-dir) with one panel per thing the
file holds, whatever bench wrote it:

* every list of records (dicts with numbers: a loss curve, per-trial or per-size rows) becomes a
  line plot of each numeric field against the first of seconds / step / n / size / ... that all
  records have (else the record's index), one line per value of the records' first text field
  (mode, route, workload ...);
* the numbers outside such lists become a bar chart labelled by their path in the file, ratios
  (``*_vs_*``, ``ratio``) in a panel of their own with a line at 1 (the baseline), on a log scale
  when they span more than a factor of 100.

The top-level "provenance" (the commit, versions and machine: bench/provenance.py) is not drawn.

Needs matplotlib (``pip install stella_mpi[plot]``; not a dependency of stella_mpi itself).
"""
import argparse
import json
import math
import os
import sys

X_KEYS = ("seconds", "time_s", "t", "step", "steps", "n", "size", "elements", "bytes", "nbytes", "density",
          "rate_bps", "clusters", "ranks", "trial")
MAX_BARS = 40
MAX_FIELDS = 6


def _number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def find_records(node, path=""):
    """[(path, records)] for every list of dicts holding numbers, at any depth."""
    out = []
    if isinstance(node, dict):
        for k, v in node.items():
            out += find_records(v, "%s.%s" % (path, k) if path else str(k))
    elif isinstance(node, list) and node and all(isinstance(r, dict) for r in node):
        if any(_number(v) for r in node for v in r.values()):
            out.append((path, node))
        for i, r in enumerate(node):
            for k, v in r.items():
                if isinstance(v, (list, dict)):
                    out += find_records(v, "%s[%d].%s" % (path, i, k))
    return out


def scalars(node, path=""):
    """[(dotted path, number)] outside lists of records."""
    out = []
    if isinstance(node, dict):
        for k, v in node.items():
            if k != "provenance" or path:   # (what produced the result, not a result: bench/provenance.py)
                out += scalars(v, "%s.%s" % (path, k) if path else str(k))
    elif _number(node):
        out.append((path, float(node)))
    return out


def _is_ratio(path):
    leaf = path.rsplit(".", 1)[-1]
    return "_vs_" in leaf or "ratio" in leaf


def _unit(field):
    """Fields drawn on one axis share a unit: seconds, milliseconds, ratios, or the field alone."""
    if field.endswith("_per_s"):
        return field
    if field.endswith("_s") or field in ("seconds", "time_s"):
        return "seconds"
    if field.endswith("_ms"):
        return "milliseconds"
    if _is_ratio(field):
        return "ratio"
    return field


def panels_of(data):
    """What to draw: [("records", title, (records, fields)) | ("bars", title, [(label, value)])]:
    a list of records gives one panel per unit of its numeric fields."""
    panels = []
    for path, recs in find_records(data):
        keys = [k for k in recs[0] if all(k in r for r in recs)]
        x_key = _x_key(recs, keys)
        fields = [k for k in keys if k != x_key and any(_number(r.get(k)) for r in recs)]
        units = {}
        for f in fields:
            units.setdefault(_unit(f), []).append(f)
        for unit, group in list(units.items())[:MAX_FIELDS]:
            panels.append(("records", "%s: %s" % (path or "records", unit), (recs, group)))
    values = scalars(data)
    ratios = [(p, v) for p, v in values if _is_ratio(p)]
    others = [(p, v) for p, v in values if not _is_ratio(p)]
    if ratios:
        panels.append(("bars", "ratios (1 = the baseline)", ratios[:MAX_BARS]))
    if others:
        panels.append(("bars", "values", others[:MAX_BARS]))
    return panels


def _x_key(recs, keys):
    return next((k for k in X_KEYS if k in keys and all(_number(r[k]) for r in recs)), None)


def _draw_records(ax, title, content):
    recs, fields = content
    keys = [k for k in recs[0] if all(k in r for r in recs)]
    x_key = _x_key(recs, keys)
    group_key = next((k for k in keys if all(isinstance(r[k], str) for r in recs)), None)
    groups = {}
    for i, r in enumerate(recs):
        groups.setdefault(r[group_key] if group_key else "", []).append((r[x_key] if x_key else i, r))
    for field in fields:
        for g, rows in groups.items():
            pts = [(x, r[field]) for x, r in rows if _number(r.get(field))]
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", markersize=3,
                        label=("%s %s" % (g, field)).strip())
    ax.set_xlabel(x_key or "record")
    xs = [r[x_key] for r in recs] if x_key else []
    if xs and min(xs) > 0 and max(xs) / min(xs) > 100:
        ax.set_xscale("log")
    ys = [r[f] for r in recs for f in fields if _number(r.get(f))]
    if ys and min(ys) > 0 and max(ys) / min(ys) > 100:
        ax.set_yscale("log")
    if title.endswith(": ratio"):
        ax.axhline(1.0, color="k", lw=0.8)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)


def _draw_bars(ax, title, items):
    labels = [p for p, _ in items]
    vals = [v for _, v in items]
    ax.barh(range(len(vals)), vals, color="tab:blue")
    ax.set_yticks(range(len(vals)))
    ax.set_yticklabels(labels, fontsize=6)
    ax.invert_yaxis()
    positive = [v for v in vals if v > 0]
    if positive and min(vals) > 0 and max(positive) / min(positive) > 100:
        ax.set_xscale("log")
    if "ratio" in title:
        ax.axvline(1.0, color="k", lw=0.8)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, axis="x")


def draw(path, out_path):
    """One PNG for the JSON file ``path``; returns the number of panels drawn."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with open(path) as f:
        data = json.load(f)
    panels = panels_of(data)
    if not panels:
        return 0
    panels = panels[:12]
    heights = [max(2.6, 0.18 * len(p[2])) if p[0] == "bars" else 3.0 for p in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, sum(heights)), dpi=110,
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, (kind, title, content) in zip(axes[:, 0], panels):
        (_draw_records if kind == "records" else _draw_bars)(ax, title, content)
    command = data.get("command") if isinstance(data, dict) else None
    fig.suptitle(os.path.basename(path) + ("\n" + str(command)[:100] if command else ""), fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(out_path)
    plt.close(fig)
    return len(panels)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--out-dir", help="where the PNGs go (default: beside each JSON file)")
    args = p.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        sys.exit("bench/report.py needs matplotlib: pip install matplotlib (or stella_mpi[plot])")
    failed = 0
    for path in args.files:
        folder = args.out_dir or os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        out = os.path.join(folder, os.path.splitext(os.path.basename(path))[0] + ".png")
        try:
            n = draw(path, out)
        except (OSError, ValueError) as e:
            print("%s: %s" % (path, e), file=sys.stderr)
            failed += 1
            continue
        print("%s -> %s (%d panels)" % (path, out, n) if n else "%s: nothing numeric to draw" % path)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
