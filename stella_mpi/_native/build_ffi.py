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


def sources():
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(C_SRC, "*.c")))


def compile_args():
    if sys.platform == "win32":
        return ["/O2"]
    # No -march: wider SIMD paths are compiled per function and picked at run time.
    return ["-O3", "-std=gnu11", "-fno-strict-aliasing", "-ffp-contract=off", "-fvisibility=hidden",
            "-Wall", "-Wno-unused-function"]


ffibuilder = FFI()
headers = public_headers()
ffibuilder.cdef(cdef_text(headers))
ffibuilder.set_source(
    "stella_mpi._native._stella",
    "\n".join('#include "%s"' % os.path.basename(h) for h in headers),
    sources=sources(),
    include_dirs=[os.path.relpath(C_SRC, ROOT)],
    extra_compile_args=compile_args(),
    libraries=["pthread", "m"] if sys.platform != "win32" else [],
)

if __name__ == "__main__":
    os.chdir(ROOT)
    ffibuilder.compile(tmpdir=os.path.join(ROOT, "build", "cffi"), verbose=True)
