"""``stellarun``: launch a stella_mpi job with the environment's ``mpirun``, assigning clusters.

    stellarun -np 4 --clusters 2 python train.py      # one host, 2 clusters of 2 ranks
    stellarun -np 8 -f hosts python train.py            # several hosts: one cluster per host
    stellarun -np 8 -f hosts --cluster-of nodeA=lab --cluster-of nodeB=lab python train.py
    stellarun -np 4 --clusters 2 --wan 100mbit python train.py          # emulated WAN, one host
    stellarun -np 4 --clusters 2 --wan 500mbit --wan-schedule "60:100mbit,120:500mbit" python train.py
    stellarun -np 4 --clusters 2 --wan 100mbit --wan-delay 30ms python train.py   # and 30 ms one way
    stellarun -np 4 --clusters 2 --wan 100mbit --wan-schedule "30:down,40:100mbit" python train.py  # 10 s outage

With --wan, each cluster's ranks run in their own network namespace and cross-cluster
traffic crosses veth links shaped with tc (root needed). Each cluster is started as its own
MPI "host" (hydra's fork launcher with one host name per cluster), so MPICH keeps traffic
inside a cluster on shared memory, as on a real node, and sends cross-cluster traffic over
TCP (ofi/tcp) through the namespace's interface; gloo binds that interface too. Without
the rights for that, cross-cluster sends are paced in user space at the same rate instead
(stella_mpi's own traffic only). stellarun says which mode it used and removes every
namespace, link and qdisc it made on every exit path. --wan-delay adds a one-way delay on the
cross-cluster path in user space (no netem needed): the namespaces are then joined by TUN
devices and a forwarder thread of stellarun, or, when pacing, each paced exchange is
stretched by the delay.

Everything after the options is the command; mpirun options stellarun does not know can be
given after ``--mpi-args``. stellarun only prepares the environment and runs mpirun: the
transport, rendezvous and process launch stay MPI's.

Each rank runs under a small supervisor (``python -m stellarun.rank``) that records how it ended;
when the job fails, stellarun prints the first rank that failed and why, and exits with one code
per kind of failure: 10 an uncaught exception, 11 a failed collective, 12 a passed deadline (a
rank stalled or never came), 13 a rank killed by a signal, 14 a rank's own non-zero exit, 15
mpirun failed with no rank saying why, 128+N stellarun itself stopped by signal N, 2 a usage
error. If stellarun is killed, its job goes with it. After every job it removes the shared-memory
and topology files MPICH leaves behind (``stellarun --clean`` removes those of any ended job).
"""
import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from . import config_file, elastic, leftovers, progress, shaping, status
from .rank import OUTPUT_DIR_VAR, die_with_parent
from .wan import WanEmulation, namespaces_available, reap_stale


class UsageError(SystemExit):
    """A usage error: stellarun says what is wrong and exits with 2 (as argparse does)."""

    def __init__(self, message):
        super().__init__(2)
        self.message = message

    def __str__(self):
        return self.message


def find_mpirun():
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    if os.path.exists(here):
        return here
    found = shutil.which("mpirun") or shutil.which("mpiexec")
    if not found:
        raise SystemExit("stellarun: no mpirun found; install the MPI wheel (pip install mpich) or a system MPI")
    return found


def _version_text(cmd):
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return "(%s did not answer: %s)" % (cmd[0], e)
    return proc.stdout + proc.stderr


def _first_match(pattern, text):
    import re
    m = re.search(pattern, text)
    return m.group(1).strip() if m else None


