#!/usr/bin/env bash
# Set everything up, then run the main job: 2 clusters of 2 ranks over an emulated 100 Mbit/s WAN,
# sparse exchange vs dense gradients, side by side.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
exec python examples/wan_main_job.py "$@"
