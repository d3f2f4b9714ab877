"""``python -m stella_mpi.plan check|calibrate|report``: the jobs ``stellarun plan`` starts."""
import argparse
import json
import sys

from .workload import ModelScriptError


def check(spec_path):
    """Refuse what the launcher cannot check (GPU kinds, routes, the model script) before the
    calibration starts."""
    with open(spec_path) as f:
        spec = json.load(f)
    from . import routes
    from .gpus import get_gpu, load_table
    from .predict import HERE
    from .workload import load, split_source, check_source
    routes.select(spec.get("routes"))
    table = load_table(spec.get("gpu_table"))
    for i, c in enumerate(spec["clusters"]):
        if c["kind"] != HERE:
            try:
                get_gpu(c["kind"], table)
            except ValueError as e:
                raise ValueError("cluster %d: %s" % (i, e)) from None
    source = spec["model"]["source"]
    check_source(source)
    if split_source(source)[0] is not None:
        load(source, 1, 0, spec["model"].get("args") or {})
    elif any(c["kind"] == HERE for c in spec["clusters"]):
        raise ValueError("--model %s is a named size: it cannot run here, so clusters of kind 'here' cannot be "
                         "predicted; give GPU kinds" % source)
    elif spec.get("target_loss") is not None:
        raise ValueError("--model %s is a named size: its loss cannot be measured here; give --target-steps (the "
                         "dense steps to your target) instead of --target-loss" % source)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m stella_mpi.plan")
    p.add_argument("job", choices=["check", "calibrate", "report"])
    p.add_argument("--spec", required=True)
    p.add_argument("--calibration")
    p.add_argument("--out")
    args = p.parse_args(argv)
    try:
        if args.job == "check":
            check(args.spec)
        elif args.job == "calibrate":
            from .calibrate import main as calibrate
            calibrate(["--spec", args.spec, "--out", args.out])
        else:
            from .report import main as report
            report(args.spec, args.calibration)
    except (ValueError, ModelScriptError) as e:
        sys.stderr.write("stellarun plan: %s\n" % e)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
