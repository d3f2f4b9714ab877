"""A few seconds of the libFuzzer targets (decode, merge, THC lanes, quantised payloads) with ASan+UBSan;
skipped cleanly when clang or its libFuzzer runtime is missing. The long runs:
tests/fuzz/run_fuzz.sh SECONDS."""
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "fuzz", "run_fuzz.sh")


def _has_libfuzzer(tmp_path):
    clang = shutil.which("clang")
    if not clang:
        return False
    src = tmp_path / "probe.c"
    src.write_text("#include <stdint.h>\n#include <stddef.h>\n"
                   "int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) { return 0; }\n")
    r = subprocess.run([clang, "-fsanitize=fuzzer,address,undefined", str(src), "-o", str(tmp_path / "probe")],
                       capture_output=True)
    return r.returncode == 0


def test_fuzz_smoke(tmp_path):
    if not _has_libfuzzer(tmp_path):
        pytest.skip("clang with libFuzzer not available (apt-get install -y clang)")
    env = dict(os.environ, STELLA_FUZZ_BUILD=str(tmp_path / "fuzz"))
    r = subprocess.run(["bash", SCRIPT, "3"], capture_output=True, text=True, env=env, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "ERROR" not in out and "SUMMARY" not in out, out[-4000:]
    assert out.count("stat::number_of_executed_units") == 4, out[-4000:]
