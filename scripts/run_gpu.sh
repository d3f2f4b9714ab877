#!/usr/bin/env bash
# On a machine with CUDA: the GPU tests (marker gpu) and the GPU benchmark (bench/bench_gpu.py),
# with that machine's python3 and its CUDA torch (no index there: first run scripts/gpu_wheels.sh
# where pip works and bring .whl/ along; a venv that sees the machine's own torch gets them).
# Each part is bounded and logged to $OUT (else bench/results); a failure does not stop the
# next part. STELLA_COMMIT=<hash> names the commit in the bench JSONs' provenance (the device's copy
# of .git may be older than the tree it was sent). PARTS (default "gpu bench") picks among:
#   setup   only the venv and the C extension (what scripts/gpu_train.sh needs)
#   gpu     pytest -m gpu tests/test_gpu.py (the device-route and NCCL suites under mpirun)
#   suites  the same suites launched directly, 2 clusters and then 1 cluster staged, one log each
#   bench   bench/bench_gpu.py with BENCH_ARGS (or this script's arguments)
#   overhead  bench/bench_overhead.py --device cuda with OVERHEAD_ARGS (the backend's time per route)
#   ddp     tests/mpi/test_ddp.py on CUDA (2 clusters sharing the GPU, DDP over gloo), then the DDP hook
#           against the Horovod-API path (examples/train_ddp.py, train_horovod.py: dense, cache-aware 1 %,
#           the automatic route; DDP_STEPS, DDP_HIDDEN)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${STELLA_GPU_VENV:-/tmp/stella-gpu-venv}
out=${OUT:-bench/results}; mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
    if [ ! -x "$VENV/bin/python" ]; then
        # this python's packages (its CUDA torch) through a .pth file: it may itself be a venv
        "$PY" -m venv "$VENV"
        parent=$("$PY" -c "import site; print('\n'.join(site.getsitepackages()))")
        own=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
        echo "$parent" > "$own/stella-parent-site.pth"
        "$VENV/bin/python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl
    fi
    PY="$VENV/bin/python"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$PY" setup.py -q build_ext --inplace >/dev/null 2>"$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
"$PY" -c "import torch, mpi4py, stella_mpi; assert torch.cuda.is_available(), 'no CUDA: nothing to run here'; \
print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'NCCL', torch.cuda.nccl.version(), 'on', \
torch.cuda.get_device_name(0), 'x', torch.cuda.device_count(), '; mpi4py', mpi4py.__version__)" || exit 1
MPIRUN="$(dirname "$PY")/mpirun"
[ -x "$MPIRUN" ] || MPIRUN=mpirun
suite() {  # log-name clusters timeout files...
    local name=$1 cl=$2 to=$3; shift 3
    local t0=$SECONDS since rc
    since=$(date +%s)
    STELLA_CLUSTERS=$cl OMP_NUM_THREADS=1 STELLA_MPI_SUITE=1 STELLA_TIMEOUT=60 timeout -k 10 "$to" \
        "$MPIRUN" -np 2 "$PY" -m mpi4py -m pytest -q -rfEs -p no:cacheprovider "$@" >"$out/$name.log" 2>&1
    rc=$?
    "$PY" -m stellarun --clean --since "$since" >/dev/null   # what plain mpirun leaves behind
    echo "== $name: exit $rc in $((SECONDS - t0)) s"; grep -E "passed|failed|error" "$out/$name.log" | tail -3
}
status=0
for part in ${PARTS:-gpu bench}; do
    t0=$SECONDS
    case $part in
        setup) ;;
        gpu)
            timeout -k 10 "${GPU_TIMEOUT:-900}" "$PY" -m pytest -q -rfEs -m gpu -p no:cacheprovider tests/test_gpu.py \
                >"$out/gpu_tests.log" 2>&1 || status=1
            echo "== gpu tests: $((SECONDS - t0)) s"; tail -5 "$out/gpu_tests.log" ;;
        suites)
            suite dev2 2 300 tests/mpi/test_device_route.py tests/mpi/test_nccl.py
            suite dev1 1 300 tests/mpi/test_device_route.py tests/mpi/test_nccl.py ;;
        bench)
            timeout -k 10 "${BENCH_TIMEOUT:-3000}" "$PY" bench/bench_gpu.py --out "$out/gpu.json" ${BENCH_ARGS:-"$@"} \
                >"$out/gpu_bench.log" 2>&1 || status=1
            echo "== bench: $((SECONDS - t0)) s"; tail -25 "$out/gpu_bench.log" ;;
        overhead)
            timeout -k 10 "${OVERHEAD_TIMEOUT:-1800}" "$PY" bench/bench_overhead.py --device cuda --out "$out/overhead_gpu.json" \
                ${OVERHEAD_ARGS:-} >"$out/overhead_gpu.log" 2>&1 || status=1
            echo "== overhead: $((SECONDS - t0)) s"; tail -25 "$out/overhead_gpu.log" ;;
        ddp)
            suite ddp 2 300 tests/mpi/test_ddp.py
            for run in "horovod_dense dense train_horovod.py --compression none --optimizer sgd" \
                       "ddp_dense dense train_ddp.py --compression none" \
                       "horovod_ca1 auto train_horovod.py --compression cacheaware --density 0.01 --optimizer sgd" \
                       "ddp_ca1 auto train_ddp.py --compression cacheaware --density 0.01" \
                       "horovod_auto auto train_horovod.py --compression none --optimizer sgd" \
                       "ddp_auto auto train_ddp.py --compression auto"; do
                set -- $run; tag="ddp_gpu_$1"; route=$2; shift 2
                STELLA_CLUSTERS=2 timeout -k 10 300 "$PY" -m stellarun -np 2 --clusters 2 --wan-route "$route" \
                    "$PY" "examples/$@" --device cuda --steps "${DDP_STEPS:-300}" --hidden "${DDP_HIDDEN:-4096}" \
                    --lr 0.05 --log-every 100 --json-out "$out/$tag.json" >"$out/$tag.log" 2>&1 || status=1
                echo "== $tag: $(grep -E '^done' "$out/$tag.log" || tail -3 "$out/$tag.log")"
            done ;;
        *) echo "run_gpu.sh: unknown part '$part' (setup, gpu, suites, bench, overhead, ddp)"; exit 2 ;;
    esac
done
exit $status
