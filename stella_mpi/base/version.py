"""The one place the version is written: setuptools reads it from here without importing the
package (pyproject.toml, [tool.setuptools.dynamic]), and stella_mpi.__version__ is this."""
__version__ = "0.1.0"
