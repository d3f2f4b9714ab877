#!/usr/bin/env bash
# On a GPU machine (after PARTS=setup bash scripts/run_gpu.sh has set up its venv): the byte-level LM of
# examples/train_horovod.py with CUDA tensors, 2 clusters of 1 rank sharing the GPU, the
# cross-cluster link paced at RATE bit/s, each mode for BUDGET seconds of training; JSON per mode
# and one log in $OUT (MODES: dense, auto, cacheaware, topk, thc4, cpu1, local8, local8-thc4,
# local8-sparseloco, diloco32-f4-thc4: torchft Streaming DiLoCo's recipe, H=32, 4 fragments, 3 steps in
# flight, outer Nesterov, THC 4 bits). bench/gpu_time_to_loss.py $OUT turns the JSONs into the time-to-loss table.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${STELLA_GPU_VENV:-/tmp/stella-gpu-venv}/bin/python
out=${OUT:-bench/results}; mkdir -p "$out"
RATE=${RATE:-100e6}; BUDGET=${BUDGET:-30}
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
common="--device cuda --hidden 2048 --batch-size 512 --time-budget $BUDGET --eval-seconds 3 --log-every 50"
for mode in ${MODES:-dense cacheaware topk thc4 cpu1}; do
    route=auto   # STELLA_WAN_ROUTE: what "--compression none" sends across clusters
    case $mode in
        dense) a="--compression none"; route=dense ;;
        auto) a="--compression none" ;;   # the automatic route: the adjuster picks (local steps included)
        cacheaware|topk) a="--compression $mode --density 0.01" ;;
        thc4) a="--compression thc --bits 4" ;;
        cpu1) a="--compression cacheaware --density 0.01 --engine cpu --staleness 1" ;;
        local8) a="--compression none --local-steps 8" ;;
        local8-thc4) a="--compression thc --bits 4 --local-steps 8 --outer nesterov" ;;
        local8-sparseloco) a="--compression sparseloco --density 0.01 --bits 2 --feedback-decay 0.95 --local-steps 8 \
--outer sum" ;;
        diloco32-f4-thc4) a="--compression thc --bits 4 --local-steps 32 --outer nesterov --fragments 4 \
--fragment-delay 3" ;;
        *) echo "gpu_train.sh: unknown mode '$mode'"; exit 2 ;;
    esac
    echo "== $mode: $a" | tee -a "$out/train.log"
    since=$(date +%s)
    timeout -k 10 $((BUDGET + 90)) "$(dirname "$PY")/mpirun" -np 2 -genv STELLA_CLUSTERS 2 -genv STELLA_WAN_PACE_BPS "$RATE" \
        -genv STELLA_WAN_ROUTE "$route" \
        "$PY" examples/train_horovod.py $common $a --json-out "$out/$mode.json" >>"$out/train.log" 2>&1
    echo "exit $?" | tee -a "$out/train.log"; grep -E "^done" "$out/train.log" | tail -1
    "$PY" -m stellarun --clean --since "$since" >/dev/null   # what plain mpirun leaves behind
done
