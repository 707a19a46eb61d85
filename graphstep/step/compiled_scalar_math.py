"""A stage's scalar math (a few 0-d tensors read, a few written in place) as one compiled graph.

Why: a stage's small math (result flags, the clip coefficient, the loss-scale rule) is a dozen or two 0-d ops,
and on a GPU each is a kernel, a node of the captured graph. Where the update runs the compiled kernel on a GPU
(``wanted``), each piece of math runs as one compiled graph instead; not on the CPU, where a compiled call costs
more than the ops it replaces (docs/perf-notes.md). The math is one Python function either way, so eager runs
the same ops one by one (tests/test_scalar_graph.py holds the two bitwise equal). It is one ``torch.library``
custom op to the dispatcher, compiled once per process and function, guarded on metadata, never on values.
Numerics: compiled with inductor's ``eager_numerics.division_rounding``, since Triton otherwise lowers an fp32
division to an approximate one. A 0-d fp64 CPU tensor would be read by dynamo as a Python float behind a guard
(an ``.item()`` per call), so such inputs are passed as one-element views and read as 0-d through ``scalar``.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import torch

from ..config.warn import warn_user
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
        warn_user(f"graphstep: the step's scalar math runs as eager ops on {device}: this torch's inductor "
                  f"has no option {', '.join(missing)}")
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
