"""``stellarun --elastic``: an elastic job as a sequence of MPI jobs ("incarnations").

    stellarun --elastic -np 4 --min-np 2 --host-discovery-script ./hosts.sh \\
        --cluster-of localhost=a --cluster-of 127.0.0.1=b python train.py

MPI cannot shrink or grow a job's world in place, so when the hosts change stellarun starts a
new MPI job for the hosts there are now, and the training state carries over through the
commits the ranks write to node-local files (``hvd.elastic``: stella_mpi/elastic/). The loop:

1. discover the hosts (``--host-discovery-script`` prints ``host:slots`` lines, as Horovod's
   does; or ``-H``), leave out blacklisted ones, wait up to ``--elastic-timeout`` for at least
   ``--min-np`` slots, and take up to ``--max-np`` (default ``-np``) ranks, filling hosts in order;
2. run the incarnation: one mpirun, one MPMD segment per rank, each with Horovod's environment
   (``HOROVOD_HOSTNAME``, ``HOROVOD_RANK``, ``HOROVOD_SIZE``, ``HOROVOD_LOCAL_RANK``,
   ``HOROVOD_LOCAL_SIZE``, ``HOROVOD_CROSS_RANK``, ``HOROVOD_CROSS_SIZE``), its cluster label
   (``--cluster-of HOST=LABEL``, else the host's name) and its host's commit directory;
   meanwhile discovery runs every second and a change is announced to the ranks (a notification
   file), which raise ``HostsUpdatedInterrupt`` at their next ``commit()``, save, and leave;
3. when the incarnation ends: exit 0 ends the job, and so does an uncaught exception in the
   script (another incarnation would raise it again); anything else is a reset (at most
   ``--reset-limit``): a host whose rank failed while it was still listed by discovery is
   blacklisted (for a random time within ``--blacklist-cooldown-range``, else for good); a host
   that had left the discovery output was revoked, not faulty, and may come back; a cluster
   whose ranks all went silent to another's deadline was cut off by the link and is left out
   for a while, then tried again (:meth:`ElasticDriver.handle_cuts`); then 1.

With ``--wan`` (stellarun/cli.py) the clusters' namespaces live for the whole job, and a rank
starts in its cluster's.

On one machine, distinct names of it (``localhost``, ``127.0.0.1``, its hostname, any
``127.x.y.z``) are distinct hosts, all launched here without ssh, so a revocation can be
rehearsed on a laptop. Other names are launched by hydra on those hosts (``-hosts``).
"""
import itertools
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

from . import progress

RESET_EXIT = 75        # a rank leaving for a reset (stella_mpi/elastic/worker.py's EXIT_RESET)
DISCOVERY_INTERVAL_S = 1.0
CUT_RETRY_S = 30.0     # a cluster cut off by its link is tried again after this, doubling each time ...
CUT_RETRY_MAX_S = 600.0   # ... up to this (and after an incarnation this long, from CUT_RETRY_S again)


class ElasticError(Exception):
    pass


def local_names():
    names = {"localhost", "::1", socket.gethostname()}
    try:
        names.add(socket.getfqdn())
    except OSError:
        pass
    return names


def is_local(host):
    return host in local_names() or host.startswith("127.")


def parse_discovery(text):
    """``host:slots`` lines (``host`` alone: 1 slot) -> [(host, slots)] in order, one per host."""
    out, seen = [], set()
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        host, sep, slots = line.rpartition(":") if line.count(":") == 1 else (line, "", "")
        if not sep:
            host, slots = line, "1"
        try:
            n = int(slots)
        except ValueError:
            raise ElasticError("host discovery printed %r: expected host:slots" % line)
        if not host or n < 1:
            raise ElasticError("host discovery printed %r: expected host:slots with slots >= 1" % line)
        if host not in seen:
            seen.add(host)
            out.append((host, n))
    return out