def check_mpirun(mpirun):
    """A usage error when ``mpirun`` is not the MPI this environment's mpi4py runs on: its ranks
    would not find a matching process manager (PMI) and fail with hydra's cryptic errors. The
    environment's own mpirun (the mpich wheel's, next to this Python) is the reference; without
    one, mpi4py uses a system MPI and nothing is checked."""
    own = os.path.join(os.path.dirname(sys.executable), "mpirun")
    if not os.path.exists(own) or os.path.realpath(mpirun) == os.path.realpath(own):
        return
    mine = _first_match(r"MPICH Version:\s*(\S+)", _version_text([os.path.join(os.path.dirname(sys.executable),
                                                                              "mpichversion")]))
    theirs_text = _version_text([mpirun, "--version"])
    if "Open MPI" in theirs_text or "OpenRTE" in theirs_text or "PRRTE" in theirs_text:
        what = "Open MPI's launcher"
    else:
        version = _first_match(r"Version:\s*(\S+)", theirs_text)
        if mine is None or (version is not None and version == mine):
            return
        what = "MPICH %s's hydra" % version if version else "a launcher whose version could not be read"
    mine = mine or "(version unread)"
    raise UsageError("stellarun: %s is %s, but this environment's mpi4py runs on MPICH %s (the mpich wheel): its "
                     "ranks would not find a matching process manager (PMI) and fail with hydra errors. Use %s (the "
                     "default: leave out --mpirun), or build mpi4py against that MPI." % (mpirun, what, mine, own))

def cluster_sizes(np_, nclusters):
    """Ranks per cluster, the first ones larger by one: the split ``STELLA_CLUSTERS`` makes in
    the ranks (stella_mpi.comm.buffers.split_counts; this package never imports stella_mpi)."""
    q, r = divmod(np_, nclusters)
    return [q + (1 if i < r else 0) for i in range(nclusters)]


# Told to the job's own scripts (the benchmarks read them) or to the rank supervisor
# (stellarun/rank.py); stella_mpi's runtime reads none of them. Every other STELLA_* variable
# stellarun sets is a setting of stella_mpi.base.config.
JOB_INFO_ENV = ("STELLA_WAN_RATE_BPS", "STELLA_WAN_MODE", "STELLA_WAN_MASTER_ADDR", "STELLA_WAN_ADDR", OUTPUT_DIR_VAR)


def settings_env(args):
    """The variables the job's ranks get from stellarun's (horovodrun's) options."""
    env = {"PYTHONUNBUFFERED": "1"}
    if args.timeout:
        env["STELLA_TIMEOUT"] = str(args.timeout)
    if args.start_timeout:
        env["STELLA_START_TIMEOUT"] = str(args.start_timeout)
    if args.output_filename:
        env[OUTPUT_DIR_VAR] = os.path.abspath(args.output_filename)
    if args.network_interface:
        env["STELLA_GLOO_IFNAME"] = args.network_interface
    if args.wan_route:
        env["STELLA_WAN_ROUTE"] = args.wan_route
    if args.fusion_threshold_mb is not None:
        env["HOROVOD_FUSION_THRESHOLD"] = str(int(float(args.fusion_threshold_mb) * 1024 * 1024))
    if args.cycle_time_ms is not None:
        env["HOROVOD_CYCLE_TIME"] = str(float(args.cycle_time_ms))
    if args.cache_capacity is not None:
        env["HOROVOD_CACHE_CAPACITY"] = str(int(args.cache_capacity))
    if args.timeline_filename:
        env["HOROVOD_TIMELINE"] = os.path.abspath(str(args.timeline_filename))
    if args.timeline_mark_cycles:
        env["HOROVOD_TIMELINE_MARK_CYCLES"] = "1"
    if args.stall_check is False:
        env["HOROVOD_STALL_CHECK_DISABLE"] = "1"
    if args.stall_check_warning_time_seconds is not None:
        env["HOROVOD_STALL_CHECK_TIME_SECONDS"] = str(float(args.stall_check_warning_time_seconds))
    if args.stall_check_shutdown_time_seconds is not None:
        env["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] = str(float(args.stall_check_shutdown_time_seconds))
    level = args.log_level or ("info" if args.verbose else None)
    if level:
        env["HOROVOD_LOG_LEVEL"] = str(level).lower()
    return env

WAN_MPI_ENV = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": "wan0",
               "GLOO_SOCKET_IFNAME": "wan0"}


SIGNAL_GRACE_S = 10.0   # after Ctrl-C/SIGTERM, how long ranks get to stop before they are killed


def wan_hosts(sizes):
    """hydra host list naming one pretend host per cluster: with the fork launcher every
    "host" runs here, and MPICH treats each as its own node (shared memory inside it only)."""
    return ",".join("stella-wan%d:%d" % (c, n) for c, n in enumerate(sizes))


