"""Downtime per revocation and the cost of commit() in an elastic job, in one command:

    .venv/bin/python bench/bench_elastic.py                      # 2 and 4 ranks, 2 clusters, 3 trials each
    .venv/bin/python bench/bench_elastic.py --np 4 --trials 5 --width 4096
    .venv/bin/python bench/bench_elastic.py --outage --timeout 10    # a link cut instead of a kill

Each trial starts ``stellarun --elastic`` on two pretend hosts of this machine (``localhost`` and
``127.0.0.1``, one cluster each) running tests/scripts/elastic_train.py (sparse exchange, a commit
every 5 steps), waits for step 15, then revokes ``127.0.0.1``: removes it from the discovery
output and SIGKILLs its workers. From the launcher's and rank 0's time-stamped lines it splits the
downtime (the kill to the first completed step after recovery) into

    detection    the kill -> the launcher sees the incarnation end (MPI tears the job down)
    relaunch     the launcher discovers the hosts and starts the next mpirun
    startup      mpirun -> the ranks are in hvd.elastic.run (processes, imports, MPI_Init,
                 hvd.init(), the script's own set-up)
    transfer     finding the newest commit and syncing it to every rank
    first step   the first training step after that

and reports the median of commit() (state_dict copies, the node-local file, the host check).
With ``--outage`` the job runs under ``--wan 100mbit`` and, instead of a kill, the emulated link
goes down 12 s after the start for longer than the timeout: the downtime then counts from the
cut, detection includes the timeout (``--timeout``) and the deadline's diagnosis, and cluster
``b`` is the one cut off. Writes bench/results/elastic.json (elastic_outage.json).
"""
import argparse
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
import elastic_harness as eh  # noqa: E402
from provenance import provenance  # noqa: E402


OUTAGE_AT_S = 12   # --outage: the link goes down this long after the emulation starts


def after(pattern, text, t_min):
    """The first (float groups) of ``pattern`` whose last group (a unix time) is >= t_min."""
    for m in re.finditer(pattern, text):
        vals = [float(g) for g in m.groups()]
        if vals[-1] >= t_min:
            return vals
    return None


def trial(np_, args):
    half = np_ // 2
    with tempfile.TemporaryDirectory() as tmp:
        listing, script = eh.discovery(tmp, [("localhost", half), ("127.0.0.1", half)])
        link = ["--wan", "100mbit", "--wan-schedule", "%d:down,%d:100mbit" % (OUTAGE_AT_S, OUTAGE_AT_S + 4 * args.timeout),
                "--timeout", str(args.timeout)] if args.outage else []
        proc, log, _, f = eh.launch(tmp, script, np_, 100000, extra=link, train_args=[
            "--commit-every", "5", "--step-sleep", str(args.step_sleep), "--width", str(args.width)])
        try:
            if args.outage:
                cut = eh.wait(lambda: re.search(r"WAN link down \(t=\d+ s, unix time ([0-9.]+)\)", eh.read(log)), 120)
                if not cut or not any(n == np_ for _, n, _ in eh.progress(log)):
                    return {"error": eh.read(log)[-3000:]}
                t_kill = float(cut.group(1))
            else:
                if not eh.wait(lambda: any(s >= 15 for s, _, _ in eh.progress(log)), 120):
                    return {"error": eh.read(log)[-3000:]}
                eh.write_hosts(listing, [("localhost", half)])
                victims = eh.workers("127.0.0.1")
                t_kill = time.time()
                for pid in victims:
                    os.kill(pid, signal.SIGKILL)
            first = eh.wait(lambda: [t for s, n, t in eh.progress(log) if n == half and t > t_kill], 120)
            if not first:
                return {"error": eh.read(log)[-3000:]}
            time.sleep(0.5)
            text = eh.read(log)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            eh.finish(proc, f, timeout=30)
    ended = after(r"incarnation \d+ ended with exit -?\d+ \(unix ([0-9.]+)\)", text, t_kill)[0]
    started = after(r"incarnation \d+: \d+ rank\(s\) on .* \(unix ([0-9.]+)\)", text, ended)[0]
    find_s, sync_s, worker = after(r"find ([0-9.]+) s, sync ([0-9.]+) s; started unix ([0-9.]+)", text, started)
    commits = [float(x) for x in re.findall(r"commit step=\d+ seconds=([0-9.]+)", text)]
    ready = worker + find_s + sync_s
    return {"downtime_s": first[0] - t_kill, "detection_s": ended - t_kill, "relaunch_s": started - ended,
            "startup_s": worker - started, "transfer_s": find_s + sync_s, "first_step_s": first[0] - ready,
            "commit_s": statistics.median(commits) if commits else None}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, nargs="+", default=[2, 4])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--width", type=int, default=2048, help="hidden width of the script's model")
    p.add_argument("--step-sleep", type=float, default=0.02)
    p.add_argument("--outage", action="store_true", help="cut the emulated link instead of killing a host's ranks")
    p.add_argument("--timeout", type=float, default=10.0, help="--outage: STELLA_TIMEOUT of the job (s)")
    p.add_argument("--out")
    args = p.parse_args()
    if args.out is None:
        args.out = os.path.join(HERE, "results", "elastic_outage.json" if args.outage else "elastic.json")
    rows = {}
    keys = ("downtime_s", "detection_s", "relaunch_s", "startup_s", "transfer_s", "first_step_s", "commit_s")
    for np_ in args.np:
        runs = [trial(np_, args) for _ in range(args.trials)]
        good = [r for r in runs if "error" not in r]
        rows[np_] = {"trials": runs, "median": {k: statistics.median(r[k] for r in good) for k in keys} if good else None}
        print("np %d (2 clusters, %s): %d/%d trials recovered" % (
            np_, "link cut for %.0f s" % (4 * args.timeout) if args.outage else "a host revoked", len(good), len(runs)))
        if good:
            print("  " + "  ".join("%s %.3f" % (k[:-2], rows[np_]["median"][k]) for k in keys))
        for r in runs:
            if "error" in r:
                print("  failed trial:\n" + r["error"][-1500:])
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "settings": vars(args),
                   "provenance": provenance(), "results": rows}, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
