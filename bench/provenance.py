"""What produced a bench result: the commit (and whether the tree had changes), the versions of
Python, torch (and its CUDA), numpy, mpi4py and the MPI library, and the machine (cores, CPU
model, GPU), with the date and the command. Every bench JSON carries it under "provenance";
this is the one function that makes it (tests/unit/test_provenance.py checks that every
writer in bench/ uses it). ``STELLA_COMMIT`` names the commit where the checkout's .git is not
the tree's own (scripts/run_gpu.sh on the device machine, whose copy carries the session's
first .git: pass ``STELLA_COMMIT=<hash>`` in its command); "dirty" is then unknown (null).

The MPI library is read from mpi4py only where the script already imported mpi4py.MPI (it
runs under MPI): importing it would initialise MPI, which a launcher-side script (one that
starts stellarun jobs) must not do. There it names the mpich wheel's version instead."""
import datetime
import os
import platform
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _git(*args):
    try:
        proc = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
        return proc.stdout.strip() if proc.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def _dist_version(name):
    try:
        from importlib import metadata
        return metadata.version(name)
    except Exception:   # (not installed, or metadata unreadable)
        return None


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _mpi_library():
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None:
        try:
            return " ".join(mpi.Get_library_version().strip().splitlines()[0].split())
        except Exception:   # (a broken MPI still leaves the rest to say what ran)
            pass
    version = _dist_version("mpich")
    return "MPICH %s (mpich wheel; mpi4py.MPI not loaded here)" % version if version else None


def provenance():
    """A dict of plain JSON values; any part that cannot be read is None."""
    given = os.environ.get("STELLA_COMMIT", "").strip()   # a copy whose .git is not the tree's (the device machine)
    commit = given or _git("rev-parse", "HEAD") or None
    out = {"commit": commit,
           "dirty": None if given else bool(_git("status", "--porcelain", "--untracked-files=no")) if commit else None,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "python": platform.python_version(), "torch": None, "cuda": None, "gpu": None,
           "numpy": _dist_version("numpy"), "mpi4py": _dist_version("mpi4py"), "mpi_library": _mpi_library(),
           "cores": os.cpu_count(), "machine": platform.machine(), "processor": _cpu_model(),
           "platform": platform.platform(), "argv": [os.path.basename(sys.executable)] + sys.argv}
    try:
        import torch
        out["torch"] = torch.__version__
        out["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            out["gpu"] = torch.cuda.get_device_name(0)
    except Exception:   # (no torch, or a CUDA build without a usable driver)
        pass
    return out


if __name__ == "__main__":
    import json
    print(json.dumps(provenance(), indent=1))