def supervised(command):
    """What each rank runs: the rank supervisor (stellarun/rank.py), then the user's command."""
    return [sys.executable, "-m", "stellarun.rank", "--"] + list(command)


def wan_env(args, emu, sizes, master):
    """The environment of every rank of a --wan job: cluster ``master``'s address (rank 0's) in
    namespace mode; each rank's share of its cluster's link (``sizes``: ranks per cluster) when
    pacing instead."""
    env = {"STELLA_WAN_RATE_BPS": str(int(args.wan))}
    if emu is not None:
        env.update(WAN_MPI_ENV)
        env["STELLA_WAN_MODE"] = "namespaces"
        env["STELLA_WAN_MASTER_ADDR"] = emu.address(master)
    else:
        env["STELLA_WAN_MODE"] = "paced"
        # a cluster's ranks share its link: each paces at its share
        env["STELLA_WAN_PACE_BPS"] = str(int(args.wan / max(sizes)))
        if args.wan_delay:
            env["STELLA_WAN_PACE_DELAY_S"] = repr(args.wan_delay)
    return env


def build_wan_command(args, emu, status_dir):
    """MPMD mpirun command: cluster c's ranks start inside namespace c."""
    sizes = cluster_sizes(args.np, args.clusters or 2)
    cmd = [args.mpirun or find_mpirun()]
    env = settings_env(args)
    env.update(wan_env(args, emu, sizes, 0))
    if status_dir:
        env["STELLA_STATUS_DIR"] = status_dir
    for k, v in sorted(env.items()):
        cmd += ["-genv", k, v]
    if emu is not None:
        cmd += ["-launcher", "fork", "-hosts", wan_hosts(sizes)]
    cmd += list(args.mpi_args or [])
    for c, n in enumerate(sizes):
        if c:
            cmd.append(":")
        cmd += ["-n", str(n), "-env", "STELLA_CLUSTER", "wan%d" % c]
        if emu is not None:
            cmd += ["-env", "STELLA_WAN_ADDR", emu.address(c)] + emu.exec_prefix(c)
        cmd += supervised(args.command)
    return cmd


def run_with_wan(args):
    """Set up the emulated WAN, run the job under it, and always tear it down."""
    if not args.np:
        raise UsageError("stellarun: give the number of ranks with -np N")
    clusters = args.clusters or 2
    if clusters < 2 or clusters > args.np:
        raise UsageError("stellarun: --wan needs 2 or more clusters and at most one per rank")
    if not args.command:
        raise UsageError("stellarun: no command to run")
    emu, setup, teardown = wan_emulation(args, clusters)
    return run_job(args, counted(lambda status_dir: build_wan_command(args, emu, status_dir), args.np), setup, teardown)


def wan_emulation(args, clusters):
    """(emulation or None when pacing, setup, teardown) of --wan for ``clusters`` clusters."""
    rate, schedule, delay = args.wan, args.wan_schedule or [], args.wan_delay
    ok, why = namespaces_available()
    emu = None
    if ok:
        emu = WanEmulation(clusters, rate, schedule, delay_s=delay)
    elif schedule:
        raise UsageError("stellarun: --wan-schedule needs network namespaces (%s)" % why)

    def setup():
        if emu is not None:
            progress.say("setting up the emulated WAN (%d clusters, %.0f Mbit/s: network namespaces, tc tbf%s)..."
                         % (clusters, rate / 1e6, ", TUN devices and a %g ms delay forwarder" % (delay * 1e3)
                            if delay else ""))
            stale = reap_stale()
            if stale:
                print("stellarun: removed %s left by launchers that no longer run" % ", ".join(stale), flush=True)
            emu.setup()
            print("stellarun: WAN emulation with network namespaces: %d clusters joined by %.0f Mbit/s links "
                  "(tc tbf)%s" % (clusters, rate / 1e6, ", %g ms one-way delay (TUN devices, user-space forwarder)"
                                  % (delay * 1e3) if delay else ""), flush=True)
        else:
            print("stellarun: WAN emulation by user-space pacing of stella_mpi's cross-cluster sends at %.0f Mbit/s%s "
                  "(network namespaces unavailable: %s)"
                  % (rate / 1e6, " plus %g ms one-way delay per exchange" % (delay * 1e3) if delay else "", why),
                  flush=True)

    def teardown():
        if emu is not None:
            emu.close()
    return emu, setup, teardown


