"""cffi builder (API mode) for the C core in ``c_src/``.

The public headers ``c_src/stella_*.h`` are the one source of truth for the C
ABI: this builder feeds them to ``cdef`` after dropping preprocessor lines, so
they must hold only enums, typedefs and prototypes. cffi releases the GIL
around every call, so kernels run in parallel with Python threads.
"""
import glob
import os
import re
import sys

from cffi import FFI

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
C_SRC = os.path.join(ROOT, "c_src")


def public_headers():
    return sorted(glob.glob(os.path.join(C_SRC, "stella_*.h")))


def cdef_text(paths):
    out = []
    for path in paths:
        with open(path) as f:
            text = f.read()
        text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
        lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
        out.append("\n".join(lines))
    return "\n".join(out)


def sources(absolute=False):
    paths = sorted(glob.glob(os.path.join(C_SRC, "*.c")))
    return paths if absolute else [os.path.relpath(p, ROOT) for p in paths]


def compile_args():
    if sys.platform == "win32":
        return ["/O2"]
    # No -march: wider SIMD paths are compiled per function and picked at run time.
    return ["-O3", "-std=gnu11", "-fno-strict-aliasing", "-ffp-contract=off", "-fvisibility=hidden",
            "-Wall", "-Wno-unused-function"]


def make_builder(absolute=False):
    builder = FFI()
    headers = public_headers()
    builder.cdef(cdef_text(headers))
    builder.set_source(
        "stella_mpi._native._stella",
        "\n".join('#include "%s"' % os.path.basename(h) for h in headers),
        sources=sources(absolute),
        include_dirs=[C_SRC if absolute else os.path.relpath(C_SRC, ROOT)],
        extra_compile_args=compile_args(),
        libraries=["pthread", "m"] if sys.platform != "win32" else [],
    )
    return builder


ffibuilder = make_builder()  # used by setup.py (cffi_modules), paths relative to the repository

if __name__ == "__main__":
    # rebuild in place without pip: python stella_mpi/_native/build_ffi.py
    import shutil
    tmp = os.path.join(ROOT, "build", "cffi")
    built = make_builder(absolute=True).compile(tmpdir=tmp, verbose=True)
    dest = os.path.join(ROOT, "stella_mpi", "_native")
    for old in glob.glob(os.path.join(dest, "_stella*.so")):  # one build only: no stale module shadows it
        os.remove(old)
    shutil.copy(built, os.path.join(dest, os.path.basename(built)))
