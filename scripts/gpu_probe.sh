#!/usr/bin/env bash
# On a GPU machine: set up as scripts/run_gpu.sh does, then run the device-route and NCCL suites
# under mpirun on 2 ranks (2 clusters sharing the GPU, then 1 cluster staged), each bounded, each
# logged to $OUT, without stopping at the first failure. PARTS picks: tests bench
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${STELLA_GPU_VENV:-/tmp/stella-gpu-venv}
out=${OUT:-bench/results}; mkdir -p "$out"
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
    parent=$("$PY" -c "import site; print('\n'.join(site.getsitepackages()))")
    own=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    echo "$parent" > "$own/stella-parent-site.pth"
    "$VENV/bin/python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl
fi
PY="$VENV/bin/python"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 STELLA_MPI_SUITE=1 STELLA_TIMEOUT=60
"$PY" setup.py -q build_ext --inplace >/dev/null 2>"$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
"$PY" -c "import torch, mpi4py, stella_mpi; print('torch', torch.__version__, torch.version.cuda, 'nccl', torch.cuda.nccl.version(), torch.cuda.get_device_name(0), 'x', torch.cuda.device_count(), 'mpi4py', mpi4py.__version__)"
MPIRUN="$(dirname "$PY")/mpirun"
suite() {  # name clusters timeout files...
    local name=$1 cl=$2 to=$3; shift 3
    local t0=$SECONDS
    STELLA_CLUSTERS=$cl timeout -k 10 "$to" "$MPIRUN" -np 2 "$PY" -m mpi4py -m pytest -q -rfEs -p no:cacheprovider "$@" \
        >"$out/$name.log" 2>&1
    echo "== $name: exit $? in $((SECONDS - t0)) s"; grep -E "passed|failed|error" "$out/$name.log" | tail -3
}
for part in ${PARTS:-tests bench}; do
  case $part in
    tests)
      suite dev2 2 240 tests/mpi/test_device_route.py tests/mpi/test_nccl.py
      suite dev1 1 240 tests/mpi/test_device_route.py tests/mpi/test_nccl.py ;;
    gpu)   # the gpu-marked tests as scripts/run_gpu.sh runs them
      t0=$SECONDS
      timeout -k 10 ${GPU_TIMEOUT:-420} "$PY" -m pytest -q -rfEs -m gpu -p no:cacheprovider tests/test_gpu.py >"$out/gpu_tests.log" 2>&1
      echo "== gpu tests: exit $? in $((SECONDS - t0)) s"; tail -5 "$out/gpu_tests.log" ;;
    cpu)
      suite cpu2 2 300 tests/mpi/test_sparse.py tests/mpi/test_cpu_engine.py ;;
    bench)
      t0=$SECONDS
      timeout -k 10 ${BENCH_TIMEOUT:-300} "$PY" bench/bench_gpu.py --out "$out/gpu.json" ${BENCH_ARGS:-} >"$out/bench.log" 2>&1
      echo "== bench: exit $? in $((SECONDS - t0)) s"; tail -25 "$out/bench.log" ;;
  esac
done
