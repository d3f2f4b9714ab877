"""The package as a user gets it: `python -m build` makes an sdist (with the C sources and
headers) and, from that sdist, a wheel with the compiled C core; the wheel installs into a fresh
virtual environment, where `import stella_mpi` is the installed copy (not this checkout), and
the installed `stellarun` command trains the Horovod example on 2 clusters from a directory
with no source tree in sight.

The fresh environment sees the dependencies already installed here (torch, numpy, cffi, mpi4py,
mpich) through one line in a .pth file naming this environment's site-packages: such a line
adds the directory to sys.path but does not run the .pth files inside it, so the editable
install of this checkout (its __editable__ finder) stays off. mpich's launchers (mpirun, hydra)
are linked into the fresh environment's bin/, where `pip install mpich` would have put them.
Nothing is downloaded: the build runs without isolation (setuptools, wheel and cffi from this
environment) and pip installs the one wheel file with --no-index --no-deps."""
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile

import pytest

from mpi_launch import ROOT

# (slow: a fresh venv and a wheel build; the default run imports the package from the tree)
pytestmark = [pytest.mark.mpi, pytest.mark.slow]



def _outside_site_packages(dist):
    """The files the installed distribution ``dist`` put outside site-packages (the mpich wheel:
    bin/mpirun and hydra, lib/libmpi.so and the libraries it loads), which a .pth line does not
    make visible: mpi4py looks for libmpi under sys.prefix, stellarun for mpirun next to Python."""
    from importlib import metadata
    files = metadata.distribution(dist).files or []
    out = [os.path.realpath(f.locate()) for f in files if str(f).startswith("..")]
    return [p for p in out if os.path.exists(p) and p.startswith(os.path.realpath(sys.prefix) + os.sep)]


def _run(cmd, timeout, **kwargs):
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)
    except subprocess.TimeoutExpired as e:
        pytest.fail("%s timed out after %ds\n%s\n%s" % (" ".join(map(str, cmd)), timeout, e.stdout, e.stderr))
    assert proc.returncode == 0, "%s failed (%d)\n%s\n%s" % (" ".join(map(str, cmd)), proc.returncode,
                                                             proc.stdout[-4000:], proc.stderr[-4000:])
    return proc


def test_wheel_installs_in_a_fresh_venv_and_trains_under_stellarun(tmp_path):
    if importlib.util.find_spec("build") is None:
        pytest.skip("the build package is not installed (pip install build; it is in the test extra)")
    here_bin = os.path.dirname(sys.executable)
    if not os.path.exists(os.path.join(here_bin, "mpirun")):
        pytest.skip("no mpich wheel in this environment (its mpirun is linked into the fresh one)")

    # 1. sdist, then the wheel built from that sdist (so the sdist must hold all the build needs)
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), ROOT], timeout=600, cwd=ROOT)
    sdists = list(dist.glob("stella_mpi-*.tar.gz"))
    wheels = list(dist.glob("stella_mpi-*.whl"))
    assert len(sdists) == 1 and len(wheels) == 1, os.listdir(dist)
    with tarfile.open(sdists[0]) as t:
        names = t.getnames()
    for src in ("c_src/stella_common.h", "c_src/thc.c", "LICENSE", "README.md", "setup.py", "pyproject.toml",
                "stella_mpi/_native/build_ffi.py", "stella_mpi/base/version.py"):
        assert any(n.endswith("/" + src) for n in names), src
    with zipfile.ZipFile(wheels[0]) as z:
        names = z.namelist()
        metadata = z.read([n for n in names if n.endswith(".dist-info/METADATA")][0]).decode()
    assert any(n.startswith("stella_mpi/_native/_stella") and n.endswith(".so") for n in names), names
    assert "stellarun/cli.py" in names and not any(n.startswith(("tests/", "bench/", "c_src/")) for n in names)
    assert "License-Expression: MIT" in metadata and "Provides-Extra: test" in metadata

    # 2. a fresh venv that sees this one's installed packages, but not this checkout
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], timeout=120)
    vpy = str(venv / "bin" / "python")
    purelib = _run([vpy, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], timeout=60).stdout.strip()
    here_site = sysconfig.get_paths()["purelib"]
    with open(os.path.join(purelib, "_outer_env.pth"), "w") as f:
        f.write(here_site + "\n")
    for src in _outside_site_packages("mpich"):
        dest = venv / os.path.relpath(src, sys.prefix)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if not dest.exists():
            os.symlink(src, dest)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "STELLA_", "VIRTUAL_ENV"))}
    env["PATH"] = os.pathsep.join([str(venv / "bin")] + [p for p in os.environ.get("PATH", "").split(os.pathsep)
                                                          if p and os.path.realpath(p) != os.path.realpath(here_bin)])
    env.update({"VIRTUAL_ENV": str(venv), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    work = tmp_path / "work"
    work.mkdir()

    # pip is this environment's (through the .pth line); --ignore-installed: the editable
    # install's metadata is visible too, and must be neither "already satisfied" nor uninstalled
    _run([vpy, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed", str(wheels[0])],
         timeout=300, cwd=work, env=env)
    where = _run([vpy, "-c", "import stella_mpi, stellarun, stella_mpi._native as n; print(stella_mpi.__file__); "
                  "print(stellarun.__file__); print(stella_mpi.__version__); print(n.simd_levels_available())"],
                 timeout=120, cwd=work, env=env).stdout.split("\n")
    for path in where[:2]:
        assert path.startswith(purelib + os.sep), (path, purelib)
        assert not os.path.realpath(path).startswith(os.path.realpath(ROOT) + os.sep), path
    with open(os.path.join(ROOT, "stella_mpi", "base", "version.py")) as f:
        assert where[2] == f.read().split("__version__ = ")[1].split()[0].strip("\"'")

    # 3. the installed stellarun trains the example (copied next to its data helper) on 2 clusters
    for name in ("train_horovod.py", "stdlib_text.py"):
        shutil.copy(os.path.join(ROOT, "examples", name), work / name)
    stellarun = str(venv / "bin" / "stellarun")
    assert os.path.exists(stellarun)
    proc = subprocess.run([stellarun, "-np", "2", "--clusters", "2", "--timeout", "120", vpy, "train_horovod.py",
                           "--steps", "30", "--log-every", "10", "--hidden", "128"],
                          cwd=work, env=env, capture_output=True, text=True, timeout=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "2 ranks in 2 clusters" in out, out[-4000:]
    assert "parameters identical on all 2 ranks: True" in out, out[-4000:]
    losses = [float(line.split("loss")[1].split()[0]) for line in out.splitlines() if line.startswith("step")]
    assert len(losses) >= 2 and losses[-1] < losses[0], out[-4000:]