def _in_terminal_foreground():
    """Whether stellarun's process group is its terminal's foreground group: a Ctrl-C there
    reaches mpirun directly too (hydra takes a second SIGINT as "abort by force")."""
    for fd in (0, 1, 2):
        try:
            return os.tcgetpgrp(fd) == os.getpgrp()
        except OSError:
            continue
    return False


def _to_stderr(data):
    try:
        sys.stderr.buffer.write(data)
        sys.stderr.buffer.flush()
    except (OSError, ValueError):
        pass


def _copy_stderr(pipe, markers):
    """mpirun's stderr to ours, without the marker lines of ranks on other hosts."""
    fd = pipe.fileno()
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        markers.feed(chunk)
    pipe.close()


def run_job(args, command_for, setup=None, teardown=None, records_out=None):
    """Run mpirun (``command_for(status_dir)``) supervised: signals forwarded, ranks killed
    SIGNAL_GRACE_S after a signal they ignore, mpirun killed with stellarun, MPICH's leftovers
    removed, the first failed rank reported. Returns stellarun's exit code.

    The report covers every host: the status directory is made here; on other hosts each rank's
    supervisor makes its own, and the records come back as marker lines on mpirun's stderr
    (stellarun/status.py), which are taken out of the output."""
    if args.dry_run:
        print(shlex.join(command_for("")))
        return 0
    if getattr(args, "verbose", False):
        print("stellarun: " + shlex.join(command_for("")), flush=True)
    try:
        status_dir = tempfile.mkdtemp(prefix=status.DIR_PREFIX)
        status.write_owner(status_dir)
    except OSError as e:
        print("stellarun: no status directory (%s): the job runs without a failure report" % e, flush=True)
        status_dir = ""
    cmd = command_for(status_dir)
    started = time.time()
    proc = None
    signalled = []
    seen_files = set()   # MPICH's files the job's processes had open or mapped

    def forward(signum, frame):
        signalled.append((time.monotonic(), time.time(), signum))
        if signum == signal.SIGINT and _in_terminal_foreground():
            return   # the terminal sent it to mpirun as well
        if proc is not None and proc.poll() is None:
            proc.send_signal(signum)
    # handlers first: a Ctrl-C while the emulation is built must not skip its removal; a signal the
    # caller ignores (nohup) stays ignored, and mpirun inherits that
    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
           if signal.getsignal(s) != signal.SIG_IGN}
    rc = None
    stopped = None   # ranks found stopped when the first failure was recorded
    polls = 0
    records, removed = [], []
    markers = status.MarkerFilter(_to_stderr)   # records of ranks on other hosts, from mpirun's stderr
    copier = None
    try:
        try:
            if setup is not None:
                setup()
            if not signalled:
                sys.stdout.flush()
                parent = os.getpid()
                proc = subprocess.Popen(cmd, preexec_fn=lambda: die_with_parent(expect_parent=parent),
                                        stderr=subprocess.PIPE)
                copier = threading.Thread(target=_copy_stderr, args=(proc.stderr, markers), daemon=True)
                copier.start()
                nranks = getattr(command_for, "nranks", None)
                progress.say("waiting for %s to start (MPI_Init, hvd.init(); up to %g s)"
                             % ("%d ranks" % nranks if nranks else "the ranks",
                                progress.start_timeout(args, os.environ)))
            while proc is not None:
                try:
                    rc = proc.wait(timeout=0.1)
                    break
                except subprocess.TimeoutExpired:
                    polls += 1
                    if polls % 10 == 1:
                        seen_files |= leftovers.used_by_descendants(proc.pid)
                    if stopped is None and status_dir and status.any_record(status_dir):
                        stopped = status.stopped_ranks(status_dir)   # a frozen rank is why others time out
                    # mpirun waits for ranks that ignore the signal: after a grace period, kill them
                    if signalled and time.monotonic() - signalled[0][0] > SIGNAL_GRACE_S:
                        print("stellarun: ranks still running %.0f s after the signal; killing them"
                              % SIGNAL_GRACE_S, flush=True)
                        break
        finally:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
            if copier is not None:
                copier.join(timeout=10)
            markers.close()
            if teardown is not None:
                teardown()
    finally:
        removed = leftovers.remove_after_job(seen_files, since=started - 1)
        if status_dir:
            records = status.read_all(status_dir)
            shutil.rmtree(status_dir, ignore_errors=True)
        records = status.merged(records, markers.records)
        for s, h in old.items():
            signal.signal(s, h)
    if removed:
        print("stellarun: removed %d file(s) MPICH left behind (%s)" % (len(removed), ", ".join(removed)), flush=True)
    if signalled:
        # what the ranks recorded after the signal is the signal's doing, not a failure
        records = [r for r in records if r["time"] < signalled[0][1]]
    if records_out is not None:
        records_out.extend(records)
        # a rank found stopped failed, whatever its record (killed by the abort, or none)
        records_out.extend({"rank": rec["rank"], "host": rec["host"], "pid": rec["pid"], "time": time.time(),
                            "cause": "signal", "detail": "stopped (SIGSTOP or a debugger) when the job failed"}
                           for rec in stopped or [])
    line, code = status.report(records)
    if line:
        print("stellarun: " + line, flush=True)
    for rec in stopped or []:
        print("stellarun: when it failed, rank %d (host %s, pid %d) was stopped (SIGSTOP or a debugger)"
              % (rec["rank"], rec["host"], rec["pid"]), flush=True)
    if signalled:
        print("stellarun: stopped by %s; the job was stopped" % signal.Signals(signalled[0][2]).name, flush=True)
        return 128 + signalled[0][2]
    if code:
        return code
    if rc:
        print("stellarun: mpirun exited with code %d and no rank said why (the launch itself failed?)" % rc,
              flush=True)
        return status.LAUNCH_FAILED
    return 0


