"""Build: the C core in c_src/ becomes the cffi extension stella_mpi._native._stella.

CMakeLists.txt builds the same sources as a plain shared library with the C
tests and sanitizer builds.
"""
from setuptools import find_packages, setup

setup(
    name="stella_mpi",
    version="0.1.0",
    description="Horovod-style allreduce for PyTorch across clusters joined by slow links",
    packages=find_packages(include=["stella_mpi", "stella_mpi.*", "stellarun"]),
    python_requires=">=3.9",
    setup_requires=["cffi>=1.16"],
    cffi_modules=["stella_mpi/_native/build_ffi.py:ffibuilder"],
    install_requires=["torch", "numpy", "cffi>=1.16", "mpi4py>=3.1", "mpich"],
    extras_require={"test": ["pytest", "pytest-benchmark", "hypothesis"],
                    # the main job's plot and bench/report.py; stella_mpi itself never imports it
                    "plot": ["matplotlib"]},
    entry_points={"console_scripts": ["stellarun=stellarun.cli:main"]},
    zip_safe=False,
)
