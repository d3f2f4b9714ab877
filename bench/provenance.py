"""What produced a bench result: the commit (and whether the tree had changes), the versions of
Python, torch, mpi4py and the MPI library, and the machine (cores, GPU). Every bench JSON that
records it carries it under "provenance"."""
import os
import platform
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _git(*args):
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def provenance():
    out = {"commit": _git("rev-parse", "HEAD") or None, "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
           "python": platform.python_version(), "machine": platform.machine(), "cores": os.cpu_count(),
           "platform": platform.platform()}
    try:
        import torch
        out["torch"] = torch.__version__
        out["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        out["torch"] = None
    try:
        import mpi4py
        out["mpi4py"] = mpi4py.__version__
        from mpi4py import MPI
        out["mpi"] = MPI.Get_library_version().strip().splitlines()[0]
    except Exception:   # (MPI may be unusable outside a launcher: the rest still says what ran)
        out.setdefault("mpi4py", None)
    out["argv"] = [os.path.basename(sys.executable)] + sys.argv
    return out