def counted(command_for, nranks):
    """``command_for`` (status_dir -> mpirun command) noting its job's number of ranks, which
    run_job says it waits for."""
    command_for.nranks = nranks
    return command_for


def job_ranks(args):
    """The number of ranks of a plain job: -np, else the slots of -H, else Slurm's (0: unknown)."""
    slots = parse_hosts(args.hosts) if args.hosts else None
    return args.np or (sum(n for _, n in slots) if slots else 0) or int(os.environ.get("SLURM_NTASKS", "0") or 0)


def build_command(args, status_dir):
    cmd = [args.mpirun or find_mpirun()]
    slots = parse_hosts(args.hosts) if args.hosts else None
    np_ = job_ranks(args)
    if np_ <= 0:
        raise UsageError("stellarun: give the number of ranks with -np N")
    cmd += ["-np", str(np_)]
    if args.hostfile and args.hosts:
        raise UsageError("stellarun: give the hosts with -H or with --hostfile, not both")
    if args.hostfile:
        cmd += ["-f", args.hostfile]
    if slots:
        cmd += ["-hosts", ",".join("%s:%d" % hs for hs in slots)]
    if args.network_interface:
        cmd += ["-iface", args.network_interface]
    env = settings_env(args)
    if status_dir:
        env["STELLA_STATUS_DIR"] = status_dir
    if args.clusters:
        if args.clusters > np_:
            raise UsageError("stellarun: --clusters %d is more than the %d ranks" % (args.clusters, np_))
        env["STELLA_CLUSTERS"] = str(args.clusters)
    if args.cluster_of:
        mapping = parse_cluster_of(args.cluster_of)
        env["STELLA_CLUSTER_MAP"] = ",".join("%s=%s" % kv for kv in sorted(mapping.items()))
    for k, v in sorted(env.items()):
        cmd += ["-genv", k, v]
    cmd += list(args.mpi_args or [])
    if not args.command:
        raise UsageError("stellarun: no command to run (e.g. stellarun -np 4 python train.py)")
    return cmd + supervised(args.command)


