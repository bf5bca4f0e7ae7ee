"""kvgate's version, as installed (for `kvgate --version` and kvgate_build_info)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def kvgate_version() -> str:
    try:
        return version("kvgate")
    except PackageNotFoundError:  # run from a source tree without installing
        return "unknown"
