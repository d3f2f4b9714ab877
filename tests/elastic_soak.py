"""Randomized revocations (issue 19's soak), in one command:

    .venv/bin/python tests/elastic_soak.py --trials 20

Each trial picks at random: elastic or not, 2 or 4 ranks, with or without ``--wan 100mbit`` (where
network namespaces can be made), which rank to SIGKILL or SIGSTOP and when (after step 5..25 of
tests/scripts/elastic_train.py; sparse exchange, commits every 5 steps; a stopped rank is found
by the others' deadline, STELLA_TIMEOUT 10 s here). Elastic
(``stellarun --elastic``, hosts ``localhost`` and ``127.0.0.1``): the victim's host is removed from
discovery with the kill; the job must go on with the survivors within 30 s and finish with
identical parameters. Not elastic (``stellarun --clusters 2``): the job must end within 30 s
naming the rank. Every trial: no hang (each job has a deadline), and afterwards no training
process, no ``/tmp/stella-elastic-*`` directory, no stellarun status directory and no namespace
or link of the emulated WAN left.
Prints one line per trial and a summary; exits 1 if any trial failed.
"""
import argparse
import glob
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time

import elastic_harness as eh

sys.path.insert(0, eh.ROOT)
from stellarun import wan  # noqa: E402

LEFTOVER_GLOBS = ("/tmp/stella-elastic-*", "/tmp/stellarun-status-*")


def trial(rng, tmp, can_wan):
    elastic = rng.random() < 0.5
    opts = ["--wan", "100mbit"] if can_wan and rng.random() < 0.5 else []
    np_ = rng.choice([2, 4])
    half = np_ // 2
    kill_after = rng.randint(5, 25)
    fault = rng.choice([signal.SIGKILL, signal.SIGSTOP])
    opts += ["--timeout", "10"]
    steps = kill_after + 40
    train = ["--commit-every", "5", "--step-sleep", "0.03"]
    if elastic:
        listing, script = eh.discovery(tmp, [("localhost", half), ("127.0.0.1", half)])
        proc, log, out, f = eh.launch(tmp, script, np_, steps, extra=opts, train_args=train)
    else:
        log, out = os.path.join(tmp, "job.log"), os.path.join(tmp, "result.json")
        f = open(log, "w")
        proc = subprocess.Popen(eh.STELLARUN + ["-np", str(np_), "--clusters", "2"] + opts + [sys.executable,
                                                eh.SCRIPT, "--steps", str(steps), "--out", out] + train,
                                stdout=f, stderr=subprocess.STDOUT, cwd=eh.ROOT, start_new_session=True)
    what = "%s%s np=%d %s after step %d" % ("elastic" if elastic else "plain", " wan" if "--wan" in opts else "", np_,
                                            fault.name, kill_after)
    try:
        if not eh.wait(lambda: any(s >= kill_after for s, _, _ in eh.progress(log)), 120):
            return what, "never reached step %d" % kill_after, eh.read(log)
        victims = eh.workers()
        if elastic:
            host = rng.choice(["localhost", "127.0.0.1"])
            keep = "127.0.0.1" if host == "localhost" else "localhost"
            eh.write_hosts(listing, [(keep, half)])
            victims = [rng.choice(eh.workers(host))]
        else:
            victims = [rng.choice(victims)]
        t_kill = time.time()
        os.kill(victims[0], fault)
        if elastic:
            if not eh.wait(lambda: [t for s, n, t in eh.progress(log) if n == half and t > t_kill], 30):
                return what, "the survivors did not go on within 30 s", eh.read(log)
            rc = eh.finish(proc, f, timeout=120)
            if rc != 0:
                return what, "the elastic job ended with %s" % rc, eh.read(log)
            with open(out) as fh:
                result = json.load(fh)
            if not (result["identical"] and result["steps"] == steps and result["size"] == half):
                return what, "bad result %r" % result, eh.read(log)
        else:
            rc = eh.finish(proc, f, timeout=30)
            if rc in (None, 0):
                return what, "the job did not end within 30 s (exit %s)" % rc, eh.read(log)
            if not re.search(r"rank \d \(host .*\) failed first", eh.read(log)):
                return what, "no rank named", eh.read(log)
        return what, None, ""
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if not f.closed:
            f.close()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--seed", type=int, default=None)
    args = p.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    before = {g: set(glob.glob(g)) for g in LEFTOVER_GLOBS}
    can_wan, why = wan.namespaces_available()
    if not can_wan:
        print("no --wan trials: network namespaces unavailable here (%s)" % why, flush=True)
    links_before = set(wan.leftovers()) if can_wan else set()
    failures = 0
    for i in range(args.trials):
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.time()
            what, error, log = trial(rng, tmp, can_wan)
        time.sleep(0.5)
        left = eh.workers()
        stray = [x for g in LEFTOVER_GLOBS for x in set(glob.glob(g)) - before[g]]
        stray += sorted(set(wan.leftovers()) - links_before) if can_wan else []
        if left or stray:
            error = (error or "") + " left behind: processes %s, files %s" % (left, stray)
        failures += bool(error)
        print("trial %2d  %-42s %s (%.1f s)" % (i + 1, what, "FAILED: " + error if error else "ok", time.time() - t0),
              flush=True)
        if error:
            print(log[-2500:], flush=True)
    print("seed %d: %d/%d trials ok" % (seed, args.trials - failures, args.trials))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
