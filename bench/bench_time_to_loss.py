"""Time to a target held-out loss at several WAN rates (issue 13's benchmark), in one command:

    .venv/bin/python bench/bench_time_to_loss.py                         # 20 Mbit/s, 100 Mbit/s, 1 Gbit/s
    .venv/bin/python bench/bench_time_to_loss.py --preset 14             # low-communication modes, torch's peers
    .venv/bin/python bench/bench_time_to_loss.py --rates 100mbit --modes dense adapt --seconds 30

For each rate (stellarun --wan RATE, 2 clusters of 2 ranks) and each mode it trains the byte-level
LM of bench/e2e_train.py (same model, data, seed and initial weights, SGD with momentum) for the
same --seconds of training wall-clock, evaluating the held-out loss every --eval-seconds
(evaluation time not counted). Modes (MODES below): "ddp" (torch DDP, gloo, flat), "powersgd"
(DDP with torch's PowerSGD hook), "postlocal8" (torch's post-local SGD, models averaged every 8
steps), "dense" (stella_mpi's hierarchical allreduce), "d0.001", "d0.01", "d0.1" (stella's sparse
route at that fixed density), "d0.01+singles" (cache-aware 1 % with singles=0.7), "adapt" (hvd.Adjuster between --min-density and --max-density),
"local8" / "diloco8" (hvd.LocalSteps every 8 steps, model averaging / outer Nesterov) and
"local8+sparse" (local steps with 1 % sparse pseudo-gradients), "thc4" / "thc2" (Compression.thc at 4
or 2 bits on every step), "local8+thc" (local steps, 4-bit THC pseudo-gradients) and "local8+overlap" /
"diloco8+overlap" (the exchange hidden behind the next period, LocalSteps(overlap=True)), "localadapt" (model
averaging with H chosen by the adjuster, step-time objective, --target), "localadapt+overlap" and "localadapt+thc" (H
chosen, 4-bit THC pseudo-gradients), "switch" (hvd.Adjuster(modes=("sync", "local")): the adjuster moves
between the sparse route, its density adjusted, and local steps with 4-bit THC pseudo-gradients, its H
adjusted), "auto" (the untouched Horovod script on the automatic route), "cpu1" (the CPU engine
with its defaults), and torchft's DiLoCo and Streaming DiLoCo ("torchft-diloco8",
"torchft-streaming8": bench/torchft_peer.py; bench/requirements.txt says how to install torchft).
The sparse modes use --compressor (cache-aware by default) with its defaults (error feedback,
momentum correction, warm-up; --plain-sparse: without the last two). --preset 13 (the default)
runs issue 13's set, --preset 14 issue 14's, --preset 31 issue 31's (the outer syncs: fragments, SparseLoCo's
pseudo-gradients, against torchft's DiLoCo and Streaming DiLoCo each over a small grid of H and outer
step, DDP and post-local SGD; with "limit", the same ranks as one cluster with no link limit, dense, and
"compute", each rank alone: each mode's WAN penalty, its time to the limit's final loss over the
limit's, and its utilisation, the compute-only step time over its step time), --preset 30 issue 30's: the automatic route against
every hand-picked stella route and every peer; it also reports, per rate, the time the automatic
route takes to the best peer's final loss over the best hand-picked route's (target <= 1.1) and
the best peer's time over the automatic route's (target >= 1.5), and writes one JSON and one PNG
per rate beside the combined ones.

The target loss of a rate is --target-loss, or else the median of the final held-out losses of
that rate's runs (at least half of the modes reach it). Time to the target is the training time
of the first evaluation at or below it (so it is measured, at --eval-seconds resolution). Prints
one table per rate with each mode's time to the target, its ratio to DDP's and to the best fixed
density's; writes bench/results/time_to_loss.json and, with matplotlib, time_to_loss.png (held-out
loss against training time, one panel per rate).
"""
import argparse
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile

