"""capture: capture any zero-argument step over static tensors; replay it.

Optimizer-agnostic (it imports nothing from graphstep):

    g = capture.graph(step, warmup=1)     # eager, then capture, then replay
    capture.check(step)                   # what would make step unsafe to capture

Outputs are graph-owned: clone what you keep.
"""
from .check import check
from .errors import CaptureError, Finding, StaleInputError
from .graph import Graph, graph

__all__ = ["graph", "Graph", "check", "CaptureError", "StaleInputError", "Finding"]
