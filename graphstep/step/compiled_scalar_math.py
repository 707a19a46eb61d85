"""A stage's scalar math (a few 0-d tensors read, a few written in place) as one compiled graph.

Why: the step's small math (the norm's result flags, the clip coefficient, the loss-scale rule) is a dozen
or two 0-d ops per stage. Eagerly each is an op, and on a GPU each is a kernel: a node of the captured
graph, a few µs of launch and ramp apiece against an update of under a millisecond at GPT-2 small. On a
GPU where the update runs the compiled kernel (so ``torch.compile`` works there; ``wanted``), each such
piece of math runs as one compiled graph instead (``StepContext.compile_scalars``): inductor fuses its
pointwise ops into one kernel. Not on the CPU, where the ops are not kernels: there a compiled graph's
call costs more than the ops it replaces (docs/perf-notes.md). The math is one
Python function either way, written over its tensor arguments, so the eager path runs the same ops one
by one; tests/test_scalar_graph.py holds the two bitwise equal.

The compiled graph is called through one ``torch.library`` custom op, so that it is one operator to the
dispatcher (capture's CPU replay backend records and re-calls it; ``capture.check`` sees that it reads
``ins`` and writes ``outs``), and it is compiled once per process and math function: its arguments are
tensors, guarded on their metadata (dtype, shape, strides, device; aliasing), never on their values, so
every optimizer in the process shares the compile (its first call counts in ``compile_seconds()`` of
graphstep/kernels/compiled.py).

Numerics: the compiled graph computes what the ops compute, bitwise on the CPU (tests/test_scalar_graph.py).
On a GPU, Triton lowers an fp32 division to an approximate one unless told otherwise: these graphs are
compiled with inductor's ``eager_numerics.division_rounding``, the rounded division the eager ops do
(on a few scalars; not measured on a GPU); they hold no multiply-add that Triton could contract.

A 0-d float64 tensor argument on the CPU would be read by dynamo as a Python float behind a guard (an
``.item()`` per call): the compiled path passes such inputs (the CPU's fp64 hyperparameters, the fp64 sum
of squares) as one-element views, and the math takes every input it needs as 0-d through ``scalar``.
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable, Sequence

import torch

from ..kernels import compiled as compiled_kernels

_MATH: dict[str, Callable] = {}


COMPILE_OPTIONS = {"size_asserts": False, "eager_numerics.division_rounding": True}
"""Inductor options of every scalar graph (the division rounding: module docstring)."""


def wanted(kernel: str, device: torch.device) -> bool:
    """Whether a step on ``device`` whose update runs ``kernel`` compiles its scalar math (module docstring).

    Not where this torch's inductor lacks one of ``COMPILE_OPTIONS``: the first compiled call would raise in
    the first step, after the stages are built; the math runs as eager ops instead, said once."""
    if kernel != "compiled" or torch.device(device).type == "cpu":
        return False
    missing = compiled_kernels.missing_compile_options(COMPILE_OPTIONS)
    if missing:
        warnings.warn(f"graphstep: the step's scalar math runs as eager ops on {device}: this torch's inductor "
                      f"has no option {', '.join(missing)}", stacklevel=3)
        return False
    return True


def _division_math(outs, ins) -> None:
    quotient, = outs
    numerator, denominator = ins
    torch.div(scalar(numerator), scalar(denominator) + 1e-6, out=quotient)


def compile_problem(device: torch.device):
    """None when a scalar graph compiles with ``COMPILE_OPTIONS`` on ``device`` and equals its eager ops
    bitwise (a division, the op the rounding option is about), else why not: a preflight of what the step
    compiles on its first call."""
    missing = compiled_kernels.missing_compile_options(COMPILE_OPTIONS)
    if missing:
        return f"inductor has no option {', '.join(missing)}"
    ins = [torch.tensor(7.0, device=device), torch.tensor(3.0, device=device)]
    results = []
    try:
        for compiled in (True, False):
            out = torch.zeros((), device=device)
            _DIVISION([out], ins, compiled=compiled)
            results.append(out)
    except Exception as error:  # no compiler, no Triton, an inductor bug
        return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:200]}"
    return None if torch.equal(*results) else "the compiled division differs from the eager one"


def register(name: str, math: Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor]], None]) -> "ScalarGraph":
    """``math(outs, ins)`` (writes ``outs`` in place, reads ``ins``) under ``name``, unique in the process."""
    if name in _MATH:
        raise ValueError(f"scalar graph {name!r} is registered already")
    _MATH[name] = math
    return ScalarGraph(name, math)


class ScalarGraph:
    def __init__(self, name: str, math: Callable):
        self.name = name
        self.math = math

    def __call__(self, outs: list[torch.Tensor], ins: list[torch.Tensor], *, compiled: bool) -> None:
        """Run the math: one compiled graph (one operator) with ``compiled``, else its ops one by one."""
        if compiled:
            _scalar_graph(self.name, outs, [_as_vector(t) if _read_as_float(t) else t for t in ins])
        else:
            self.math(outs, ins)


def scalar(t: torch.Tensor) -> torch.Tensor:
    """``t`` as 0-d: what the math calls on an input that may come as a one-element view (module docstring)."""
    return t if t.dim() == 0 else t.view(())


def _read_as_float(t: torch.Tensor) -> bool:
    return t.dim() == 0 and t.dtype == torch.float64 and t.device.type == "cpu"


def _as_vector(t: torch.Tensor) -> torch.Tensor:
    return t.view(1)


@functools.cache
def _compiled(name: str, device_type: str):
    # The vector width among the options: inductor's cache does not key entries by it (kernels/inductor_options.py).
    options = {**COMPILE_OPTIONS, **compiled_kernels.vector_width_option(device_type)}
    return torch.compile(_MATH[name], fullgraph=True, dynamic=False, options=options)


_DIVISION = register("division_probe", _division_math)


@torch.library.custom_op("graphstep::scalar_graph_", mutates_args=("outs",))
def _scalar_graph(name: str, outs: list[torch.Tensor], ins: list[torch.Tensor]) -> None:
    variant = (name, tuple((t.dtype, t.device, t.dim()) for t in (*outs, *ins)))
    compiled_kernels.call_compiled(_compiled(name, outs[0].device.type), outs, ins, variant=variant)


@_scalar_graph.register_fake
def _(name, outs, ins) -> None:
    return None