from progress import Progress
from provenance import provenance

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from stellarun.shaping import parse_rate  # noqa: E402  (the launcher's own reading of a rate)

RESULTS = os.path.join(HERE, "results")
FIXED = ("d0.001", "d0.01", "d0.1")
# mode: bench/e2e_train.py's arguments ({c}: --compressor; sparse densities are the mode's own)
MODES = {
    "ddp": ["--mode", "ddp"],
    "powersgd": ["--mode", "powersgd"],
    "postlocal8": ["--mode", "postlocal:8"],
    "dense": ["--mode", "dense"],
    "d0.001": ["--mode", "sparse:{c}", "--density", "0.001"],
    "d0.01": ["--mode", "sparse:{c}", "--density", "0.01"],
    "d0.1": ["--mode", "sparse:{c}", "--density", "0.1"],
    "d0.01+singles": ["--mode", "sparse:cacheaware", "--density", "0.01", "--singles", "0.7"],
    "adapt": ["--mode", "adapt:{c}", "--density", "0.01"],
    "adapt+thc": ["--mode", "adapt:{c}", "--density", "0.01", "--thc-bits", "2", "4", "8"],
    "local8": ["--mode", "local:8"],
    "diloco8": ["--mode", "diloco:8"],
    "local8+sparse": ["--mode", "local:8:{c}", "--density", "0.01"],
    "thc4": ["--mode", "sparse:thc", "--bits", "4"],
    "thc2": ["--mode", "sparse:thc", "--bits", "2"],
    "local8+thc": ["--mode", "local:8:thc", "--bits", "4"],
    "diloco8+thc": ["--mode", "diloco:8:thc", "--bits", "4"],
    "local8+overlap": ["--mode", "local:8", "--overlap"],
    "diloco8+overlap": ["--mode", "diloco:8", "--overlap"],
    "localadapt": ["--mode", "localadapt"],
    "localadapt+overlap": ["--mode", "localadapt", "--overlap"],
    "localadapt+thc": ["--mode", "localadapt:thc", "--bits", "4"],
    "switch": ["--mode", "switch:{c}", "--density", "0.01", "--bits", "4"],
    "auto": ["--mode", "auto"],   # the untouched Horovod script: the automatic route
    "auto:nesterov": ["--mode", "auto", "--auto-outer", "nesterov"],   # the same, its THC rung's outer step
    # DiLoCo's Nesterov whatever the inner optimizer (before issue 31's choice by optimizer: an ablation)
    "auto:thc": ["--mode", "auto:thc"],   # the same, its pseudo-gradient THC 4 bits alone (before issue 31's rungs)
    "cpu1": ["--mode", "cpu:{c}", "--density", "0.01"],   # the CPU engine with its defaults
    # torchft's peers (bench/torchft_peer.py): DiLoCo every 8 steps, and Streaming DiLoCo (2 fragments,
    # one synchronized every 4 steps, overlapped with 3 inner steps: its best of 1 and 3 at 100 Mbit/s),
    # outer Nesterov lr 0.7, momentum 0.9
    "torchft-diloco8": ["--mode", "torchft-diloco:8"],
    "torchft-streaming8": ["--mode", "torchft-streaming:8:2", "--fragment-sync-delay", "3"],
    # issue 31: the peers' small grid (H 8 or 32; outer Nesterov 0.7/0.9 or model averaging, lr 1 without
    # momentum), Streaming DiLoCo with 4 fragments at H=32 (one every 8 steps, 3 steps of overlap)
    "torchft-diloco8:avg": ["--mode", "torchft-diloco:8", "--outer-lr", "1.0", "--outer-momentum", "0",
                            "--no-nesterov"],
    "torchft-diloco32": ["--mode", "torchft-diloco:32"],
    "torchft-diloco32:avg": ["--mode", "torchft-diloco:32", "--outer-lr", "1.0", "--outer-momentum", "0",
                             "--no-nesterov"],
    "torchft-streaming8:avg": ["--mode", "torchft-streaming:8:2", "--fragment-sync-delay", "3", "--outer-lr", "1.0",
                               "--outer-momentum", "0", "--no-nesterov"],
    "torchft-streaming32": ["--mode", "torchft-streaming:32:4", "--fragment-sync-delay", "3"],
    "torchft-streaming32:avg": ["--mode", "torchft-streaming:32:4", "--fragment-sync-delay", "3", "--outer-lr", "1.0",
                                "--outer-momentum", "0", "--no-nesterov"],
    # issue 31's stella modes: SparseLoCo's recipe (1 %, 2 bits, decay 0.95, outer average), and
    # fragments (4 per period, each exchange in flight for one step) with THC or SparseLoCo
    "local8+sparseloco": ["--mode", "local:8:sparseloco", "--density", "0.01", "--bits", "2", "--feedback-decay",
                          "0.95"],
    "sum8+sparseloco": ["--mode", "sum:8:sparseloco", "--density", "0.01", "--bits", "2", "--feedback-decay", "0.95"],
    # SparseLoCo's recipe at shorter periods: nearer the synchronous route's progress per step
    "sum2+sparseloco": ["--mode", "sum:2:sparseloco", "--density", "0.01", "--bits", "2", "--feedback-decay", "0.95"],
    "sum4+sparseloco": ["--mode", "sum:4:sparseloco", "--density", "0.01", "--bits", "2", "--feedback-decay", "0.95"],
    "local8+f4+thc": ["--mode", "local:8:thc", "--bits", "4", "--fragments", "4", "--fragment-delay", "1"],
    "local32+f4+sparseloco": ["--mode", "local:32:sparseloco", "--density", "0.01", "--bits", "2",
                              "--feedback-decay", "0.95", "--fragments", "4", "--fragment-delay", "1"],
    # torchft-streaming32's own recipe on stella: H=32, 4 fragments, 3 steps in flight, outer
    # Nesterov, the pseudo-gradient uncompressed (the same algorithm, to tell the implementations
    # apart from the automatic route's choices)
    "diloco32+f4": ["--mode", "diloco:32", "--fragments", "4", "--fragment-delay", "3"],
    "diloco32+f4+thc": ["--mode", "diloco:32:thc", "--bits", "4", "--fragments", "4", "--fragment-delay", "3"],
    # ... and without the fragments, at the automatic route's H at 1 Gbit/s (16) and torchft's (32)
    "diloco16+thc": ["--mode", "diloco:16:thc", "--bits", "4"],
    "diloco32+thc": ["--mode", "diloco:32:thc", "--bits", "4"],
    # each rank a replica (LocalSteps(inner="rank")): no reduction inside a cluster at inner steps
    "diloco32+thc+rank": ["--mode", "diloco:32:thc", "--bits", "4", "--inner", "rank"],
    "diloco32+f4+thc+rank": ["--mode", "diloco:32:thc", "--bits", "4", "--fragments", "4", "--fragment-delay", "3",
                             "--inner", "rank"],
    # the limit (issue 31): the same 4 ranks as one cluster, no link limit, dense; and each rank
    # training alone with no exchange at all (the compute-only step time of the utilisation)
    "limit": ["--mode", "dense"],
    "compute": ["--mode", "compute"],
}
TORCHFT = ("torchft-diloco8", "torchft-streaming8", "torchft-diloco8:avg", "torchft-diloco32", "torchft-diloco32:avg",
           "torchft-streaming8:avg", "torchft-streaming32", "torchft-streaming32:avg")
