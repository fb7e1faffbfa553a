"""The version of cocoweave, read from the installed package's metadata: pyproject.toml is its one source."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("cocoweave")
except PackageNotFoundError:  # a source tree that was never installed (`pip install -e .` fixes it)
    __version__ = "0+unknown"
