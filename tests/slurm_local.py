"""A real Slurm on this machine for the tests: munged, slurmctld and one slurmd per emulated node
(Debian's packages: slurmctld, slurmd, munge; ``scripts/run_slurm_tests.sh`` installs them),
everything in a temporary folder with its own ports, torn down afterwards.

Two slurmd daemons (``slurmd -N n1``, ``-N n2``) on one machine give Slurm two nodes, so a batch
script sees what it sees on a cluster: ``SLURM_JOB_NODELIST`` with two nodes, ``SLURMD_NODENAME``
per task, heterogeneous jobs with a component per node. MPI treats them as one machine (shared
memory), which does not matter to the batch scripts under test.

``LocalSlurm.start()`` raises ``SlurmUnavailable`` with the reason (not root, a binary missing, a
daemon that does not come up: its log's tail) so that tests skip cleanly.
"""
import os
import shutil
import socket
import subprocess
import tempfile
import time

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo", "scontrol")


class SlurmUnavailable(RuntimeError):
    pass


def _free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


CONF = """ClusterName=stellatest
SlurmctldHost={host}
AuthType=auth/munge
AuthInfo=socket={dir}/munge.sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool/%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.%n.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=pmi2
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
{nodes}
PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP
"""


class LocalSlurm:
    """``with LocalSlurm(nodes=2, cpus=2) as slurm: slurm.sbatch(script)``."""

    def __init__(self, nodes=2, cpus=2):
        self.nodes = ["n%d" % (i + 1) for i in range(nodes)]
        self.cpus = cpus
        self.dir = None
        self.env = None

    def _check(self):
        if os.geteuid() != 0:
            raise SlurmUnavailable("the local Slurm runs its daemons as root")
        missing = [b for b in BINARIES if shutil.which(b) is None]
        if missing:
            raise SlurmUnavailable("no %s (apt-get install slurmctld slurmd munge, or scripts/run_slurm_tests.sh)"
                                   % ", ".join(missing))

    def _log_tail(self, name):
        try:
            with open(os.path.join(self.dir, name)) as f:
                return "".join(f.readlines()[-5:])
        except OSError:
            return "(no log)"

    def start(self):
        self._check()
        self.dir = tempfile.mkdtemp(prefix="stella-slurm-")
        os.chmod(self.dir, 0o755)
        for sub in ["state"] + ["spool/%s" % n for n in self.nodes]:
            os.makedirs(os.path.join(self.dir, sub))
        key = os.path.join(self.dir, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o600)
        host = socket.gethostname()
        nodes = "\n".join("NodeName=%s NodeHostname=%s NodeAddr=127.0.0.1 Port=%d CPUs=%d State=UNKNOWN"
                          % (n, host, _free_port(), self.cpus) for n in self.nodes)
        conf = os.path.join(self.dir, "slurm.conf")
        with open(conf, "w") as f:
            f.write(CONF.format(host=host, dir=self.dir, ctld_port=_free_port(), nodes=nodes,
                                names=",".join(self.nodes)))
        self.env = dict(os.environ, SLURM_CONF=conf)
        for var in [v for v in self.env if v.startswith("SLURM_") and v != "SLURM_CONF"]:
            del self.env[var]   # a test run inside a Slurm job must not leak its job into ours
        try:
            self._run(["munged", "--key-file", key, "--socket", os.path.join(self.dir, "munge.sock"),
                       "--pid-file", os.path.join(self.dir, "munged.pid"), "--log-file",
                       os.path.join(self.dir, "munged.log"), "--seed-file", os.path.join(self.dir, "munge.seed"),
                       "--force"], "munged")
            self._run(["slurmctld"], "slurmctld", "slurmctld.log")
            for n in self.nodes:
                self._run(["slurmd", "-N", n], "slurmd -N %s" % n, "slurmd.%s.log" % n)
            self._wait_idle()
        except BaseException:
            self.close()
            raise
        return self

    def _run(self, cmd, what, log=None):
        proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise SlurmUnavailable("%s did not start (exit %d): %s %s" % (what, proc.returncode, proc.stderr.strip(),
                                                                          self._log_tail(log) if log else ""))

    def _wait_idle(self, timeout=60):
        end = time.monotonic() + timeout
        out = ""
        while time.monotonic() < end:
            proc = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env, capture_output=True, text=True,
                                  timeout=30)
            out = proc.stdout
            states = dict(line.split() for line in out.splitlines() if len(line.split()) == 2)
            if all(states.get(n) == "idle" for n in self.nodes):
                return
            time.sleep(0.5)
        raise SlurmUnavailable("the nodes did not become idle: %r; slurmctld: %s" % (out, self._log_tail("slurmctld.log")))

    def sbatch(self, script, args=(), env=None, timeout=600, cwd=None):
        """Submit ``script`` and wait for it (``sbatch -W``); returns (exit code, the job's output)."""
        out = os.path.join(self.dir, "job-%d.out" % time.monotonic_ns())
        full = dict(self.env, **(env or {}))
        proc = subprocess.run(["sbatch", "-W", "-o", out, "-e", out, script] + list(args), env=full, cwd=cwd,
                              capture_output=True, text=True, timeout=timeout)
        try:
            with open(out) as f:
                text = f.read()
        except OSError:
            text = ""
        return proc.returncode, proc.stdout + proc.stderr + text

    def close(self):
        if self.env is None:
            return
        try:
            subprocess.run(["scontrol", "shutdown"], env=self.env, capture_output=True, timeout=30)
            time.sleep(1)
        except (OSError, subprocess.TimeoutExpired):
            pass   # the daemons are killed below in any case
        for name in ["slurmd.%s.pid" % n for n in self.nodes] + ["slurmctld.pid", "munged.pid"]:
            try:
                with open(os.path.join(self.dir, name)) as f:
                    os.kill(int(f.read().strip()), 9)
            except (OSError, ValueError):
                pass
        shutil.rmtree(self.dir, ignore_errors=True)
        self.env = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()