NO_WAN = ("limit", "compute")   # run once, on loopback with one cluster, whatever the rates
PRESETS = {   # issue 13: densities and the adjuster; issue 14: low-communication modes and torch's peers;
    # issue 30: the untouched script's automatic route, each hand-picked stella route, torch's and torchft's peers
    "13": ("ddp", "dense") + FIXED + ("adapt",),
    "14": ("ddp", "powersgd", "postlocal8", "d0.01", "adapt", "local8", "diloco8", "local8+sparse", "thc4",
           "local8+thc"),
    "30": ("auto", "dense", "d0.01", "d0.1", "thc4", "local8+thc", "localadapt+thc", "cpu1", "ddp", "powersgd",
           "postlocal8") + TORCHFT[:2],
    # issue 31: the outer syncs against torchft's peers (their grid), DDP and post-local SGD, with the limit
    "31": ("local8", "local8+thc", "localadapt+thc", "local8+sparseloco", "local8+f4+thc", "local32+f4+sparseloco",
           "ddp", "postlocal8") + TORCHFT + NO_WAN,
}
TORCH_PEERS = ("ddp", "powersgd", "postlocal8") + TORCHFT
HAND_PICKED = ("dense",) + FIXED + ("d0.01+singles", "adapt", "adapt+thc", "local8", "diloco8", "local8+sparse", "thc4",
                                    "thc2", "local8+thc", "diloco8+thc", "local8+overlap", "diloco8+overlap", "localadapt",
                                    "localadapt+overlap", "localadapt+thc", "switch", "cpu1", "local8+sparseloco",
                                    "local8+f4+thc", "local32+f4+sparseloco")
