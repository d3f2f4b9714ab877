"""Horovod's elastic PyTorch examples under ``stellarun --elastic``, with only their import
changed, each through a revocation and a return:

    bash scripts/horovod_elastic_examples.sh PATH_TO_HOROVOD_SOURCE     # makes the Python, runs this
    PY tests/horovod_elastic_examples.py PATH_TO_HOROVOD_SOURCE [--only mnist] [--keep]

PY must have torchvision (and tqdm and tensorboard for the ImageNet example) beside stella_mpi's
dependencies; stella_mpi itself is taken from this checkout (PYTHONPATH). Nothing of Horovod is
kept in this repository: each example is read from the tree you name (examples/elastic/pytorch)
and written to a scratch directory with ``import horovod.torch as hvd`` replaced by ``import
stella_mpi as hvd`` (the one changed line is checked). No data is downloaded: MNIST is generated
in its own idx format (random images, labels from a fixed rule) where the example looks for it,
ImageNet as an ImageFolder of small random JPEGs.

For each example: 2 ranks on two pretend hosts of this machine (``localhost`` = cluster a,
``127.0.0.1`` = cluster b). Once it trains, 127.0.0.1 is revoked (left out of discovery, its
worker SIGKILLed); once the survivor goes on alone, the host is put back and must rejoin; the job
must end with exit 0. Prints one line per example (with the seconds from the kill to the
survivor's start, and from the return to the rejoin) and exits 1 if any failed.
"""
import argparse
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np

import elastic_harness as eh

IMPORT = "import horovod.torch as hvd"
EXAMPLES = {   # name: (file, arguments, a line that shows training is under way)
    "synthetic": ("pytorch_synthetic_benchmark_elastic.py",
                  ["--no-cuda", "--model", "mobilenet_v3_small", "--batch-size", "4", "--num-warmup-batches", "2",
                   "--num-batches-per-iter", "2", "--num-iters", "60"], r"Iter #\d+"),
    "mnist": ("pytorch_mnist_elastic.py", ["--no-cuda", "--epochs", "3", "--batch-size", "16",
                                           "--log-interval", "5"], r"Train Epoch: 1 \[\d+"),
    "imagenet": ("pytorch_imagenet_resnet50_elastic.py",
                 ["--no-cuda", "--epochs", "4", "--batch-size", "2", "--val-batch-size", "2",
                  "--batches-per-commit", "2", "--batches-per-host-check", "1", "--warmup-epochs", "1"],
                 r"Train Epoch|train loss|\d+/\d+ \["),
}


def rewrite(src, dst):
    """The example with its Horovod import replaced (exactly one line changes)."""
    with open(src) as f:
        lines = f.read().split("\n")
    hits = [i for i, line in enumerate(lines) if line.strip() == IMPORT]
    if len(hits) != 1:
        raise SystemExit("%s: expected one line %r, found %d" % (src, IMPORT, len(hits)))
    lines[hits[0]] = lines[hits[0]].replace(IMPORT, "import stella_mpi as hvd")
    with open(dst, "w") as f:
        f.write("\n".join(lines))


def write_mnist(root, n_train=2048, n_test=512, seed=0):
    """MNIST's four idx files (uncompressed, where torchvision looks first): random 28x28
    images whose label is the brightest of ten fixed regions, so that there is something to learn."""
    raw = os.path.join(root, "MNIST", "raw")
    os.makedirs(raw, exist_ok=True)
    rng = np.random.default_rng(seed)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 120, size=(n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n, dtype=np.uint8)
        for i, y in enumerate(labels):
            r, c = divmod(int(y), 5)
            images[i, 4 + 10 * r:12 + 10 * r, 1 + 5 * c:5 + 5 * c] = 255
        with open(os.path.join(raw, "%s-images-idx3-ubyte" % prefix), "wb") as f:
            f.write(struct.pack(">IIII", 2051, n, 28, 28) + images.tobytes())
        with open(os.path.join(raw, "%s-labels-idx1-ubyte" % prefix), "wb") as f:
            f.write(struct.pack(">II", 2049, n) + labels.tobytes())


