"""``stellarun``: launch a stella_mpi job with the environment's ``mpirun``, assigning clusters.

    stellarun -np 4 --clusters 2 python train.py      # one host, 2 clusters of 2 ranks
    stellarun -np 8 -f hosts python train.py            # several hosts: one cluster per host
    stellarun -np 8 -f hosts --cluster-of nodeA=lab --cluster-of nodeB=lab python train.py

Everything after the options is the command; mpirun options stellarun does not know can be
given after ``--mpi-args``. stellarun only prepares the environment and runs mpirun: the
transport, rendezvous and process launch stay MPI's.
"""
import argparse
import os
import shutil
import sys


def find_mpirun():
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    if os.path.exists(here):
        return here
    found = shutil.which("mpirun") or shutil.which("mpiexec")
    if not found:
        raise SystemExit("stellarun: no mpirun found; install the MPI wheel (pip install mpich) or a system MPI")
    return found


def build_command(args):
    cmd = [args.mpirun or find_mpirun()]
    np_ = args.np or int(os.environ.get("SLURM_NTASKS", "0") or 0)
    if np_ <= 0:
        raise SystemExit("stellarun: give the number of ranks with -np N")
    cmd += ["-np", str(np_)]
    if args.hostfile:
        cmd += ["-f", args.hostfile]
    env = {"PYTHONUNBUFFERED": "1"}
    if args.clusters:
        if args.clusters > np_:
            raise SystemExit("stellarun: --clusters %d is more than the %d ranks" % (args.clusters, np_))
        env["STELLA_CLUSTERS"] = str(args.clusters)
    if args.cluster_of:
        mapping = {}
        for item in args.cluster_of:
            host, sep, label = item.partition("=")
            if not sep or not host or not label:
                raise SystemExit("stellarun: --cluster-of expects HOST=LABEL, got %r" % item)
            mapping[host] = label
        env["STELLA_CLUSTER_MAP"] = ",".join("%s=%s" % kv for kv in sorted(mapping.items()))
    if args.timeout:
        env["STELLA_TIMEOUT"] = str(args.timeout)
    for k, v in sorted(env.items()):
        cmd += ["-genv", k, v]
    cmd += list(args.mpi_args or [])
    if not args.command:
        raise SystemExit("stellarun: no command to run (e.g. stellarun -np 4 python train.py)")
    return cmd + list(args.command)


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
    p.add_argument("--dry-run", action="store_true", help="print the mpirun command instead of running it")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the program and its arguments")
    return p.parse_args(argv)


def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else argv)
    cmd = build_command(args)
    if args.dry_run:
        print(" ".join(cmd))
        return 0
    sys.stdout.flush()
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    sys.exit(main())