STELLA_SPARSE = {"d0.001", "d0.01", "d0.1", "d0.01+singles", "adapt", "adapt+thc", "local8+sparse", "switch"}


def run_one(rate, mode, args, tmp):
    out = os.path.join(tmp, "%s_%s.json" % (rate, mode.replace("+", "_")))
    stellarun = os.path.join(os.path.dirname(sys.executable), "stellarun")
    how = [a.format(c=args.compressor) for a in MODES[mode]]
    if mode.startswith(("adapt", "switch")):   # (adapt+thc too: the same density range, THC rungs besides)
        how += ["--min-density", str(args.min_density), "--max-density", str(args.max_density)]
    if mode in TORCHFT and importlib.util.find_spec("torchft") is None:
        print("  %s %s ... skipped: torchft is not installed (bench/requirements.txt says how)" % (rate, mode))
        return {"error": "torchft is not installed"}
    script = "torchft_peer.py" if mode in TORCHFT else "e2e_train.py"
    layout = ["--clusters", "1"] if mode in NO_WAN else ["--clusters", "2", "--wan", rate] + \
        (["--wan-delay", args.wan_delay] if args.wan_delay else [])
    # the limit trains for --limit-seconds (half the budget by default), so that a WAN penalty up
    # to seconds / limit-seconds is measured within the other runs' budget
    budget = (args.limit_seconds or args.seconds / 2) if mode in NO_WAN else args.seconds
    cmd = [stellarun, "-np", "4"] + layout + [
        "--timeout", "600", sys.executable, os.path.join(HERE, script), "--workload", "lm", "--hidden", str(args.hidden),
        "--lr", str(args.lr), "--optimizer", args.optimizer, "--steps", "1000000", "--time-budget", str(budget),
        "--eval-seconds", str(args.eval_seconds), "--out", out] + how
    if args.plain_sparse and mode in STELLA_SPARSE:
        cmd.append("--plain-sparse")
    print("  %s %s ..." % (rate, mode), end="", flush=True)
    limit = args.seconds * 2 + 150   # (a run takes its seconds and ~30 s more)
    # its own session, so that a run past its limit is ended with every rank and helper it started
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        stdout, stderr = _end_group(proc)
        print(" timed out after %d s" % limit)
        return {"error": "timed out after %d s: %s" % (limit, ((stdout or "") + (stderr or ""))[-3000:]),
                "command": " ".join(cmd)}
    if proc.returncode != 0:
        print(" failed")
        return {"error": (stdout + stderr)[-3000:], "command": " ".join(cmd)}
    with open(out) as f:
        res = json.load(f)
    res["command"] = " ".join(["stellarun"] + cmd[1:])
    if mode in TORCH_PEERS and res.get("wan_mode") != "namespaces":
        # without namespaces stellarun paces stella's own sends only: torch's gloo would run unthrottled
        print(" refused: WAN mode %r, torch's traffic is not shaped (run as root for namespaces)" % res.get("wan_mode"))
        return {"error": "WAN mode %r does not shape torch's traffic" % res.get("wan_mode"), "command": res["command"]}
    steps = len(res["records"])
    print(" %d steps, held-out loss %.4f" % (steps, res["validation_loss"]), flush=True)
    return res


