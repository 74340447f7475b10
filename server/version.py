"""linserve's version: pyproject.toml's, as installed (the one place it is written)."""

from importlib.metadata import PackageNotFoundError, version


def package_version() -> str:
    try:
        return version("linserve")
    except PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"