class Discovery:
    """The current hosts: the discovery script's output, or the static ``-H`` list."""

    def __init__(self, script=None, static=None):
        self.script = script
        self.static = static or []
        self.last = list(self.static)

    def hosts(self):
        if not self.script:
            return list(self.static)
        try:
            out = subprocess.run([self.script] if os.access(self.script, os.X_OK) else ["sh", self.script],
                                 capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            print("stellarun elastic: host discovery failed (%s); keeping the last hosts" % e, flush=True)
            return list(self.last)
        if out.returncode != 0:
            print("stellarun elastic: host discovery exited with %d; keeping the last hosts" % out.returncode,
                  flush=True)
            return list(self.last)
        self.last = parse_discovery(out.stdout)
        return list(self.last)


def assign(hosts, max_np):
    """Ranks to hosts, filling hosts in order: [(host, local_rank, local_size)] per rank."""
    ranks = []
    for host, slots in hosts:
        n = min(slots, max_np - len(ranks))
        ranks += [(host, i, n) for i in range(n)]
        if len(ranks) >= max_np:
            break
    return ranks


class ElasticDriver:
    def __init__(self, args, command_for_segments, run_job):
        self.args = args
        self.discovery = Discovery(args.host_discovery_script, args.static_hosts)
        self.min_np = args.min_np or args.np
        self.max_np = args.max_np or args.np
        if not self.min_np or not self.max_np or self.min_np > self.max_np:
            raise ElasticError("--elastic needs -np (and --min-np <= --max-np)")
        self.base = tempfile.mkdtemp(prefix="stella-elastic-")
        self.notify = os.path.join(self.base, "hosts_updated")
        self.epoch = 0
        self.resets = 0
        self.blacklist = {}     # host -> until (monotonic seconds; inf: for good)
        self.cut_off = {}       # host -> until: its cluster was cut off by the link (not the host's fault)
        self.cuts = {}          # cluster label -> times cut off (since a long incarnation with it)
        self.unplaceable = set()   # hosts --wan cannot place (warned about once)
        self.command_for_segments = command_for_segments
        self.run_job = run_job
        self.labels = dict(args.cluster_labels or {})
        self.history = []       # (incarnation, hosts, exit code, seconds)

    # ---- hosts ----
    def usable(self, hosts):
        now = time.monotonic()
        return [(h, n) for h, n in hosts if self.blacklist.get(h, 0) <= now and self.cut_off.get(h, 0) <= now
                and self.wan_placeable(h)]

    def wan_placeable(self, host):
        """--wan emulates the links between clusters of this machine: a host that is not a name of
        it, or has no --cluster-of label (the namespaces are made for the labels), cannot be
        placed; it is left out, with a warning the first time (discovery may list it mid-job)."""
        if not getattr(self.args, "wan", None):
            return True
        why = None
        if not is_local(host):
            why = "--wan emulates clusters on this machine, but discovery listed host %s" % host
        elif host not in self.labels:
            why = "--wan: host %s has no cluster; give it one with --cluster-of %s=LABEL" % (host, host)
        if why is not None and host not in self.unplaceable:
            self.unplaceable.add(host)
            print("stellarun elastic: %s; it is left out" % why, flush=True)
        return why is None

    def wait_for_hosts(self):
        start = time.monotonic()
        deadline = start + self.args.elastic_timeout
        waited = False
        while True:
            hosts = self.usable(self.discovery.hosts())
            if sum(n for _, n in hosts) >= self.min_np:
                if waited:
                    progress.say("elastic: %d slots after %.0f s; forming the job" % (
                        sum(n for _, n in hosts), time.monotonic() - start))
                return hosts
            if not waited:   # said once, when the wait begins
                waited = True
                now = time.monotonic()
                out = sorted(h for h, t in list(self.blacklist.items()) + list(self.cut_off.items()) if t > now)
                progress.say("elastic: waiting for %s: %d of the %d slots --min-np needs (hosts: %s%s; up to %.0f s)"
                             % ("a host to return" if out else "hosts", sum(n for _, n in hosts), self.min_np,
                                ", ".join("%s:%d" % h for h in hosts) or "none",
                                "; left out: " + ", ".join(out) if out else "", self.args.elastic_timeout))
            if time.monotonic() > deadline:
                raise ElasticError("fewer than --min-np %d slots for %.0f s (hosts: %s%s)" % (
                    self.min_np, self.args.elastic_timeout, ", ".join("%s:%d" % h for h in hosts) or "none",
                    "; left out: " + ", ".join(sorted(self.unplaceable)) if self.unplaceable else ""))
            time.sleep(DISCOVERY_INTERVAL_S)

    def announce(self, kind):
        self.epoch += 1
        tmp = self.notify + ".tmp"
        with open(tmp, "w") as f:
            f.write("%d %s\n" % (self.epoch, kind))
        os.replace(tmp, self.notify)
        print("stellarun elastic: hosts %s; the ranks reset at their next commit" % kind, flush=True)

    def watch(self, running, stop):
        """During an incarnation: announce each change of the discovered hosts once."""
        known = {h for h, _ in running}
        while not stop.wait(DISCOVERY_INTERVAL_S):
            now = {h for h, _ in self.usable(self.discovery.hosts())}
            if now != known:
                self.announce("removed" if known - now else "added")
                known = now

    # ---- one incarnation ----
    def segments(self, ranks):
        hosts = []
        for h, _, _ in ranks:
            if h not in hosts:
                hosts.append(h)
        out = []
        for r, (host, local_rank, local_size) in enumerate(ranks):
            env = {"HOROVOD_HOSTNAME": host, "HOROVOD_RANK": str(r), "HOROVOD_SIZE": str(len(ranks)),
                   "HOROVOD_LOCAL_RANK": str(local_rank), "HOROVOD_LOCAL_SIZE": str(local_size),
                   "HOROVOD_CROSS_RANK": str(hosts.index(host)), "HOROVOD_CROSS_SIZE": str(len(hosts)),
                   "HOROVOD_ELASTIC": "1", "STELLA_CLUSTER": self.labels.get(host, host),
                   "STELLA_ELASTIC_DIR": os.path.join(self.base, "hosts", host),
                   "STELLA_ELASTIC_NOTIFY": self.notify, "STELLA_ELASTIC_EPOCH": str(self.epoch),
                   "STELLA_ELASTIC_RESETS": str(self.resets)}
            out.append((host, env))
        return out

    def run(self):
        try:
            while True:
                hosts = self.wait_for_hosts()
                ranks = assign(hosts, self.max_np)
                used = []
                for h, _, _ in ranks:
                    if h not in used:
                        used.append(h)
                print("stellarun elastic: incarnation %d: %d rank(s) on %s (unix %.3f)" % (
                    len(self.history), len(ranks), ", ".join("%s:%d" % (h, sum(1 for x in ranks if x[0] == h))
                                                             for h in used), time.time()), flush=True)
                stop = threading.Event()
                watcher = threading.Thread(target=self.watch, args=([(h, 0) for h in used], stop), daemon=True)
                watcher.start()
                records = []
                t0 = time.monotonic()
                try:
                    rc = self.run_job(self.command_for_segments(self.segments(ranks)), records)
                finally:
                    stop.set()
                    watcher.join()
                self.history.append((len(self.history), used, rc, time.monotonic() - t0))
                print("stellarun elastic: incarnation %d ended with exit %d (unix %.3f)" % (
                    len(self.history) - 1, rc, time.time()), flush=True)
                if rc == 0:
                    return 0
                if rc >= 128 and not records:   # stellarun itself was stopped by a signal
                    return rc
                raised = [r for r in records if r.get("cause") == "exception"]
                if raised:   # the script's own error: another incarnation would raise it again
                    print("stellarun elastic: rank %d raised an exception (not a lost host); the job ends" %
                          raised[0].get("rank", -1), flush=True)
                    return rc
                self.resets += 1
                if self.history[-1][3] >= CUT_RETRY_MAX_S:   # the links of a long incarnation's clusters held:
                    for host in used:                          # a new cut of one starts its back-off over
                        self.cuts.pop(self.labels.get(host, host), None)
                self.handle_failures(records, ranks)
                if self.resets > self.args.reset_limit:
                    print("stellarun elastic: %d resets, more than --reset-limit %d; giving up" % (
                        self.resets, self.args.reset_limit), flush=True)
                    return rc
                print("stellarun elastic: reset %d: starting the next incarnation" % self.resets, flush=True)
        finally:
            shutil.rmtree(self.base, ignore_errors=True)

    def handle_failures(self, records, ranks):
        """Leave out the clusters the link cut off (for a while), and blacklist the hosts whose
        ranks failed otherwise while discovery still listed them (after a deadline: the hosts of
        the ranks that did not answer)."""
        listed = {h for h, _ in self.discovery.hosts()}
        cut = self.handle_cuts(records, ranks, listed)
        # a rank stopped, killed or exiting on its own explains the others' start-up deadlines
        explained = any(rec.get("cause") in ("signal", "exit") and not _is_reset(rec) for rec in records)
        failed = set()
        for rec in records:
            r = rec.get("rank", -1)
            if not 0 <= r < len(ranks) or _is_reset(rec) or self.cluster_of(ranks, r) in cut:
                continue   # a rank that left for a reset, or one cut off: not the host's failure
            if (cut or explained) and rec.get("cause") == "deadline" and rec.get("silent") is None:
                continue   # a start-up deadline (nobody could be asked) that the cut or a failed rank explains
            silent = [s for s in rec.get("silent") or [] if 0 <= s < len(ranks)] if rec.get("cause") == "deadline" \
                else []
            if silent:   # a deadline passed: the hosts of the ranks that did not answer (and were not cut off) failed
                failed.update(ranks[s][0] for s in silent if self.cluster_of(ranks, s) not in cut)
            elif rec.get("cause") == "collective":
                # the rank that saw a collective fail is not the one that failed: the sender of a
                # malformed payload is blamed where the message names it; otherwise nobody (a THC
                # scale is agreed by one MAX, which cannot tell the sender): the reset retries
                sender = re.search(r"rank (\d+) sent ", str(rec.get("detail", "")))
                if sender and 0 <= int(sender.group(1)) < len(ranks):
                    failed.add(ranks[int(sender.group(1))][0])
            else:
                failed.add(ranks[r][0])
        for host in sorted(failed):
            if host not in listed:
                print("stellarun elastic: host %s left (revoked); it may come back" % host, flush=True)
                continue
            lo, hi = self.args.blacklist_cooldown_range or (None, None)
            until = time.monotonic() + random.uniform(lo, hi) if lo is not None else float("inf")
            self.blacklist[host] = until
            print("stellarun elastic: host %s failed; blacklisted %s" % (
                host, "for good" if until == float("inf") else "for %.0f s" % (until - time.monotonic())), flush=True)

    def cluster_of(self, ranks, r):
        return self.labels.get(ranks[r][0], ranks[r][0]) if 0 <= r < len(ranks) else None

    def handle_cuts(self, records, ranks, listed):
        """The clusters a link failure cut off, from the deadlines' records: a rank whose wait
        passed its deadline names the ranks that did not answer its question (``silent``, every
        rank of the world asked); a cluster none of whose ranks answered a rank of another
        cluster is cut off from that one, unless one of its ranks is known to have failed otherwise
        (stopped, killed: then that rank's host failed). The clusters that go on are joined to
        each other (no pair of them cut apart): of those sets, the largest (in ranks of hosts
        discovery still lists, then in ranks; a tie goes to the set with rank 0), and the hosts
        of the others (those discovery still lists) are left out for CUT_RETRY_S, doubling per
        cut of the same cluster up to CUT_RETRY_MAX_S (or a random time within
        --blacklist-cooldown-range when given): then they rejoin at the
        survivors' next commit, and if the link is still down the start-up's deadline cuts
        them off again. One stalled rank in a cluster of several is not a cut (the others
        answer): its host fails as before. ``listed``: the hosts discovery lists now. Returns the
        labels of the clusters cut off."""
        members = {}
        for r in range(len(ranks)):
            members.setdefault(self.cluster_of(ranks, r), set()).add(r)
        if len(members) < 2:
            return set()
        # ranks known to have failed otherwise (stopped, killed) are not silent because of a link
        broken = {rec.get("rank") for rec in records if rec.get("cause") in ("signal", "exit") and not _is_reset(rec)}
        apart = set()
        for rec in records:
            r, silent = rec.get("rank", -1), rec.get("silent")
            if rec.get("cause") != "deadline" or not silent or not 0 <= r < len(ranks):
                continue
            mine = self.cluster_of(ranks, r)
            for label, ms in members.items():
                if label != mine and ms <= set(silent) and not ms & broken:
                    apart.add(frozenset((mine, label)))
        if apart:
            keep = _joined_clusters(members, apart, lambda r: ranks[r][0] in listed)
            cut = set(members) - keep

            def why(label):
                return "none of its %d rank(s) answered cluster %s at the deadline (the link between them is down?)" % (
                    len(members[label]), ", ".join(sorted(c for c in members if frozenset((c, label)) in apart)))
        else:
            cut = self.start_up_cut(records, members)
            if not cut:
                return set()
            keep = set(members) - cut

            def why(label):
                return ("the job did not start (a start-up deadline passed before any rank could be asked) with it "
                        "back after a cut (the link is still down?)")
        for label in sorted(cut, key=lambda c: min(members[c])):
            self.cuts[label] = self.cuts.get(label, 0) + 1
            lo, hi = self.args.blacklist_cooldown_range or (None, None)
            wait = random.uniform(lo, hi) if lo is not None else min(CUT_RETRY_MAX_S,
                                                                      CUT_RETRY_S * 2 ** (self.cuts[label] - 1))
            hosts = sorted({ranks[r][0] for r in members[label]})
            for host in hosts:
                if host in listed:   # one that left discovery was revoked: it may come back at once
                    self.cut_off[host] = time.monotonic() + wait
            print("stellarun elastic: cluster %s (host%s %s) was cut off: %s; the job goes on with cluster%s %s; "
                  "cluster %s is tried again in %.0f s" % (label, "s" if len(hosts) > 1 else "", ", ".join(hosts),
                                                          why(label), "s" if len(keep) > 1 else "",
                                                          ", ".join(sorted(keep)), label, wait), flush=True)
        return cut

    def start_up_cut(self, records, members):
        """A failure with nobody asked: every record a deadline without ``silent`` (MPI_Init, or
        hvd.init() before the diagnosis can run, did not complete: over a link that is down,
        MPICH's start-up does not finish). If clusters cut off before (since the last long
        incarnation) are back in this job, the link is taken to be down still: they are cut
        off again (all but rank 0's cluster when every one of them was). If none was, and
        the ranks of every cluster timed out (the link went down as the job started: blaming
        every host would leave the job none), every cluster but rank 0's is cut off. Else no
        cut: the hosts fail as before."""
        failed = [rec for rec in records if not _is_reset(rec)]
        if not failed or any(rec.get("cause") != "deadline" or rec.get("silent") is not None for rec in failed):
            return set()
        back = {c for c in members if self.cuts.get(c)}
        if not back:
            timed_out = {r for rec in failed for r in [rec.get("rank", -1)]}
            if all(ms & timed_out for ms in members.values()):
                back = set(members)
        if back == set(members):
            back -= {min(members, key=lambda c: min(members[c]))}
        return back


def _joined_clusters(members, apart, listed_rank):
    """The clusters that go on: of the sets of clusters no two of which are ``apart``, the one
    with the most ranks ``listed_rank`` holds for, then the most ranks, then the lowest rank.
    Every set is tried up to 12 clusters; beyond, clusters are added greedily in that order."""
    def score(group):
        ranks = [r for c in group for r in members[c]]
        return (sum(1 for r in ranks if listed_rank(r)), len(ranks), -min(ranks))

    def joined(group):
        return all(frozenset((a, b)) not in apart for a, b in itertools.combinations(group, 2))
    labels = sorted(members, key=lambda c: min(members[c]))
    if len(labels) <= 12:
        groups = (g for k in range(1, len(labels) + 1) for g in itertools.combinations(labels, k) if joined(g))
        return set(max(groups, key=score))
    keep = []
    for label in sorted(labels, key=lambda c: score([c]), reverse=True):
        if joined(keep + [label]):
            keep.append(label)
    return set(keep)


def _is_reset(rec):
    """A rank that left for a reset (exit RESET_EXIT) did not fail."""
    return rec.get("cause") == "exit" and ("code %d" % RESET_EXIT) in str(rec.get("detail", ""))


def elastic_main(args, build_segments_command, run_job):
    try:
        driver = ElasticDriver(args, build_segments_command, run_job)
        return driver.run()
    except ElasticError as e:
        print("stellarun elastic: %s" % e, file=sys.stderr, flush=True)
        return 2