def _end_group(proc):
    """SIGTERM to the run's process group (stellarun then stops its job and removes its
    namespaces), SIGKILL 30 s later if it is still there; returns what it wrote."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            return proc.communicate(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    return proc.communicate()


def time_to(curve, target):
    for point in curve:
        if point["validation_loss"] <= target:
            return point["seconds"]
    return None


def summarize(runs, target_loss):
    """Per rate: the target and each mode's time to it, step time, WAN bytes and ratios."""
    table = {}
    for rate, modes in runs.items():
        finals = [r["validation_loss"] for m, r in modes.items() if "error" not in r and m not in NO_WAN]
        if not finals:
            table[rate] = {"target_loss": None, "best_fixed_s": None, "modes": {m: {"error": True} for m in modes}}
            continue
        target = target_loss if target_loss is not None else statistics.median(finals)
        rows = {}
        for mode, r in modes.items():
            if "error" in r:
                rows[mode] = {"error": True}
                continue
            recs = r["records"]
            rows[mode] = {"time_to_target_s": time_to(r["curve"], target), "final_loss": r["validation_loss"],
                          "steps": len(recs), "ms_per_step": 1000 * recs[-1]["elapsed_s"] / len(recs),
                          "wan_mb_per_step": statistics.mean((x["wan_bytes_rank"] or 0) for x in recs) / 1e6
                          if recs[0]["wan_bytes_rank"] is not None else None,
                          "densities": sorted({x["density"] for x in recs if x["density"] is not None}),
                          "mode_switches": [(step, route) for step, route, _ in r.get("mode_switches") or []]}
        fixed = [rows[m]["time_to_target_s"] for m in FIXED if m in rows and rows[m].get("time_to_target_s")]
        best_fixed = min(fixed) if fixed else None
        ddp = rows.get("ddp", {}).get("time_to_target_s")
        for row in rows.values():
            t = row.get("time_to_target_s")
            row["vs_ddp"] = (ddp / t) if (t and ddp) else None             # > 1: sooner than DDP
            row["vs_best_fixed"] = (t / best_fixed) if (t and best_fixed) else None   # <= 1: no later
        table[rate] = {"target_loss": target, "best_fixed_s": best_fixed, "modes": rows}
        _against_the_limit(modes, rows, table[rate])
        _against_torchft(modes, rows, table[rate])
        # issue 14's yardstick: the best torch peer's final loss, and how much sooner each stella
        # mode reaches it than that peer first did
        peers = [m for m in TORCH_PEERS if m in rows and not rows[m].get("error")]
        if peers:
            peer = min(peers, key=lambda m: rows[m]["final_loss"])
            loss = rows[peer]["final_loss"]
            t_peer = time_to(modes[peer]["curve"], loss)
            table[rate]["best_peer"] = {"mode": peer, "final_loss": loss, "time_s": t_peer}
            for mode, row in rows.items():
                if mode in TORCH_PEERS or mode in NO_WAN or row.get("error"):
                    continue
                t = time_to(modes[mode]["curve"], loss)
                row["to_peer_loss_s"] = t
                row["peer_time_over_this"] = (t_peer / t) if (t and t_peer) else None   # >= 1.5: the target
            # issue 30's yardsticks: the automatic route against the best hand-picked stella route (<= 1.1)
            # and against the best peer (>= 1.5), both to the best peer's final loss
            picked = [(m, rows[m]["to_peer_loss_s"]) for m in HAND_PICKED if rows.get(m, {}).get("to_peer_loss_s")]
            if "auto" in rows and not rows["auto"].get("error") and picked:
                best, t_best = min(picked, key=lambda x: x[1])
                t_auto = rows["auto"].get("to_peer_loss_s")
                table[rate]["automatic"] = {"best_hand_picked": best, "best_hand_picked_s": t_best, "auto_s": t_auto,
                                            "auto_over_best_hand_picked": t_auto / t_best if t_auto else None,
                                            "peer_over_auto": t_peer / t_auto if (t_auto and t_peer) else None}
    return table


