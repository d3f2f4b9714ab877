"""Build: the C core in c_src/ becomes the cffi extension stella_mpi._native._stella.

Everything else about the package (name, version, dependencies, extras, the stellarun
command) is in pyproject.toml's [project]; cffi_modules has no pyproject.toml form, so it
stays here. CMakeLists.txt builds the same sources as a plain shared library with the C
tests and sanitizer builds.
"""
from setuptools import setup

setup(cffi_modules=["stella_mpi/_native/build_ffi.py:ffibuilder"])
