#!/usr/bin/env bash
# Set everything up, then run the C tests (plain, with ASan+UBSan, with TSan) and the Python tests.
# Long runs (fuzzing, WAN benchmarks) have their own commands; see docs/results/benchmarks.md.
set -euo pipefail
cd "$(dirname "$0")/.."
c_tests() {
    for variant in release asan tsan; do
        flags=""
        [ "$variant" = asan ] && flags="-DSTELLA_SANITIZE=ON"
        [ "$variant" = tsan ] && flags="-DSTELLA_TSAN=ON"
        cmake -S . -B "build/$variant" -DCMAKE_BUILD_TYPE=Release $flags >/dev/null
        cmake --build "build/$variant" -j2 >/dev/null
        (cd "build/$variant" && ctest --output-on-failure -j2)
    done
}
# the C tests need only cmake and a compiler: they build and run while pip fills the venv
# (about 40 s of the fresh clone's 9 minutes)
c_pid=""
if command -v cmake >/dev/null; then
    mkdir -p build
    set -m   # (a process group of its own: setup failing or the script interrupted ends it whole)
    c_tests > build/c_tests.log 2>&1 &
    c_pid=$!
    set +m
    trap '[ -n "$c_pid" ] && kill -- -"$c_pid" 2>/dev/null; true' EXIT
    trap 'exit 130' INT TERM
else
    echo "cmake not found: skipping the C tests under ctest (the Python tests still exercise the C core)"
fi
bash scripts/setup_env.sh
. .venv/bin/activate
if [ -n "$c_pid" ]; then
    if ! wait "$c_pid"; then
        cat build/c_tests.log
        echo "run_tests.sh: the C tests failed (build/c_tests.log)"
        exit 1
    fi
    c_pid=""
    grep -E "tests passed|Total Test time" build/c_tests.log || true
fi
started=$(date +%s)
python -m pytest -q -m "not slow" --durations=25 "$@"
# nothing left behind: no MPICH segment or hydra topology file made during the run stays unused
python - "$started" <<'EOF'
import sys
from stellarun import leftovers
left = set(leftovers.candidates(since=float(sys.argv[1]) - 1)) - leftovers.in_use()
if left:
    sys.exit("run_tests.sh: the test run left MPICH files behind: %s" % ", ".join(sorted(left)))
print("run_tests.sh: no MPICH files left behind")
EOF