def _against_the_limit(modes, rows, out):
    """Issue 31's yardsticks against the limit (the same ranks as one cluster, dense, no link):
    each mode's WAN penalty (its time to the limit's final loss over the limit's own) and its
    compute utilisation (the compute-only step time, each rank alone, over its step time)."""
    limit, compute = modes.get("limit"), modes.get("compute")
    if limit and "error" not in limit:
        loss = limit["validation_loss"]
        t_limit = time_to(limit["curve"], loss)
        out["limit"] = {"final_loss": loss, "time_s": t_limit}
        for mode, row in rows.items():
            if not row.get("error"):
                t = time_to(modes[mode]["curve"], loss)
                row["to_limit_loss_s"] = t
                row["wan_penalty"] = t / t_limit if (t and t_limit) else None
    if compute and "error" not in compute:
        alone = statistics.median(r["step_s"] for r in compute["records"][1:])
        out["compute_step_s"] = alone
        for row in rows.values():
            if not row.get("error"):
                row["utilisation"] = alone / (row["ms_per_step"] / 1000.0)


def _against_torchft(modes, rows, out):
    """The best torchft mode (lowest final loss), and how much sooner each stella mode reaches
    that loss than the torchft mode itself first did (issue 31's target: >= 1.5)."""
    ft = [m for m in TORCHFT if m in rows and not rows[m].get("error")]
    if not ft:
        return
    best = min(ft, key=lambda m: rows[m]["final_loss"])
    loss = rows[best]["final_loss"]
    t_best = time_to(modes[best]["curve"], loss)
    out["best_torchft"] = {"mode": best, "final_loss": loss, "time_s": t_best}
    for mode, row in rows.items():
        if mode in TORCH_PEERS or mode in NO_WAN or row.get("error"):
            continue
        t = time_to(modes[mode]["curve"], loss)
        row["to_torchft_loss_s"] = t
        row["torchft_time_over_this"] = t_best / t if (t and t_best) else None


