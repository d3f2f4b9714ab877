#!/usr/bin/env bash
# Horovod's elastic PyTorch examples (examples/elastic/pytorch of a Horovod source tree) under
# stellarun --elastic with only their import changed, each through a revocation and a return
# (tests/horovod_elastic_examples.py says how).
#
#   bash scripts/horovod_elastic_examples.sh PATH_TO_HOROVOD_SOURCE [--only synthetic|mnist|imagenet ...]
#
# The examples need torchvision, which the project does not depend on and which has no build for
# the local CPU torch (torchvision 0.28.0 from PyPI fails on torch 2.13.0+cpu: "operator
# torchvision::nms does not exist"). So they run in a Python of their own, .venv-examples, with
# torch and torchvision from the package registry (the CUDA build: about 5.5 GB on disk, made
# once), tqdm and tensorboard (the ImageNet example's), and stella_mpi's own dependencies;
# stella_mpi comes from this checkout (its C extension as built by scripts/setup_env.sh).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
src=${1:?usage: bash scripts/horovod_elastic_examples.sh PATH_TO_HOROVOD_SOURCE [--only NAME ...]}
shift
[ -d "$src/examples/elastic/pytorch" ] || { echo "horovod_elastic_examples: $src/examples/elastic/pytorch not found: name the root of a Horovod source tree" >&2; exit 2; }
ls "$here"/stella_mpi/_native/_stella*.so >/dev/null 2>&1 || { echo "horovod_elastic_examples: run bash scripts/setup_env.sh first (stella_mpi's C extension is not built)" >&2; exit 2; }
venv=$here/.venv-examples
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import torchvision, tqdm, torch.utils.tensorboard, mpi4py, cffi" 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check torch torchvision tqdm tensorboard mpi4py mpich cffi numpy
fi
cd "$here/tests"
exec "$venv/bin/python" horovod_elastic_examples.py "$src" --python "$venv/bin/python" "$@"
