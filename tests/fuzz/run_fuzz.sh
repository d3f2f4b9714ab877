#!/usr/bin/env bash
# Build the libFuzzer targets (clang, -fsanitize=fuzzer,address,undefined) and
# run each for SECONDS (default 60). Usage: tests/fuzz/run_fuzz.sh [SECONDS] [target...]
# Targets: fuzz_decode fuzz_merge. Corpora live in build/fuzz/corpus_<target>.
set -euo pipefail
SECONDS_EACH="${1:-60}"
shift || true
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
OUT="${STELLA_FUZZ_BUILD:-$ROOT/build/fuzz}"
CC="${CLANG:-clang}"
TARGETS=("$@")
[ ${#TARGETS[@]} -eq 0 ] && TARGETS=(fuzz_decode fuzz_merge)
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
  echo "== $t for ${SECONDS_EACH}s"
  "$OUT/$t" -max_total_time="$SECONDS_EACH" -print_final_stats=1 -max_len=4096 -artifact_prefix="$OUT/$t-" "$OUT/corpus_$t" 2>&1 | tail -n 12
done
