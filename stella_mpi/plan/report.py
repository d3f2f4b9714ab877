"""The plan: every route's prediction (:mod:`.predict`) for the user's clusters, a table on
stdout, the JSON and a PNG, and the recommendation (the route that reaches the target
soonest, revocations counted; without a target, the fastest step among the routes whose
loss at equal steps in the calibration is within 1 % of dense's) with its batch split."""
import json
import math
import os

from . import routes as route_table
from .predict import HERE, Machine, layout_from_spec, predict, steps_to, time_to_target
from .workload import SIZES

QUALITY_TOLERANCE = 0.01


def _final_loss(record):
    curve = record.get("curve") or []
    return curve[-1][1] if curve else None


def _measured_parts(record, cluster_sizes):
    """The calibration's parts of a route's step, the busiest rank's (with the ranks' mean WAN
    bytes and the calibration's layout)."""
    if not record:
        return None
    rows = record["ranks"]
    worst = max(rows, key=lambda r: r["step_s"])
    return dict(worst, mean_wan_bytes_sent=sum(r["wan_bytes_sent"] for r in rows) / len(rows),
                cluster_sizes=cluster_sizes)


def plan(spec, calib, table=None):
    """The plan as a dict: predictions per route, the recommendation, and what could not be
    predicted, with why."""
    from .kernel_costs import KernelCosts
    costs = KernelCosts.from_dict(calib["kernel_costs"]) if calib.get("kernel_costs") else None
    source = str(spec["model"]["source"]).lower()
    if source in SIZES:
        size = SIZES[source]
        params = size.param_numels()
        calib = dict(calib, flops_per_sample=6.0 * sum(params) * size.tokens_per_sample)
    else:
        params = calib["param_numels"]
    if not spec.get("global_batch"):
        spec = dict(spec, global_batch=calib.get("global_batch") or 64)
    layout = layout_from_spec(spec)
    machine = Machine(calib, table, costs)
    if spec.get("link_efficiency"):   # the user's goodput over nominal, over the calibration's
        machine.link_efficiency = machine.allreduce_efficiency = float(spec["link_efficiency"])
    if spec.get("allreduce_efficiency"):
        machine.allreduce_efficiency = float(spec["allreduce_efficiency"])
    for i, c in enumerate(layout.clusters):   # an unknown kind ends the plan, naming the cluster
        if c.kind != HERE:
            try:
                machine.gpu(c.kind)
            except ValueError as e:
                raise ValueError("cluster %d: %s" % (i, e)) from None
    fusion = int(spec["fusion_threshold_mb"] * 2 ** 20) if spec.get("fusion_threshold_mb") else None
    measured_routes = calib.get("routes") or {}
    dense_curve = (measured_routes.get("dense") or {}).get("curve")
    dense_final = _final_loss(measured_routes.get("dense") or {})
    target = spec.get("target_loss")
    rows, skipped = [], []
    for route in route_table.select(spec.get("routes")):
        record = measured_routes.get(route.name)
        sync = None
        if route.wire.kind == "local":   # the synchronous route of its pseudo-gradient's compression
            pseudo = route.wire.pseudo or route_table.Route(kind="dense")
            sync = next((measured_routes.get(r.name) for r in route_table.ROUTES
                         if r.wire == pseudo and not r.overlap and measured_routes.get(r.name)), None)
        try:
            pred = predict(route, layout, machine, params, fusion, _measured_parts(record, machine.calib_sizes),
                           _measured_parts(sync, machine.calib_sizes))
        except ValueError as e:
            skipped.append({"route": route.name, "why": str(e)})
            continue
        pred["final_loss"] = _final_loss(record) if record else None
        steps, why = None, None
        if target is not None:
            steps = record.get("steps_to_target") if record else None
            if steps is None:
                why = ("not reached in the calibration's %d steps" % record["steps"]) if record else \
                    "quality not measured (no calibration run of this route)"
        elif spec.get("target_steps"):
            steps = float(spec["target_steps"])
            if not (record and dense_curve and dense_final is not None):
                pred["note"] = "dense's steps (quality not measured)"
            else:
                mine = steps_to(record["curve"], dense_final)
                theirs = steps_to(dense_curve, dense_final)
                if mine and theirs:
                    steps *= mine / theirs
                else:
                    why = "does not reach dense's loss in the calibration"
                    steps = None
        if steps is not None:
            pred["to_target"] = time_to_target(pred, steps, layout, int(spec.get("commit_every") or 100))
            budget = spec.get("budget_hours")
            if budget and pred["to_target"].get("seconds_with_revocations", pred["to_target"]["seconds"]) > \
                    budget * 3600:
                why = "needs more than the budget of %g h" % budget
        if why:
            pred["unreachable"] = why
        rows.append(pred)
    reachable = [r for r in rows if "to_target" in r and "unreachable" not in r and "note" not in r]
    if reachable:
        best = min(reachable, key=lambda r: r["to_target"].get("seconds_with_revocations", r["to_target"]["seconds"]))
        reason = "reaches the target soonest"
    else:
        faithful = [r for r in rows if r["final_loss"] is not None and dense_final is not None
                    and r["final_loss"] <= dense_final * (1 + QUALITY_TOLERANCE)]
        pool = faithful or rows
        best = min(pool, key=lambda r: r["step_s"]) if pool else None
        reason = ("the fastest step among the routes within %g %% of dense's loss at equal steps"
                  % (100 * QUALITY_TOLERANCE) if faithful else
                  "the fastest step; quality not measured for a named size: check it at equal steps "
                  "(bench/bench_parity.py)")
        if target is not None or (spec.get("target_steps") and faithful):
            reason += "; no route reaches the target%s" % (
                " within the budget" if spec.get("budget_hours") else "")
    return {"spec": spec, "layout": {"clusters": spec["clusters"], "global_batch": layout.global_batch,
                                     "parameters": sum(params)},
            "predictions": rows, "skipped": skipped,
            "recommendation": {"route": best["route"], "why": reason, "batch_split": best["batch_split"]}
            if best else None}


