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
trap 'exit 130' INT TERM   # (then the EXIT trap ends the background runs, each a process group of its own)
if command -v cmake >/dev/null; then
    mkdir -p build
    set -m   # (a process group of its own: setup failing or the script interrupted ends it whole)
    c_tests > build/c_tests.log 2>&1 &
    c_pid=$!
    set +m
    trap '[ -n "$c_pid" ] && kill -- -"$c_pid" 2>/dev/null; true' EXIT
else
    echo "cmake not found: skipping the C tests under ctest (the Python tests still exercise the C core)"
fi
bash scripts/setup_env.sh
echo "run_tests.sh: set up in ${SECONDS} s"
. .venv/bin/activate
# every rank of every mpirun job is a fresh Python: where PYTHONDONTWRITEBYTECODE is set (this
# sandbox sets it), each compiled stella_mpi again and pytest rewrote the test modules again. The
# caches go to __pycache__, which git ignores
unset PYTHONDONTWRITEBYTECODE
if [ -n "$c_pid" ]; then
    if ! wait "$c_pid"; then
        cat build/c_tests.log
        echo "run_tests.sh: the C tests failed (build/c_tests.log)"
        exit 1
    fi
    c_pid=""
    grep -E "tests passed|Total Test time" build/c_tests.log || true
    echo "run_tests.sh: C tests done at ${SECONDS} s"
fi
started=$(date +%s)
if [ $# -gt 0 ]; then
    python -m pytest -q -m "not slow" --durations=25 "$@"
else
    # the tests that launch no mpirun job (tests/unit: in-process, or single-process subprocesses;
    # the docs site's build) run in a second pytest beside the rest, whose jobs of 2-4 ranks leave
    # a core idle much of the time (one pytest for all: 8m52s, the fresh clone 10m42s on a 2-core
    # machine; split: 7m30s beside 2m32s, 9m35s; 10m27s on a slower stretch). The sweep of MPICH
    # files left behind (tests/conftest.py) is the rest's alone: the second run's could take a
    # file of a job that is starting.
    beside=(tests/unit tests/test_docs.py)
    mkdir -p build
    set -m
    STELLA_TESTS_NO_SWEEP=1 python -m pytest -q -m "not slow" -p no:cacheprovider "${beside[@]}" \
        < /dev/null > build/beside_tests.log 2>&1 &
    beside_pid=$!
    set +m
    trap '[ -n "$c_pid" ] && kill -- -"$c_pid" 2>/dev/null
          [ -n "$beside_pid" ] && kill -- -"$beside_pid" 2>/dev/null; true' EXIT
    rest=0
    python -m pytest -q -m "not slow" --durations=25 "${beside[@]/#/--ignore=}" || rest=$?
    other=0
    wait "$beside_pid" || other=$?
    beside_pid=""
    if [ "$other" -ne 0 ]; then
        cat build/beside_tests.log
        echo "run_tests.sh: ${beside[*]} failed (exit $other; build/beside_tests.log)"
    else
        echo "${beside[*]}, beside the rest: $(tail -n 1 build/beside_tests.log)"
    fi
    [ "$rest" -eq 0 ] && [ "$other" -eq 0 ] || exit 1
fi
# nothing left behind: no MPICH segment or hydra topology file made during the run stays unused
python - "$started" <<'EOF'
import sys
from stellarun import leftovers
left = set(leftovers.candidates(since=float(sys.argv[1]) - 1)) - leftovers.in_use()
if left:
    sys.exit("run_tests.sh: the test run left MPICH files behind: %s" % ", ".join(sorted(left)))
print("run_tests.sh: no MPICH files left behind")
EOF
