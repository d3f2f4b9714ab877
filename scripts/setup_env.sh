#!/usr/bin/env bash
# Create .venv (if missing) with everything stella_mpi needs, and build the C core.
# Needs only Python 3.11 with venv and a C compiler (a fresh Debian machine has both).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip setuptools wheel
# one resolve for all of it (each pip call resolves and checks the whole environment again):
# - torch 2.13.0 is the local CPU build; asking for any other version pulls GBs of CUDA packages
# - the plot extra: the main job's PNG and bench/report.py (stella_mpi itself never imports it)
# - the docs extra: mkdocs build --strict runs in the default tests
# - the test extra's wheel builder (tests/test_wheel.py) and the lightning extra (tests/test_lightning.py)
python -m pip install -q "torch==2.13.0" numpy "cffi>=1.16" "mpi4py>=4" mpich pytest pytest-benchmark hypothesis \
    matplotlib \
    mkdocs mkdocs-material "mkdocstrings[python]" \
    build lightning
python -m pip install -q --no-build-isolation -e .
python -c "import stella_mpi, stella_mpi._native as n; print('stella_mpi ready; SIMD paths:', n.simd_levels_available())"
