#!/usr/bin/env bash
# The long tier of the Python tests (pytest -m slow): layouts, convergence runs and fault cases
# that repeat what the default run (scripts/run_tests.sh) covers another way, kept out of it so
# that it stays within CI's 10 minutes. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
python -m pytest -q -m slow --durations=25 "$@"
