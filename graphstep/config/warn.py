"""Warnings that point at the user's line: the first frame outside graphstep, its capture layer, torch and the
standard library's wrappers, found by walking the stack, so the attribution survives a change in how deep the
library calls."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings

_PACKAGES = (__name__.split(".")[0], "capture", "torch")
_STDLIB_DIR = os.path.dirname(os.path.abspath(contextlib.__file__)) + os.sep


def _in_a_library(filename: str, package_dirs: tuple) -> bool:
    """graphstep, its capture layer, torch, the standard library (its frozen modules too); ``<string>`` and
    ``<stdin>`` are the user's (``python -c``, ``exec``)."""
    if filename.startswith("<"):
        return filename.startswith("<frozen")
    path = os.path.abspath(filename)
    in_stdlib = path.startswith(_STDLIB_DIR) and "site-packages" not in path and "dist-packages" not in path
    return in_stdlib or path.startswith(package_dirs)


def _package_dirs() -> tuple:
    """graphstep's, the capture layer's (imported with graphstep) and torch's folders."""
    files = [getattr(sys.modules.get(name), "__file__", None) for name in _PACKAGES]
    return tuple(os.path.dirname(os.path.abspath(f)) + os.sep for f in files if f)


def warn_user(message: str, category: type = UserWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the user's code that called into graphstep."""
    frame, level, package_dirs = sys._getframe(1), 1, _package_dirs()
    while frame is not None and _in_a_library(frame.f_code.co_filename, package_dirs):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level + 1 if frame is not None else 2)
