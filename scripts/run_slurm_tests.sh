#!/usr/bin/env bash
# Set everything up, install Slurm from Debian's packages (slurmctld, slurmd, munge; needs root
# and the package index), then run the Slurm tests: examples/slurm/ on a local two-node Slurm
# (tests/slurm_local.py). The default test command runs the same tests when Slurm is installed
# and skips them otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
    if [ "$(id -u)" != 0 ]; then
        echo "run_slurm_tests.sh: Slurm is not installed and installing it needs root" >&2
        exit 1
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurmctld slurmd slurm-client munge >/dev/null \
        || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurmctld slurmd \
             slurm-client munge >/dev/null; }
fi
. .venv/bin/activate
python -m pytest -q -rs -m slurm tests/test_slurm.py "$@"
