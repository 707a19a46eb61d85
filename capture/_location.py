"""Find the user's source line for an op: the innermost frame outside torch and capture.

Errors that name `torch/_tensor.py:1043` help nobody; the line to change is the one in
the user's step that called into torch.
"""
from __future__ import annotations

import linecache
import os
import sys

import torch

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_CAPTURE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _is_internal(filename: str) -> bool:
    path = os.path.abspath(filename)
    return path.startswith(_TORCH_DIR) or path.startswith(_CAPTURE_DIR)


def user_location() -> tuple[str, int, str]:
    """(filename, lineno, source line) of the innermost frame outside torch/ and capture/.

    Falls back to ("<unknown>", 0, "") when the whole stack is internal.
    """
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not _is_internal(filename):
            lineno = frame.f_lineno
            line = linecache.getline(filename, lineno).strip()
            return filename, lineno, line
        frame = frame.f_back
    return "<unknown>", 0, ""
