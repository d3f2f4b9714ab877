"""The chaos soak (issue 35; not part of the default tests, which run a fixed sample of it):

    .venv/bin/python tests/chaos_soak.py --trials 200 --seed 1     # about an hour on 2 cores

Each trial draws one value from each axis and runs tests/scripts/elastic_train.py with 4 ranks
in 2 clusters:

* route: dense, sparse, THC, the CPU engine, local steps (THC pseudo-gradients), local steps
  with overlap, the switching optimizer (sync <-> local), the automatic route;
* fault: SIGKILL, SIGTERM or SIGSTOP of a random rank at a random moment (start-up and shutdown
  included); a cut of the emulated link shorter than STELLA_TIMEOUT, or longer; an all-NaN
  gradient on one rank at a random step; garbage from one rank (sparse indices out of range, THC
  scales that are NaN) from a random step on; a host revoked (its worker killed and the host
  removed from discovery) under ``--elastic``;
* launcher: plain mpirun, stellarun, ``stellarun --elastic`` (hosts localhost and 127.0.0.1).

A draw that cannot apply is drawn again (link cuts need stellarun's namespaces, a revocation
needs --elastic, garbage needs a route with a payload to corrupt). Each trial records: whether
the job hung (every process must be gone within STELLA_TIMEOUT + 60 s of the fault), every
rank's end state (the job's exit code; on success, whether every rank holds the same finite
parameters after the requested steps; on failure, whether the output names the failed rank),
what was left behind (processes, namespaces, MPICH files, elastic directories), and under
--elastic the steps lost (at most one commit interval). Survivable: a NaN gradient and a short
cut everywhere; every fault under --elastic. A survivable fault not survived, a failure not
named, a hang, a leftover or a silent wrong result (success with parameters that differ) fails
the soak; each trial prints its replay command. Writes bench/results/chaos_soak.json.
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

ROOT = eh.ROOT
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
from mpi_launch import mpirun_path, tagged_processes  # noqa: E402
from stellarun import leftovers, status, wan  # noqa: E402

ROUTES = ("dense", "sparse", "thc", "cpu", "local", "local-overlap", "fragments", "switch", "auto")
FAULTS = ("kill", "term", "stop", "cut-short", "cut-long", "nan", "garbage", "revoke")
LAUNCHERS = ("mpirun", "stellarun", "elastic")
SIGNALS = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "stop": signal.SIGSTOP}
GARBAGE_ROUTES = ("sparse", "thc", "cpu", "local", "fragments", "switch", "auto")   # a payload a peer can corrupt
TIMEOUT = 10          # STELLA_TIMEOUT of every job
STEPS, COMMIT = 40, 5
SHORT_CUT_S, LONG_CUT_S = 3, 3 * TIMEOUT
DIR_GLOBS = ("/tmp/stella-elastic-*", "/tmp/stellarun-status-*")


def draw(rng, can_wan):
    """(route, fault, launcher), drawn again until the fault can apply."""
    while True:
        route, fault, launcher = rng.choice(ROUTES), rng.choice(FAULTS), rng.choice(LAUNCHERS)
        if fault.startswith("cut") and (launcher == "mpirun" or not can_wan):
            continue
        if fault == "revoke" and launcher != "elastic":
            continue
        if fault == "garbage" and route not in GARBAGE_ROUTES:
            continue
        return route, fault, launcher


def survivable(fault, launcher):
    return launcher == "elastic" or fault in ("nan", "cut-short")


def hydras_to_name(fault, launcher, handled=True):
    """Plain mpirun and a rank that dies of a signal it cannot handle (SIGKILL; SIGTERM before
    any handler exists, i.e. before ``import stella_mpi``: the soak's script imports torch first,
    as most scripts do): hydra SIGKILLs every other rank at once, so no rank can say which one
    died, and hydra's "BAD TERMINATION ... PID" names the first process it lists (rank 0's), not
    the one that died (checked with a job of plain sleeps). The trial then only needs the job
    to end with hydra's report; ``named`` still says whether the failed rank was named
    (stellarun names it: its supervisor sees the signal)."""
    return launcher == "mpirun" and (fault == "kill" or (fault in SIGNALS and not handled))


def _handles(pid, signum):
    """Whether process ``pid`` has a handler for ``signum`` now (/proc's SigCgt mask)."""
    try:
        with open("/proc/%d/status" % pid) as f:
            mask = next(line.split()[1] for line in f if line.startswith("SigCgt:"))
        return bool(int(mask, 16) >> (int(signum) - 1) & 1)
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def _command(launcher, route, fault, rng, tmp, token, out):
    train = ["--steps", str(STEPS), "--commit-every", str(COMMIT), "--step-sleep", "0.05", "--width", "128",
             "--route", route, "--check", "--out", out]
    plan = {}
    if fault in ("nan", "garbage"):
        plan["rank"], plan["step"] = rng.randrange(4), rng.randint(1, STEPS - 3)
        train += ["--%s-at" % fault, "%d:%d" % (plan["rank"], plan["step"])]
    wan_opts = []
    if launcher != "mpirun" and (fault.startswith("cut") or rng.random() < 0.3) and wan.namespaces_available()[0]:
        wan_opts = ["--wan", "100mbit"]
        if fault.startswith("cut"):
            plan["cut_at"] = round(rng.uniform(1.0, 5.0), 1)
            plan["cut_s"] = SHORT_CUT_S if fault == "cut-short" else LONG_CUT_S
            wan_opts += ["--wan-schedule", "%g:down,%g:100mbit" % (plan["cut_at"], plan["cut_at"] + plan["cut_s"])]
    script = [sys.executable, eh.SCRIPT] + train
    if launcher == "mpirun":
        cmd = [mpirun_path(), "-np", "4", "-env", "STELLA_CLUSTERS", "2"] + script
    elif launcher == "stellarun":
        cmd = eh.STELLARUN + ["-np", "4", "--clusters", "2", "--timeout", str(TIMEOUT)] + wan_opts + script
    else:
        plan["listing"], discover = eh.discovery(tmp, [("localhost", 2), ("127.0.0.1", 2)])
        cmd = eh.STELLARUN + ["--elastic", "-np", "4", "--min-np", "2", "--host-discovery-script", discover,
                              "--cluster-of", "localhost=a", "--cluster-of", "127.0.0.1=b",
                              "--timeout", str(TIMEOUT)] + wan_opts + script
    plan["wan"] = bool(wan_opts)
    return cmd, plan


def _ranks(token):
    """{pid: (rank, host)} of the training processes of one trial (not their launchers)."""
    out = {}
    for pid, (cmd, env) in tagged_processes("STELLA_SOAK_TOKEN", token).items():
        if len(cmd) > 1 and cmd[1].endswith(b"elastic_train.py") and b"PMI_RANK" in env:
            out[pid] = (int(env[b"PMI_RANK"]), env.get(b"HOROVOD_HOSTNAME", b"").decode())
    # a rank's forked watchdogs carry its command line too: only the topmost is the rank
    return {pid: v for pid, v in out.items() if _parent(pid) not in out}


def _parent(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def _named(out, fault, target, plan, pid=None):
    """Whether the output names the failed rank as the one that failed (a bystander's mention
    does not count; hydra's "BAD TERMINATION" with the pid that died counts), or for a long cut
    a rank the deadline waited for."""
    if fault in SIGNALS:
        return bool(re.search(r"rank %d (\([^)]*\) )?(never came|received SIG|was stopped|is stopped|failed first)"
                              r"|stella_mpi: rank %d: uncaught" % (target, target), out)
                    or (pid is not None and re.search(r"PID %d RUNNING AT" % pid, out)))
    if fault == "garbage":
        return bool(re.search(r"rank %d sent a malformed|ranks \[[0-9, ]*\b%d\b[0-9, ]*\] agreed on"
                              % (plan["rank"], plan["rank"]), out))
    if fault == "cut-long":
        return bool(re.search(r"rank \d+ \([^)]*\)( never came| never submitted)|never submitted it|"
                              r"did not complete within", out))
    return False


def trial(index, seed, case=None, can_wan=True):
    rng = random.Random(seed * 100003 + index)
    route, fault, launcher = case or draw(rng, can_wan)
    token = "chaos%d_%d" % (os.getpid(), index)
    tmp = tempfile.mkdtemp(prefix="chaos-")
    out = os.path.join(tmp, "result.json")
    cmd, plan = _command(launcher, route, fault, rng, tmp, token, out)
    env = dict(os.environ, STELLA_TIMEOUT=str(TIMEOUT), PYTHONUNBUFFERED="1", STELLA_SOAK_TOKEN=token,
               OMP_NUM_THREADS="1")
    env.pop("STELLA_CLUSTERS", None)
    files_before = set(leftovers.candidates())
    dirs_before = {d for g in DIR_GLOBS for d in glob.glob(g)}
    since = time.time() - 1
    log_path = os.path.join(tmp, "job.log")
    log = open(log_path, "w")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    fault_at, target, before, fault_unix, victim, handled = None, None, None, None, None, None
    if fault in SIGNALS or fault == "revoke":
        at = rng.uniform(0.3, 9.0) if fault in SIGNALS else None
        step = rng.randint(COMMIT + 1, STEPS - 5) if fault == "revoke" else None
        while proc.poll() is None and time.monotonic() - t0 < 120:
            if (at is not None and time.monotonic() - t0 >= at) or \
                    (step is not None and any(s >= step for s, _, _ in eh.progress(log_path))):
                break
            time.sleep(0.05)
        ranks = _ranks(token)
        if proc.poll() is None and ranks:
            if fault == "revoke":
                host = rng.choice(["localhost", "127.0.0.1"])
                eh.write_hosts(plan["listing"], [("127.0.0.1" if host == "localhost" else "localhost", 2)])
                pid = rng.choice(sorted(p for p, (_, h) in ranks.items() if h == host) or sorted(ranks))
            else:
                pid = rng.choice(sorted(ranks))
            target, victim = ranks[pid][0], pid
            if fault in SIGNALS:
                handled = _handles(pid, SIGNALS[fault])
            before = max([s for s, _, _ in eh.progress(log_path)] or [0])
            try:
                os.kill(pid, signal.SIGKILL if fault == "revoke" else SIGNALS[fault])
                fault_at, fault_unix = time.monotonic(), time.time()
            except ProcessLookupError:
                pass
    elif fault.startswith("cut"):
        fault_at = t0 + plan["cut_at"]   # (the schedule counts from the WAN's set-up, just before the job)
    else:
        fault_at, target = t0, plan["rank"]
    limit = 240 if launcher == "elastic" else (TIMEOUT + 90 + (plan.get("cut_s", 0)))
    hung = False
    try:
        rc = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        hung, rc = True, None
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    log.close()
    deadline = time.monotonic() + 15
    while tagged_processes("STELLA_SOAK_TOKEN", token) and time.monotonic() < deadline:
        time.sleep(0.1)
    gone_at = time.monotonic()
    procs_left = sorted(tagged_processes("STELLA_SOAK_TOKEN", token))
    for p in procs_left:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    hung = hung or bool(procs_left)
    text = eh.read(log_path)
    cleaned = []
    if launcher == "mpirun":   # what the test suite's launcher does after plain mpirun (tests/mpi_launch.py)
        cleaned = leftovers.remove_after_job(set(leftovers.candidates(since=since)), since=since)
    time.sleep(0.3)
    files_left = sorted(set(leftovers.candidates()) - files_before - leftovers.in_use())
    ns_left = wan.leftovers(proc.pid) if launcher != "mpirun" else []
    # (the soak runs alone: what appeared meanwhile is this trial's; a status directory whose
    # launcher still runs is being removed by it)
    dirs_left = sorted(d for d in {d for g in DIR_GLOBS for d in glob.glob(g)} - dirs_before
                       if not (os.path.basename(d).startswith(status.DIR_PREFIX) and status.launcher_alive(d)))
    result = None
    try:
        with open(out) as f:
            result = json.load(f)
    except (OSError, ValueError):
        pass
    ok_end = rc == 0 and result is not None and result["identical"] and result["finite"] and \
        result["steps"] == STEPS and "WRONG RESULT" not in text
    wrong = "WRONG RESULT" in text or (rc == 0 and (result is None or not result["identical"] or
                                                    not result["finite"]))
    lost = None
    if launcher == "elastic" and before is not None and fault_unix is not None:
        # the first step printed after the fault follows the commit the job went back to
        after = [s for s, _, t in eh.progress(log_path) if t > fault_unix]
        lost = max(0, before - (min(after) - 1)) if after else None
    applied = fault_at is not None and (not fault.startswith("cut") or "WAN link down" in text)
    named = _named(text, fault, target, plan, victim) if not ok_end else None
    if not applied:
        verdict_ok = not hung and (ok_end or rc is not None)
    elif survivable(fault, launcher):
        verdict_ok = ok_end and (lost is None or lost <= COMMIT)
    elif hydras_to_name(fault, launcher, handled is not False):
        verdict_ok = not ok_end and rc not in (0, None) and "BAD TERMINATION" in text
    else:
        verdict_ok = not ok_end and rc not in (0, None) and named
    why = [what for what, bad in (("the fault's outcome", not verdict_ok), ("hung", hung), ("wrong result", wrong),
                                  ("files left", files_left), ("namespaces left", ns_left),
                                  ("directories left", dirs_left)) if bad]
    verdict_ok = not why
    since_fault = None if fault_at is None else round(gone_at - fault_at, 1)
    row = {"trial": index, "seed": seed, "route": route, "fault": fault, "launcher": launcher, "wan": plan["wan"],
           "target": target, "pid": victim, "handled": handled, "plan": {k: v for k, v in plan.items() if k != "listing"}, "applied": applied,
           "exit": rc, "hung": hung, "survived": ok_end, "named": named, "wrong": wrong, "steps_lost": lost,
           "seconds_to_end": since_fault, "procs_left": procs_left, "files_left": files_left,
           "namespaces_left": ns_left, "dirs_left": dirs_left, "mpich_files_cleaned": len(cleaned),
           "ok": bool(verdict_ok), "why": why, "replay": "tests/chaos_soak.py --seed %d --first %d --trials 1" % (seed, index),
           "tail": "" if verdict_ok else text[-1500:]}
    if verdict_ok:
        for name in os.listdir(tmp):
            os.unlink(os.path.join(tmp, name))
        os.rmdir(tmp)
    return row


def table(rows):
    keys = sorted({(r["route"], r["fault"], r["launcher"]) for r in rows})
    lines = ["%-13s %-9s %-9s %6s %7s %5s %8s %6s %5s %5s %9s" % (
        "route", "fault", "launcher", "trials", "applied", "hangs", "survived", "named", "wrong", "left", "slowest_s")]
    for k in keys:
        sel = [r for r in rows if (r["route"], r["fault"], r["launcher"]) == k]
        app = [r for r in sel if r["applied"]]
        surv = survivable(k[1], k[2])
        lines.append("%-13s %-9s %-9s %6d %7d %5d %8s %6s %5d %5d %9s" % (
            k[0], k[1], k[2], len(sel), len(app), sum(r["hung"] for r in sel),
            "%d/%d" % (sum(r["survived"] for r in app), len(app)) if surv else "-",
            "-" if surv else "%d/%d%s" % (sum(bool(r["named"]) for r in app), len(app),
                                           "*" if any(hydras_to_name(k[1], k[2], r.get("handled") is not False)
                                                      for r in app) else ""),
            sum(r["wrong"] for r in sel),
            sum(len(r["files_left"]) + len(r["namespaces_left"]) + len(r["dirs_left"]) + len(r["procs_left"])
                for r in sel),
            max([r["seconds_to_end"] for r in app if r["seconds_to_end"] is not None] or [0])))
    if any(hydras_to_name(r["fault"], r["launcher"], r.get("handled") is not False) for r in rows):
        lines.append("* plain mpirun, a signal the rank could not handle (SIGKILL, or SIGTERM before import "
                     "stella_mpi): hydra kills the other ranks at once and names rank 0's pid (hydras_to_name); "
                     "stellarun names the rank")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--first", type=int, default=0, help="the index of the first trial (replays one)")
    ap.add_argument("--case", action="append", metavar="ROUTE/FAULT/LAUNCHER",
                    help="run these cases instead of drawing them (repeatable)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "chaos_soak.json"))
    args = ap.parse_args(argv)
    can_wan = wan.namespaces_available()[0]
    cases = [tuple(c.split("/")) for c in args.case or []]
    for c in cases:
        if len(c) != 3 or c[0] not in ROUTES or c[1] not in FAULTS or c[2] not in LAUNCHERS:
            ap.error("--case %s: expected ROUTE/FAULT/LAUNCHER from %s / %s / %s"
                     % ("/".join(c), ",".join(ROUTES), ",".join(FAULTS), ",".join(LAUNCHERS)))
    rows = []
    started = time.time()
    n = len(cases) if cases else args.trials
    for k in range(n):
        i = args.first + k
        row = trial(i, args.seed, cases[k] if cases else None, can_wan)
        rows.append(row)
        print("[%3d/%d %4.0f s] %-13s %-9s %-9s%s rank %s: exit %s%s%s%s -> %s" % (
            k + 1, n, time.time() - started, row["route"], row["fault"], row["launcher"], " wan" if row["wan"] else "",
            row["target"], row["exit"], ", not applied" if not row["applied"] else "",
            ", survived" if row["survived"] else ", named %s" % row["named"],
            ", lost %s steps" % row["steps_lost"] if row["steps_lost"] is not None else "",
            "ok" if row["ok"] else "FAILED: %s (replay: %s)" % (", ".join(row["why"]), row["replay"])), flush=True)
        if not row["ok"]:
            print("    left: %s" % (row["files_left"] + row["namespaces_left"] + row["dirs_left"] + row["procs_left"]))
            print("    " + row["tail"].replace("\n", "\n    ")[-1500:], flush=True)
    print()
    print(table(rows))
    try:
        from provenance import provenance
        prov = provenance()
    except Exception as e:  # noqa: BLE001 - the soak's verdict does not depend on it
        prov = {"error": str(e)}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(["tests/chaos_soak.py"] + (argv if argv is not None else sys.argv[1:])),
                   "provenance": prov, "timeout_s": TIMEOUT, "steps": STEPS, "commit_every": COMMIT,
                   "trials": rows}, f, indent=1)
    failed = [r for r in rows if not r["ok"]]
    print("\n%d trials, %d applied, %d failed%s" % (len(rows), sum(r["applied"] for r in rows), len(failed),
                                                   "".join("\n  " + r["replay"] for r in failed)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
