#!/usr/bin/env bash
# Build the libFuzzer targets (clang, -fsanitize=fuzzer,address,undefined) and run each one.
#   tests/fuzz/run_fuzz.sh [SECONDS] [target...]          each target for SECONDS (default 60)
#   tests/fuzz/run_fuzz.sh --runs N [target...]          each target for N executions
#   tests/fuzz/run_fuzz.sh --runs 10000000               the release check: 10M executions per target
# Targets: fuzz_decode fuzz_merge fuzz_thc fuzz_qdecode. Corpora live in build/fuzz/corpus_<target>. Exits non-zero on
# the first crash (the input is kept as build/fuzz/<target>-crash-*). Without clang it installs
# Debian's (root) or says how; 77 (skip) when it cannot.
set -euo pipefail
LIMIT="-max_total_time=${1:-60}"
if [ "${1:-}" = "--runs" ]; then
  LIMIT="-runs=${2:?--runs needs a number}"
  shift 2
else
  shift || true
fi
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
OUT="${STELLA_FUZZ_BUILD:-$ROOT/build/fuzz}"
CC="${CLANG:-clang}"
TARGETS=("$@")
[ ${#TARGETS[@]} -eq 0 ] && TARGETS=(fuzz_decode fuzz_merge fuzz_thc fuzz_qdecode)
if ! command -v "$CC" >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "clang not found: installing Debian's (apt-get install -y clang)" >&2
  apt-get install -y -q clang >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q clang >/dev/null 2>&1; } || true
fi
command -v "$CC" >/dev/null || { echo "clang not found (apt-get install -y clang)" >&2; exit 77; }
mkdir -p "$OUT"
FLAGS=(-g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer
       -ffp-contract=off -fno-strict-aliasing -I"$ROOT/c_src")
# the library once, as objects built for fuzzing (no main)
OBJS=()
for src in "$ROOT"/c_src/*.c; do
  obj="$OUT/$(basename "${src%.c}").o"
  if [ ! -f "$obj" ] || [ "$src" -nt "$obj" ]; then
    "$CC" "${FLAGS[@]/-fsanitize=fuzzer,address,undefined/-fsanitize=fuzzer-no-link,address,undefined}" -c "$src" -o "$obj"
  fi
  OBJS+=("$obj")
done
for t in "${TARGETS[@]}"; do
  "$CC" "${FLAGS[@]}" "$ROOT/tests/fuzz/$t.c" "${OBJS[@]}" -lm -o "$OUT/$t"
  mkdir -p "$OUT/corpus_$t"
  echo "== $t ($LIMIT)"
  "$OUT/$t" "$LIMIT" -print_final_stats=1 -max_len=4096 -artifact_prefix="$OUT/$t-" "$OUT/corpus_$t" \
    > "$OUT/$t.log" 2>&1 || { tail -n 40 "$OUT/$t.log"; echo "== $t: CRASH (input kept in $OUT/$t-*)"; exit 1; }
  grep -E "^stat::number_of_executed_units|^stat::peak_rss_mb|Done [0-9]+ runs" "$OUT/$t.log" || tail -n 5 "$OUT/$t.log"
done