def print_table(table, seconds):
    for rate, t in table.items():
        if t["target_loss"] is None:
            print("\n=== WAN %s: every mode failed ===" % rate)
            continue
        print("\n=== WAN %s: target held-out loss %.4f (%g s of training per mode) ===" % (rate, t["target_loss"],
                                                                                        seconds))
        print("%-7s %8s %8s %10s %10s %12s %10s %14s" % ("mode", "steps", "ms/step", "WAN MB/st", "final loss",
                                                        "to target", "DDP/this", "this/best fix"))
        for mode, row in t["modes"].items():
            if row.get("error"):
                print("%-7s failed" % mode)
                continue
            tt = row["time_to_target_s"]
            print("%-7s %8d %8.1f %10s %10.4f %12s %10s %14s" % (
                mode, row["steps"], row["ms_per_step"],
                "%.3f" % row["wan_mb_per_step"] if row["wan_mb_per_step"] is not None else "-", row["final_loss"],
                "%.1f s" % tt if tt is not None else "not reached",
                "%.2fx" % row["vs_ddp"] if row["vs_ddp"] else "-",
                "%.2f" % row["vs_best_fixed"] if row["vs_best_fixed"] else "-"))
        peer = t.get("best_peer")
        if peer:
            print("best torch peer: %s, final loss %.4f (first reached at %s); stella modes to that loss:"
                  % (peer["mode"], peer["final_loss"], "%.1f s" % peer["time_s"] if peer["time_s"] else "-"))
            for mode, row in t["modes"].items():
                if "to_peer_loss_s" in row:
                    tt = row["to_peer_loss_s"]
                    print("  %-14s %12s %s" % (mode, "%.1f s" % tt if tt is not None else "not reached",
                                               "(%.1fx sooner)" % row["peer_time_over_this"]
                                               if row["peer_time_over_this"] else ""))
        ft = t.get("best_torchft")
        if ft:
            print("best torchft mode: %s, final loss %.4f (first reached at %s)" % (
                ft["mode"], ft["final_loss"], "%.1f s" % ft["time_s"] if ft["time_s"] else "-"))
        if "limit" in t or "compute_step_s" in t:
            print("%-24s %14s %12s %12s %12s" % ("mode", "to torchft's", "torchft/this", "WAN penalty", "utilisation"))
            for mode, row in t["modes"].items():
                if row.get("error") or mode in NO_WAN:
                    continue
                print("%-24s %14s %12s %12s %12s" % (
                    mode, "%.1f s" % row["to_torchft_loss_s"] if row.get("to_torchft_loss_s") else "-",
                    "%.2fx" % row["torchft_time_over_this"] if row.get("torchft_time_over_this") else "-",
                    "%.2f" % row["wan_penalty"] if row.get("wan_penalty") else "not reached",
                    "%.0f %%" % (100 * row["utilisation"]) if row.get("utilisation") else "-"))
        auto = t.get("automatic")
        if auto:
            print("automatic route: %s to the best peer's final loss; best hand-picked stella route %s: %.1f s "
                  "(automatic / best hand-picked %s, target <= 1.1; best peer / automatic %s, target >= 1.5)"
                  % ("%.1f s" % auto["auto_s"] if auto["auto_s"] else "not reached", auto["best_hand_picked"],
                     auto["best_hand_picked_s"], "%.2f" % auto["auto_over_best_hand_picked"]
                     if auto["auto_over_best_hand_picked"] else "-",
                     "%.2f" % auto["peer_over_auto"] if auto["peer_over_auto"] else "-"))


