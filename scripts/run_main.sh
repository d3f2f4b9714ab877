#!/usr/bin/env bash
# Set everything up, then run the main job: Horovod-style training on 4 ranks in 2 clusters.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
exec stellarun -np 4 --clusters 2 python examples/train_horovod.py "$@"
