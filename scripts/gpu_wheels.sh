#!/usr/bin/env bash
# Here (with pip access): put into .whl/ the wheels a machine without an index needs to run
# scripts/run_gpu.sh with its own CUDA torch: mpi4py, the mpich wheel (mpirun), cffi, pycparser.
# PYVER: that machine's Python (default 3.12, the lent GPU machines' python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${PYVER:-3.12}
excl=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$excl")"
grep -qx '/.whl/' "$excl" 2>/dev/null || echo /.whl/ >> "$excl"
mkdir -p .whl
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 -d .whl \
    "mpi4py==4.1.2" "mpich==5.0.2" "cffi==2.1.1" "pycparser==3.12"
ls -la .whl