def build_segments_command(args, segments, status_dir, wan=None):
    """stellarun --elastic's mpirun: one MPMD segment per rank [(host, env)], local hosts run
    here (fork), others by hydra on that host. ``wan``: (emulation or None, the clusters' labels)
    of --elastic --wan: every host is local and a rank starts in its cluster's namespace; each
    host is its own hydra host, so that MPICH shares memory inside a host only."""
    cmd = [args.mpirun or find_mpirun()]
    hosts = []
    for host, _ in segments:
        if host not in hosts:
            hosts.append(host)
    host_list = ["-hosts", ",".join("%s:%d" % (h, sum(1 for x, _ in segments if x == h)) for h in hosts)]
    if wan is not None:
        cmd += ["-launcher", "fork"] + host_list
    elif all(elastic.is_local(h) for h in hosts):
        cmd += ["-launcher", "fork"]
    else:
        cmd += host_list
    if args.network_interface:
        cmd += ["-iface", args.network_interface]
    env = settings_env(args)
    if wan is not None:
        emu, labels = wan
        index = [labels.index(e["STELLA_CLUSTER"]) for _, e in segments]
        env.update(wan_env(args, emu, [index.count(c) for c in set(index)], index[0]))
    if status_dir:
        env["STELLA_STATUS_DIR"] = status_dir
    for k, v in sorted(env.items()):
        cmd += ["-genv", k, v]
    cmd += list(args.mpi_args or [])
    for i, (host, seg_env) in enumerate(segments):
        if i:
            cmd.append(":")
        cmd += ["-n", "1"]
        for k, v in sorted(seg_env.items()):
            cmd += ["-env", k, v]
        if wan is not None and wan[0] is not None:
            cmd += ["-env", "STELLA_WAN_ADDR", wan[0].address(index[i])] + wan[0].exec_prefix(index[i])
        cmd += supervised(args.command)
    return cmd


def run_elastic(args):
    if args.hostfile or args.clusters:
        raise UsageError("stellarun: --elastic takes its hosts from --host-discovery-script or -H (not -f or "
                         "--clusters)")
    if not args.command:
        raise UsageError("stellarun: no command to run (e.g. stellarun --elastic -np 4 ... python train.py)")
    if not args.host_discovery_script and not args.hosts:
        raise UsageError("stellarun: --elastic needs --host-discovery-script (or -H for a fixed host list)")
    args.static_hosts = parse_hosts(args.hosts) if args.hosts else None
    labels = parse_cluster_of(args.cluster_of or [])
    args.cluster_labels = labels
    if args.blacklist_cooldown_range:
        lo, hi = args.blacklist_cooldown_range
        if not 0 <= lo <= hi:
            raise UsageError("stellarun: --blacklist-cooldown-range expects MIN MAX seconds with 0 <= MIN <= MAX")
    if not args.wan:
        return elastic.elastic_main(
            args, lambda segments: counted(lambda status_dir: build_segments_command(args, segments, status_dir),
                                           len(segments)),
            lambda command_for, records: run_job(args, command_for, records_out=records))
    # --elastic --wan: one namespace per cluster label, for the whole job (hosts come and go)
    clusters = []
    for label in labels.values():
        if label not in clusters:
            clusters.append(label)
    if len(clusters) < 2 or args.hosts or args.network_interface:
        raise UsageError("stellarun: --elastic --wan emulates the link between clusters of this machine: give 2 or more "
                         "clusters with --cluster-of HOST=LABEL (hosts are names of this machine: localhost, "
                         "127.0.0.1, ...) and hosts by --host-discovery-script (not -H or --network-interface)")
    if args.dry_run:   # print the first incarnation's command: nothing probed or built
        emu, setup, teardown = WanEmulation(len(clusters), args.wan, args.wan_schedule or [], delay_s=args.wan_delay), \
            (lambda: None), (lambda: None)
    else:
        emu, setup, teardown = wan_emulation(args, len(clusters))
    stop = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP) if signal.getsignal(s) != signal.SIG_IGN}

    def end(signum, frame):   # between incarnations: remove the emulation on the way out
        raise SystemExit(128 + signum)
    try:
        for s in stop:
            signal.signal(s, end)
        setup()
        return elastic.elastic_main(
            args, lambda segments: counted(lambda status_dir: build_segments_command(args, segments, status_dir,
                                                                                     (emu, clusters)), len(segments)),
            lambda command_for, records: run_job(args, command_for, records_out=records))
    finally:
        for s in stop:
            signal.signal(s, signal.SIG_IGN)   # a second signal must not cut the teardown short
        teardown()
        for s, h in stop.items():
            signal.signal(s, h)