def write_imagefolder(root, classes=4, per_class=8, seed=0):
    """An ImageFolder of small random JPEGs (pillow comes with torchvision)."""
    from PIL import Image
    rng = np.random.default_rng(seed)
    for c in range(classes):
        folder = os.path.join(root, "class%d" % c)
        os.makedirs(folder, exist_ok=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, size=(48, 48, 3), dtype=np.uint8)
            pixels[..., c % 3] = 40 + 50 * c
            Image.fromarray(pixels).save(os.path.join(folder, "%d.jpg" % i))


def run_example(name, horovod_src, python, work):
    file, extra, under_way = EXAMPLES[name]
    script = os.path.join(work, file)
    rewrite(os.path.join(horovod_src, "examples", "elastic", "pytorch", file), script)
    if name == "mnist":
        write_mnist(os.path.join(work, "data"))
        extra = extra + ["--data-dir", os.path.join(work, "data")]
    if name == "imagenet":
        write_imagefolder(os.path.join(work, "train"))
        write_imagefolder(os.path.join(work, "val"), seed=1)
        extra = extra + ["--train-dir", os.path.join(work, "train"), "--val-dir", os.path.join(work, "val"),
                         "--log-dir", os.path.join(work, "logs"),
                         "--checkpoint-format", os.path.join(work, "checkpoint-{epoch}.pth.tar")]
    listing, discover = eh.discovery(work, [("localhost", 1), ("127.0.0.1", 1)])
    log = os.path.join(work, "job.log")
    env = dict(os.environ, PYTHONPATH=eh.ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), HOME=work)
    cmd = [python, "-m", "stellarun", "--elastic", "-np", "2", "--min-np", "1", "--host-discovery-script", discover,
           "--cluster-of", "localhost=a", "--cluster-of", "127.0.0.1=b", "--timeout", "60", python, script] + extra
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=work, env=env, start_new_session=True)
        try:
            return _revoke_and_return(proc, log, listing, file, under_way)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _revoke_and_return(proc, log, listing, file, under_way):
    def seen(pattern):
        return re.search(pattern, eh.read(log))

    def step(what, pattern, timeout):
        if not eh.wait(lambda: seen(pattern) or proc.poll() is not None, timeout, poll=0.2) or not seen(pattern):
            raise RuntimeError("%s: not seen within %d s (exit %s)" % (what, timeout, proc.poll()))
    try:
        step("training under way", under_way, 600)
        victims = eh.workers("127.0.0.1", script=file)
        if not victims:
            raise RuntimeError("no worker of host 127.0.0.1 found")
        eh.write_hosts(listing, [("localhost", 1)])
        t_kill = time.time()
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        step("the survivor going on alone", r"incarnation after 1 reset\(s\) on 1 host\(s\)", 120)
        t_alone = time.time()
        eh.write_hosts(listing, [("localhost", 1), ("127.0.0.1", 1)])
        step("the returning host rejoining", r"incarnation after 2 reset\(s\) on 2 host\(s\)", 300)
        t_back = time.time()
        rc = proc.wait(timeout=1200)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        return "FAILED: %s\n%s" % (e, eh.read(log)[-3000:])
    if rc != 0:
        return "FAILED: exit %d\n%s" % (rc, eh.read(log)[-3000:])
    return "ok (survivor resumed %.1f s after the kill; rejoined %.1f s after the host came back)" % (
        t_alone - t_kill, t_back - t_alone)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("horovod_src")
    p.add_argument("--python", default=sys.executable, help="a Python with torchvision (default: this one)")
    p.add_argument("--only", choices=sorted(EXAMPLES), action="append")
    p.add_argument("--keep", action="store_true", help="keep the scratch directories (their paths are printed)")
    args = p.parse_args()
    failures = 0
    for name in args.only or list(EXAMPLES):
        work = tempfile.mkdtemp(prefix="hvd-elastic-%s-" % name)
        t0 = time.time()
        outcome = run_example(name, args.horovod_src, args.python, work)
        failures += outcome.startswith("FAILED")
        print("%-10s %s (%.0f s)%s" % (name, outcome, time.time() - t0, "  [%s]" % work if args.keep else ""),
              flush=True)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
