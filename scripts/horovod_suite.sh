#!/usr/bin/env bash
# Horovod's own PyTorch tests (test/parallel/test_torch.py) against stella_mpi, in one run, in
# order, as Horovod's CI runs them, under mpirun with 2 and 4 ranks (or the rank counts given).
#
#   bash scripts/horovod_suite.sh PATH_TO_HOROVOD_SOURCE [NP ...]
#
# Nothing of Horovod is kept in this repository: the test file, its test/utils/common.py and
# horovod/runner/util/threads.py (which common.py imports) are taken from the tree you name,
# into a scratch directory where `horovod.torch` is stella_mpi. The suite's own dependencies
# (cloudpickle, mock, packaging) are installed there too. Per-rank logs and JUnit files stay in
# the scratch directory, whose path is printed. GPU tests skip without a GPU.
# Settings: STELLA_TIMEOUT (default here 30 s), HOROVOD_SUITE_TIMEOUT (s per run, default 1800).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
src=${1:?usage: bash scripts/horovod_suite.sh PATH_TO_HOROVOD_SOURCE [NP ...]}
shift
nps=("$@")
[ ${#nps[@]} -gt 0 ] || nps=(2 4)
for f in test/parallel/test_torch.py test/utils/common.py horovod/runner/util/threads.py; do
  [ -f "$src/$f" ] || { echo "horovod_suite: $src/$f not found: name the root of a Horovod source tree" >&2; exit 2; }
done
py=$here/.venv/bin/python
mpirun=$here/.venv/bin/mpirun
[ -x "$py" ] && [ -x "$mpirun" ] || { echo "horovod_suite: run bash scripts/setup_env.sh first" >&2; exit 2; }

work=$(mktemp -d /tmp/horovod_suite.XXXXXX)
mkdir -p "$work/shim/horovod/torch" "$work/shim/horovod/runner/util" "$work/tests" "$work/deps"
: > "$work/shim/horovod/__init__.py"
: > "$work/shim/horovod/runner/__init__.py"
: > "$work/shim/horovod/runner/util/__init__.py"
cat > "$work/shim/horovod/torch/__init__.py" <<'EOF'
from stella_mpi import *  # noqa: F401,F403  (horovod.torch is stella_mpi for this run)
from stella_mpi import __version__  # noqa: F401
EOF
cp "$src/horovod/runner/util/threads.py" "$work/shim/horovod/runner/util/threads.py"
cp "$src/test/parallel/test_torch.py" "$src/test/utils/common.py" "$work/tests/"
"$py" -m pip install -q --disable-pip-version-check --target "$work/deps" cloudpickle mock packaging \
  >"$work/pip.log" 2>&1 || { echo "horovod_suite: could not install cloudpickle, mock, packaging (see $work/pip.log)" >&2; exit 2; }

cat > "$work/rank.sh" <<EOF
#!/usr/bin/env bash
out=\$1; shift
exec "$py" -m pytest -q -p no:cacheprovider --junitxml="\$out/rank\${PMI_RANK}.xml" "\$@" > "\$out/rank\${PMI_RANK}.log" 2>&1
EOF
chmod +x "$work/rank.sh"

status=0
for np in "${nps[@]}"; do
  out=$work/np$np
  mkdir -p "$out"
  echo "== Horovod's test_torch.py, $np ranks, in order (logs: $out)"
  since=$(date +%s)
  set +e
  (cd "$work/tests" && PYTHONPATH="$work/shim:$here:$work/deps:$work/tests" OMP_NUM_THREADS=1 \
     STELLA_TIMEOUT=${STELLA_TIMEOUT:-30} timeout "${HOROVOD_SUITE_TIMEOUT:-1800}" \
     "$mpirun" -np "$np" "$work/rank.sh" "$out" test_torch.py </dev/null)
  rc=$?
  set -e
  [ $rc -eq 0 ] || echo "   (mpirun exited with $rc)"
  "$py" -m stellarun --clean --since "$since" >/dev/null   # what plain mpirun leaves (stellarun does this itself)
  "$py" - "$out" "$np" <<'EOF' || status=1
import glob, sys, xml.etree.ElementTree as ET
out, np = sys.argv[1], int(sys.argv[2])
results = {}
for path in sorted(glob.glob(out + "/rank*.xml")):
    for tc in ET.parse(path).getroot().iter("testcase"):
        kids = {c.tag for c in tc}
        state = "failed" if kids & {"failure", "error"} else "skipped" if "skipped" in kids else "passed"
        # a test counts as passed only if it passed on every rank
        prev = results.get(tc.get("name"))
        rank_order = {"failed": 2, "skipped": 1, "passed": 0}
        if prev is None or rank_order[state] > rank_order[prev[0]]:
            msg = next(((c.get("message") or "").splitlines()[0][:160] for c in tc if c.tag in ("failure", "error")), "")
            results[tc.get("name")] = (state, msg)
counts = {s: sum(1 for v in results.values() if v[0] == s) for s in ("passed", "failed", "skipped")}
print("   %d ranks: %d passed, %d failed, %d skipped (of %d)" % (np, counts["passed"], counts["failed"],
                                                             counts["skipped"], len(results)))
for name, (state, msg) in sorted(results.items()):
    if state == "failed":
        print("     FAILED %s: %s" % (name, msg))
sys.exit(0 if results else 1)
EOF
done
echo "scratch directory: $work"
exit $status
