"""The DDP hook against the Horovod-API path on the main job's setting: 2 clusters x 2 ranks over an
emulated WAN (default 100 Mbit/s), the byte LM (hidden 1024), SGD lr 0.05, the same seconds of
training for each run, side by side in one run:

* ``horovod-dense``: examples/train_horovod.py with ``--wan-route dense`` (Horovod's numerics):
  its final held-out loss is the target;
* ``horovod-<route>``: the Horovod-API path on the hook's route (``--compression``, default
  cache-aware 1 %);
* ``ddp-hook-<route>``: examples/train_ddp.py, DDP with ``stella_hook`` on the same route (SGD
  with momentum wrapped by ``ddp.wrap_optimizer``: momentum correction, as on the Horovod path);
* ``horovod-auto``: the Horovod script as it is (the automatic route, which may move to local
  steps: a DDP hook cannot);
* ``ddp-hook-auto``: DDP with the hook's automatic route (the adjuster over densities, THC bits
  and dense);
* ``ddp-plain``: DDP with torch's own allreduce (gloo across the WAN), what a DDP user has today.

Reported per run: steps, ms/step, WAN MB/step, final held-out loss and the time to the target,
and the hook's time over the Horovod path's on the same route (the issue's target: at most 1.1).

    python bench/bench_ddp_hook.py [--wan 100mbit] [--seconds 60] [--out bench/results/ddp_hook.json]

Needs root for the emulated WAN (network namespaces and tc tbf), as the main job does.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "examples"))
from provenance import provenance  # noqa: E402
from wan_main_job import time_to  # noqa: E402


def _run(label, script, extra, args, out, route="auto"):
    stellarun = os.path.join(os.path.dirname(sys.executable), "stellarun")
    cmd = [stellarun, "-np", "4", "--clusters", "2", "--wan", args.wan, "--wan-route", route, "--timeout", "300",
           sys.executable, os.path.join(ROOT, "examples", script), "--time-budget", str(args.seconds),
           "--eval-seconds", str(args.eval_seconds), "--hidden", str(args.hidden), "--lr", "0.05",
           "--log-every", "100", "--json-out", out] + extra
    t0 = time.time()
    print("[%s] started: %s" % (label, " ".join(cmd[1:])), file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit("%s failed (exit %d):\n%s" % (label, proc.returncode, (proc.stdout + proc.stderr)[-3000:]))
    with open(out) as f:
        result = json.load(f)
    print("[%s] done in %.0f s: %d steps, held-out loss %.4f" % (label, time.time() - t0, result["steps"],
                                                                 result["validation_loss"]), file=sys.stderr,
          flush=True)
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--wan", default="100mbit")
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--eval-seconds", type=float, default=3.0)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--compression", default="cacheaware", help="the route both paths take (a sparse compressor)")
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--runs", default="horovod-dense,horovod-route,ddp-hook-route,horovod-auto,ddp-hook-auto,ddp-plain")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "ddp_hook.json"))
    args = p.parse_args()
    route = ["--compression", args.compression, "--density", str(args.density)]
    name = "%s-%g%%" % (args.compression, 100 * args.density)
    plan = {
        "horovod-dense": ("train_horovod.py", ["--optimizer", "sgd", "--compression", "none"], "dense"),
        "horovod-route": ("train_horovod.py", ["--optimizer", "sgd"] + route, "auto"),
        "ddp-hook-route": ("train_ddp.py", route, "auto"),
        "ddp-hook-auto": ("train_ddp.py", ["--compression", "auto"], "auto"),
        "horovod-auto": ("train_horovod.py", ["--optimizer", "sgd", "--compression", "none"], "auto"),
        "ddp-plain": ("train_ddp.py", ["--no-hook"], "auto"),
    }
    wanted = args.runs.split(",")
    unknown = [w for w in wanted if w not in plan]
    if unknown or "horovod-dense" not in wanted:
        raise SystemExit("--runs: %s; known: %s (horovod-dense is the target and must run)"
                         % ("unknown %s" % unknown if unknown else "horovod-dense missing", ", ".join(plan)))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for key in wanted:
            script, extra, wan_route = plan[key]
            label = key.replace("route", name)
            results[label] = _run(label, script, extra, args, os.path.join(tmp, key + ".json"), wan_route)
    target = results["horovod-dense"]["validation_loss"]
    rows = []
    print("%.0f s of training each, 4 ranks in 2 clusters, WAN %s; target: dense's final held-out loss %.4f"
          % (args.seconds, args.wan, target))
    print("%-26s %6s %8s %11s %10s %16s" % ("run", "steps", "ms/step", "WAN MB/step", "held-out", "time to target"))
    for label, r in results.items():
        reached = time_to(r["curve"], target)
        rows.append({"run": label, "steps": r["steps"], "ms_per_step": r["ms_per_step"],
                     "wan_mb_per_step": r["wan_bytes_sent_per_step"] / 1e6, "validation_loss": r["validation_loss"],
                     "time_to_target_s": reached})
        print("%-26s %6d %8.1f %11.3f %10.4f %16s" % (label, r["steps"], r["ms_per_step"],
                                                     r["wan_bytes_sent_per_step"] / 1e6, r["validation_loss"],
                                                     "%.1f s" % reached if reached is not None else "not reached"))
    by = {row["run"]: row for row in rows}
    hook, hvd_route = by.get("ddp-hook-" + name), by.get("horovod-" + name)
    ratio = None
    if hook and hvd_route and hook["time_to_target_s"] and hvd_route["time_to_target_s"]:
        ratio = hook["time_to_target_s"] / hvd_route["time_to_target_s"]
        print("DDP hook / Horovod path, %s, time to dense's final loss: %.2f (target <= 1.1)" % (name, ratio))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(sys.argv), "provenance": provenance(), "wan": args.wan,
                   "seconds": args.seconds, "target_loss": target, "route": name, "hook_over_horovod": ratio,
                   "rows": rows, "curves": {k: v["curve"] for k, v in results.items()}}, f, indent=1)
    print("wrote %s" % args.out)


if __name__ == "__main__":
    main()
