#!/usr/bin/env bash
# On a machine with CUDA: the GPU tests (marker gpu) and the GPU benchmark (bench/bench_gpu.py),
# with that machine's python3 and its CUDA torch (no virtual environment: torch stays its own).
# Without an index, first run scripts/gpu_wheels.sh where pip works and bring .whl/ along.
# Results: bench/results/gpu.json (or $OUT/gpu.json when OUT is set), and the test log.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${STELLA_GPU_VENV:-/tmp/stella-gpu-venv}
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    # a venv that sees this python's packages (its CUDA torch, through a .pth file: this python may
    # itself be a venv) and holds the carried wheels; mpi4py finds the mpich wheel's libmpi in it
    if [ ! -x "$VENV/bin/python" ]; then
        "$PY" -m venv "$VENV"
        parent=$("$PY" -c "import site; print('\n'.join(site.getsitepackages()))")
        own=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
        echo "$parent" > "$own/stella-parent-site.pth"
    fi
    "$VENV/bin/python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl
    PY="$VENV/bin/python"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" setup.py -q build_ext --inplace >/dev/null
"$PY" -c "import torch, stella_mpi; assert torch.cuda.is_available(), 'no CUDA: nothing to run here'; \
print('torch', torch.__version__, 'on', torch.cuda.get_device_name(0), 'x', torch.cuda.device_count())"
out=${OUT:-bench/results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
"$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$out/gpu_tests.log"
"$PY" bench/bench_gpu.py --out "$out/gpu.json" "$@" 2>&1 | tee "$out/gpu_bench.log"