def parse_cluster_of(items):
    """The ``--cluster-of HOST=LABEL`` options as {host: label} (the last one for a host wins)."""
    labels = {}
    for item in items:
        host, sep, label = item.partition("=")
        if not sep or not host or not label:
            raise UsageError("stellarun: --cluster-of expects HOST=LABEL, got %r" % item)
        labels[host] = label
    return labels


def parse_hosts(text):
    """horovodrun's ``-H host1:slots,host2:slots`` as [(host, slots)] (slots 1 when left out)."""
    out = []
    for item in str(text).split(","):
        host, sep, slots = item.strip().partition(":")
        try:
            n = int(slots) if sep else 1
        except ValueError:
            n = 0
        if not host or n < 1:
            raise UsageError("stellarun: -H expects host:slots,... (e.g. -H node1:4,node2:4), got %r" % item)
        out.append((host, n))
    return out


def _parsed_by(name):
    """argparse type applying shaping.<name>: a bad value is a usage error, not a traceback."""
    def parse_value(text):
        try:
            return getattr(shaping, name)(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e))
    return parse_value


def parse(argv):
    p = argparse.ArgumentParser(prog="stellarun", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("-np", "-n", type=int, dest="np", help="number of ranks")
    p.add_argument("--clusters", type=int, help="split each host's ranks into N clusters (single-host runs)")
    p.add_argument("-f", "--hostfile", help="MPI host file; each host is a cluster unless --cluster-of says otherwise")
    p.add_argument("--cluster-of", action="append", metavar="HOST=LABEL",
                   help="put HOST in cluster LABEL (repeat); hosts with one label form one cluster")
    p.add_argument("--timeout", type=float, help="seconds any wait on a peer may take (STELLA_TIMEOUT)")
    p.add_argument("--mpirun", help="the mpirun to use (default: the one of this Python environment)")
    p.add_argument("--mpi-args", nargs=argparse.ONE_OR_MORE, help="extra arguments passed to mpirun as they are")
    p.add_argument("--wan", metavar="RATE", type=_parsed_by("parse_rate"),
                   help="emulate a WAN of RATE (e.g. 100mbit) between the clusters")
    p.add_argument("--wan-schedule", metavar="T:RATE,...", type=_parsed_by("parse_schedule"), help="change the WAN rate at these seconds ('down': cut the link until the next entry)")
    p.add_argument("--wan-delay", metavar="DELAY", type=_parsed_by("parse_delay"), default=0.0,
                   help="one-way delay on the emulated WAN (e.g. 30ms)")
    p.add_argument("--wan-route", choices=["auto", "dense"],
                   help="what crosses between clusters when the script names no stella compressor (STELLA_WAN_ROUTE): "
                        "'auto' (the default: the adjuster chooses) or 'dense' (Horovod's exact numerics)")
    p.add_argument("-H", "--hosts", help="hosts and their slots, host1:4,host2:4 (horovodrun's -H); each host is a "
                   "cluster unless --cluster-of says otherwise")
    p.add_argument("--network-interface", metavar="IFACE",
                   help="the interface MPI and gloo use between hosts (hydra's -iface, STELLA_GLOO_IFNAME)")
    p.add_argument("--output-filename", metavar="DIR",
                   help="also write each rank's stdout and stderr to DIR/rank.N/stdout and stderr")
    p.add_argument("--start-timeout", type=float, metavar="SECONDS",
                   help="seconds for every rank to start (MPI_Init and hvd.init()); STELLA_TIMEOUT by default")
    p.add_argument("--verbose", action="store_true", help="print the mpirun command and log at info level")
    p.add_argument("--quiet", action="store_true",
                   help="leave out the lines on stderr that say what stellarun waits for (WAN set-up, ranks "
                        "starting, elastic hosts)")
    p.add_argument("--config-file", metavar="FILE",
                   help="horovodrun's YAML config file (params, timeline, stall_check, logging); the command line wins")
    p.add_argument("--fusion-threshold-mb", type=float, help="gradient bucket size in MiB (HOROVOD_FUSION_THRESHOLD)")
    p.add_argument("--cycle-time-ms", type=float, help="negotiation cycle (HOROVOD_CYCLE_TIME)")
    p.add_argument("--cache-capacity", type=int, help="names the negotiation's cache holds (HOROVOD_CACHE_CAPACITY)")
    p.add_argument("--timeline-filename", metavar="FILE", help="write Horovod's timeline (HOROVOD_TIMELINE)")
    p.add_argument("--timeline-mark-cycles", action="store_true", default=None,
                   help="mark negotiation cycles in the timeline")
    p.add_argument("--no-stall-check", dest="stall_check", action="store_false", default=None,
                   help="disable the stall inspector")
    p.add_argument("--stall-check-warning-time-seconds", type=float)
    p.add_argument("--stall-check-shutdown-time-seconds", type=float)
    p.add_argument("--log-level", choices=["TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL",
                                           "trace", "debug", "info", "warning", "error", "fatal"])
    p.add_argument("--elastic", action="store_true",
                   help="an elastic job (hvd.elastic): survive lost hosts and take in new ones (stellarun/elastic.py)")
    p.add_argument("--min-np", type=int, help="--elastic: the fewest ranks to run with (default -np)")
    p.add_argument("--max-np", type=int, help="--elastic: the most ranks to run with (default -np)")
    p.add_argument("--host-discovery-script", metavar="SCRIPT",
                   help="--elastic: prints the available hosts, one host:slots per line")
    p.add_argument("--reset-limit", type=int, default=100, help="--elastic: resets before giving up")
    p.add_argument("--elastic-timeout", type=float, default=600.0,
                   help="--elastic: seconds to wait for --min-np slots")
    p.add_argument("--blacklist-cooldown-range", type=float, nargs=2, metavar=("MIN", "MAX"),
                   help="--elastic: a failed host is left out for a random time in this range (default: for good)")
    p.add_argument("--dry-run", action="store_true", help="print the full mpirun command instead of running it")
    p.add_argument("--clean", action="store_true",
                   help="remove the shared-memory and topology files MPICH left behind on this machine (of jobs "
                        "that no longer run) and exit")
    p.add_argument("--since", type=float, metavar="UNIX_TIME",
                   help="--clean: after a job launched with plain mpirun at UNIX_TIME: also its files made since "
                        "then that nothing uses, however young")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the program and its arguments")
    args = p.parse_args(argv)
    if args.config_file:
        try:
            for dest, value in config_file.load(args.config_file).items():
                if getattr(args, dest, None) is None:   # the command line wins
                    setattr(args, dest, value)
        except ValueError as e:
            raise UsageError("stellarun: %s" % e) from None
    return args


def main(argv=None):
    try:
        return _main(argv)
    except UsageError as e:
        sys.stderr.write(e.message + "\n")
        return 2


def _main(argv):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plan"]:
        from . import plan
        return plan.main(argv[1:])
    args = parse(argv)
    progress.QUIET = args.quiet
    if args.since is not None and not args.clean:
        raise UsageError("stellarun: --since goes with --clean")
    if args.clean:
        removed = leftovers.remove_unused()
        if args.since is not None:
            removed += leftovers.remove_after_job(set(), since=args.since, settle_s=0.0)
        print("stellarun: removed %d file(s) MPICH left behind%s" % (len(removed), "".join("\n  " + p for p in removed)))
        return 0
    if args.mpirun:
        check_mpirun(args.mpirun)
    if (args.wan_schedule or args.wan_delay) and not args.wan:
        raise UsageError("stellarun: --wan-schedule and --wan-delay need --wan RATE")
    if args.elastic or args.host_discovery_script or args.min_np or args.max_np:
        return run_elastic(args)
    if args.wan:
        if args.hosts or args.network_interface:
            raise UsageError("stellarun: --wan emulates clusters on this machine; -H and --network-interface are for "
                             "real hosts")
        return run_with_wan(args)
    build_command(args, "")   # usage errors before anything starts
    return run_job(args, counted(lambda status_dir: build_command(args, status_dir), job_ranks(args)))


if __name__ == "__main__":
    sys.exit(main())