def plot(runs, table, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 4), dpi=110, squeeze=False)
    for ax, (rate, modes) in zip(axes[0], runs.items()):
        for mode, r in modes.items():
            if "error" not in r:
                ax.plot([p["seconds"] for p in r["curve"]], [p["validation_loss"] for p in r["curve"]],
                        marker="o", markersize=2, label=mode)
        if table[rate]["target_loss"] is not None:
            ax.axhline(table[rate]["target_loss"], color="grey", lw=0.8, ls="--")
        ax.set_title("WAN %s" % rate)
        ax.set_xlabel("training time (s)")
        ax.set_ylabel("held-out loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", nargs="+", default=["20mbit", "100mbit", "1gbit"])
    p.add_argument("--preset", choices=sorted(PRESETS), default="13",
                   help="13: DDP, dense, fixed densities, adaptive; 14: low-communication modes and torch's peers")
    p.add_argument("--modes", nargs="+", choices=list(MODES), help="instead of the preset's")
    p.add_argument("--seconds", type=float, default=40.0, help="training wall-clock of each run")
    p.add_argument("--eval-seconds", type=float, default=2.0)
    p.add_argument("--limit-seconds", type=float, default=0.0,
                   help="training wall-clock of the limit and compute runs (0: half of --seconds, so that a WAN "
                        "penalty up to 2 is measured)")
    p.add_argument("--wan-delay", default="",
                   help="one-way delay on the emulated link (stellarun --wan-delay, e.g. 25ms; default none: the "
                        "namespaces' 0.3 ms)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd",
                   help="every mode's inner optimizer: SGD with momentum 0.9, or Adam (give --lr 2e-3)")
    p.add_argument("--compressor", default="cacheaware")
    p.add_argument("--plain-sparse", action="store_true",
                   help="sparse modes without momentum correction and warm-up (the previous release's defaults)")
    p.add_argument("--min-density", type=float, default=1e-3)
    p.add_argument("--max-density", type=float, default=1.0)
    p.add_argument("--target-loss", type=float)
    p.add_argument("--out", help="default: bench/results/time_to_loss.json (preset 14: time_to_loss_14.json)")
    p.add_argument("--resume", action="store_true",
                   help="keep the finished runs of an interrupted run of the same settings (OUT.partial.json)")
    args = p.parse_args()
    for rate in args.rates:   # refused here, before any run, not by each run's launcher
        try:
            parse_rate(rate)
        except ValueError as e:
            p.error("--rates: %s" % e)
    if args.out is None:
        args.out = os.path.join(RESULTS, "time_to_loss%s.json" % ("" if args.preset == "13" else "_" + args.preset))
    # every finished run is kept in OUT.partial.json at once; --resume takes the runs it holds
    # (of the same settings) instead of training them again
    partial = os.path.splitext(args.out)[0] + ".partial.json"
    runs = {}
    if args.resume:
        with open(partial) as f:
            kept = json.load(f)
        same = {k: v for k, v in kept["settings"].items() if k not in ("resume",)} == \
            {k: v for k, v in vars(args).items() if k not in ("resume",)}
        if not same:
            raise SystemExit("--resume: %s was written with other settings: %s" % (partial, kept["settings"]))
        runs = {rate: {m: r for m, r in modes.items() if "error" not in r} for rate, modes in kept["runs"].items()}
    todo = [(rate, mode) for rate in args.rates for mode in args.modes or PRESETS[args.preset]
            if mode not in runs.get(rate, {})]
    progress = Progress(len(todo))
    with tempfile.TemporaryDirectory() as tmp:
        for rate in args.rates:
            done = runs.setdefault(rate, {})
            for mode in args.modes or PRESETS[args.preset]:
                if mode in done:
                    print("  %s %s ... kept from %s" % (rate, mode, partial))
                    continue
                ran = next((runs[r][mode] for r in args.rates if r != rate and mode in runs.get(r, {})), None)
                if mode in NO_WAN and ran is not None and "error" not in ran:   # once, whatever the rate
                    done[mode] = ran
                    continue
                progress.start("%s %s" % (rate, mode))
                done[mode] = run_one(rate, mode, args, tmp)
                err = done[mode].get("error")
                progress.end("%s %s" % (rate, mode), (err.strip().splitlines() or [""])[-1][:100] if err else
                             "held-out loss %.4f" % done[mode]["validation_loss"], failed=bool(err))
                with open(partial, "w") as f:
                    json.dump({"settings": vars(args), "provenance": provenance(), "runs": runs}, f)
    table = summarize(runs, args.target_loss)
    print_table(table, args.seconds)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "settings": vars(args),
                   "provenance": provenance(), "table": table, "runs": runs}, f)
    png = plot(runs, table, os.path.splitext(args.out)[0] + ".png")
    print("\nwrote %s%s" % (args.out, (" and " + png) if png else ""))
    if len(runs) > 1:   # one JSON and one PNG per rate as well
        for rate in runs:
            base = "%s_%s" % (os.path.splitext(args.out)[0], rate)
            with open(base + ".json", "w") as f:
                json.dump({"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
                           "settings": vars(args), "provenance": provenance(), "rate": rate, "table": table[rate],
                           "runs": runs[rate]}, f)
            png = plot({rate: runs[rate]}, {rate: table[rate]}, base + ".png")
            print("wrote %s.json%s" % (base, (" and " + png) if png else ""))
    if all("error" in r for modes in runs.values() for r in modes.values()):
        raise SystemExit("bench_time_to_loss: every run failed (their errors are in %s)" % args.out)


if __name__ == "__main__":
    main()
