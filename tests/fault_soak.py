"""The long randomized fault run (not part of the default tests):

    .venv/bin/python tests/fault_soak.py --trials 25            # about 10 minutes on 2 cores

Each trial starts a 4-rank job in 2 clusters (tests/scripts/soak_train.py: dense, sparse or CPU
engine, chosen at random) under plain mpirun or stellarun (with --wan 100mbit where network
namespaces can be made), and at a random moment (start-up, training or shutdown included) sends
SIGKILL, SIGTERM or SIGSTOP to a random rank. It measures: whether the job hung (every process
must be gone within STELLA_TIMEOUT + 10 s of the fault), the seconds from the fault to the last
process gone, whether the output names the failed rank (its rank number in a stella_mpi message,
stellarun's report, or its pid in hydra's), whether any rank printed a wrong collective result,
and MPICH files or stellarun namespaces left behind. Prints a table, writes JSON to
bench/results/fault_soak.json, and exits non-zero on a hang, a wrong result or a leftover.
"""
import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
from mpi_launch import tagged_processes  # noqa: E402
from stellarun import leftovers, wan  # noqa: E402

BIN = os.path.dirname(sys.executable)
TIMEOUT = 10
SIGNALS = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "stop": signal.SIGSTOP}


def job_processes(token):
    """{pid: (PMI rank or None, is the rank's python itself)} of the processes of one trial."""
    out = {}
    for pid, (cmd, env) in tagged_processes("STELLA_SOAK_TOKEN", token).items():
        rank = int(env[b"PMI_RANK"]) if b"PMI_RANK" in env else None
        is_rank = any(c.endswith(b"soak_train.py") for c in cmd) and b"stellarun.rank" not in cmd
        out[pid] = (rank, is_rank)
    # a rank's forked watchdogs carry its command line too: only the topmost is the rank
    for pid, (rank, is_rank) in list(out.items()):
        if is_rank and out.get(_parent(pid), (None, False))[1]:
            out[pid] = (rank, False)
    return out


def _parent(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def trial(i, rng, launcher, fault, path, steps, use_wan):
    token = "soak%d_%d" % (os.getpid(), i)
    env = dict(os.environ, STELLA_TIMEOUT=str(TIMEOUT), PYTHONUNBUFFERED="1", STELLA_SOAK_TOKEN=token,
               OMP_NUM_THREADS="1")
    job = [sys.executable, "tests/scripts/soak_train.py", path, str(steps)]
    if launcher == "stellarun":
        cmd = [os.path.join(BIN, "stellarun"), "-np", "4", "--clusters", "2"] + \
              (["--wan", "100mbit"] if use_wan else []) + job
    else:
        cmd = [os.path.join(BIN, "mpirun"), "-np", "4", "-env", "STELLA_CLUSTERS", "2"] + job
    target = rng.randrange(4)
    at = rng.uniform(0.2, 8.0)   # start-up is the first ~2 s; a job ending before shows as such
    files_before = set(leftovers.candidates())
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    fault_at, pid = None, None
    while proc.poll() is None and time.monotonic() - t0 < at:
        time.sleep(0.05)
    if proc.poll() is None:
        ranks = {p: r for p, (r, is_rank) in job_processes(token).items() if is_rank and r == target}
        if ranks:
            pid = next(iter(ranks))
            try:
                os.kill(pid, SIGNALS[fault])
                fault_at = time.monotonic()
            except ProcessLookupError:
                pid = None
    hung = False
    try:
        out, _ = proc.communicate(timeout=(TIMEOUT + 60))
    except subprocess.TimeoutExpired:
        hung = True
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    # every process of the trial gone?
    deadline = time.monotonic() + 15
    while job_processes(token) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = job_processes(token)
    gone_at = time.monotonic()
    for p in left:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if left:
        hung = True
    time.sleep(0.5)
    files_left = sorted(set(leftovers.candidates()) - files_before - leftovers.in_use())
    ns_left = wan.leftovers(proc.pid) if launcher == "stellarun" else []
    since_fault = None if fault_at is None else gone_at - fault_at
    if fault_at is not None and since_fault > TIMEOUT + 10:
        hung = True
    # named: a message says this rank (with its host and pid, or as the rank reporting itself) is
    # the one that failed; a bystander's mention of it does not count
    me = r"rank %d (\(host [^,]+, pid %d\) )?" % (target, pid or -1)
    named = fault_at is not None and bool(re.search(
        me + r"(never came|received SIG|was stopped|is stopped|failed first)|stella_mpi: rank %d: uncaught" % target, out))
    wrong = "WRONG RESULT" in out
    return {"trial": i, "launcher": launcher, "wan": use_wan, "path": path, "fault": fault, "rank": target,
            "at_s": round(at, 2), "applied": fault_at is not None, "exit": proc.returncode, "hung": hung,
            "seconds_to_gone": None if since_fault is None else round(since_fault, 2), "named": named,
            "wrong_result": wrong, "files_left": files_left, "namespaces_left": ns_left,
            "tail": out[-600:] if (hung or wrong or (fault_at is not None and not named)) else ""}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=25)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "fault_soak.json"))
    args = ap.parse_args()
    rng = random.Random(args.seed)
    can_wan = wan.namespaces_available()[0]
    rows = []
    for i in range(args.trials):
        launcher = rng.choice(["mpirun", "stellarun"])
        row = trial(i, rng, launcher, rng.choice(sorted(SIGNALS)), rng.choice(["dense", "sparse", "cpu"]), args.steps,
                    use_wan=launcher == "stellarun" and can_wan and rng.random() < 0.5)
        rows.append(row)
        print("%2d %-9s %-4s %-6s %-4s rank %d at %4.1f s: %s exit %s, %s, named %s, wrong %s, files %d, ns %d"
              % (i, row["launcher"], "wan" if row["wan"] else "", row["path"], row["fault"], row["rank"], row["at_s"],
                 "applied" if row["applied"] else "job ended first", row["exit"],
                 "HUNG" if row["hung"] else "gone %.1f s after" % (row["seconds_to_gone"] or 0), row["named"],
                 row["wrong_result"], len(row["files_left"]), len(row["namespaces_left"])), flush=True)
        if row["tail"]:
            print("    ..." + row["tail"].replace("\n", "\n    "), flush=True)
    print()
    print("%-10s %-5s %6s %6s %6s %8s %6s %6s %6s" % ("launcher", "fault", "trials", "hangs", "named", "max_s", "wrong",
                                                    "files", "ns"))
    for launcher in ("mpirun", "stellarun"):
        for fault in sorted(SIGNALS):
            sel = [r for r in rows if r["launcher"] == launcher and r["fault"] == fault and r["applied"]]
            if not sel:
                continue
            print("%-10s %-5s %6d %6d %6d %8.1f %6d %6d %6d" % (
                launcher, fault, len(sel), sum(r["hung"] for r in sel), sum(r["named"] for r in sel),
                max(r["seconds_to_gone"] or 0 for r in sel), sum(r["wrong_result"] for r in sel),
                sum(len(r["files_left"]) for r in sel), sum(len(r["namespaces_left"]) for r in sel)))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(sys.argv), "timeout_s": TIMEOUT, "trials": rows}, f, indent=1)
    bad = [r for r in rows if r["hung"] or r["wrong_result"] or r["namespaces_left"]
           or (r["launcher"] == "stellarun" and r["files_left"])]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