def _fmt_s(s):
    if s is None or math.isinf(s):
        return "-"
    return "%.0f s" % s if s < 3600 else "%.1f h" % (s / 3600)


def table_text(result):
    lines = ["%-20s %9s %5s %11s %7s %10s %8s  %s" % ("route", "step", "util", "WAN MB/step", "steps",
                                                      "to target", "cost", "note")]
    for r in result["predictions"]:
        t = r.get("to_target") or {}
        seconds = t.get("seconds_with_revocations", t.get("seconds"))
        step = "%.1f ms" % (1e3 * r["step_s"]) if r["step_s"] < 10 else "%.1f s" % r["step_s"]
        lines.append("%-20s %9s %4.0f%% %11.3f %7s %10s %8s  %s" % (
            r["route"], step, 100 * r["utilisation"], r["wan_bytes_per_step"] / 1e6,
            "%.0f" % t["steps"] if t else "-", _fmt_s(seconds),
            "$%.0f" % t["cost_usd"] if "cost_usd" in t and not math.isinf(t["cost_usd"]) else "-",
            r.get("unreachable") or t.get("revocation_note") or r.get("note", "")))
    for s in result["skipped"]:
        lines.append("%-20s skipped: %s" % (s["route"], s["why"]))
    rec = result["recommendation"]
    if rec:
        lines.append("recommended: %s (%s); batch per GPU %s" % (rec["route"], rec["why"], rec["batch_split"]))
    return "\n".join(lines)


def write_plot(result, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = result["predictions"]
    names = [r["route"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].barh(names, [1e3 * r["step_s"] for r in rows], color="tab:blue", label="step")
    axes[0].barh(names, [1e3 * r["compute_s"] for r in rows], color="tab:green", label="compute")
    axes[0].set_xlabel("ms per step (predicted)")
    axes[0].legend()
    axes[0].invert_yaxis()
    t = [(r.get("to_target") or {}) for r in rows]
    minutes = [x.get("seconds_with_revocations", x.get("seconds", 0)) / 60 for x in t]
    axes[1].barh(names, [m if not math.isinf(m) else 0.0 for m in minutes], color="tab:orange")
    axes[1].set_xlabel("minutes to the target (predicted)")
    axes[1].invert_yaxis()
    rec = result["recommendation"]
    fig.suptitle("stellarun plan: %s; recommended %s" % (
        " + ".join("%dx%s" % (c["count"], c["kind"]) for c in result["layout"]["clusters"]),
        rec["route"] if rec else "-"))
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(spec_path, calib_path):
    with open(spec_path) as f:
        spec = json.load(f)
    with open(calib_path) as f:
        calib = json.load(f)
    from .gpus import load_table
    table = load_table(spec.get("gpu_table"))
    result = plan(spec, calib, table)
    print(table_text(result))
    out = spec.get("out") or "plan.json"
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    png = write_plot(result, spec["plot"]) if spec.get("plot") else None
    print("plan written to %s%s" % (out, " and %s" % png if png else ""))
