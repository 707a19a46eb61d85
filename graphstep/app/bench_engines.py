"""The graphstep engines the benchmark rows time (graphstep/app/bench_core.py ``build_graphstep``): one per
configuration and shape set, built, warmed up (compiled, captured) once and shared by the rows built together.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from .bench_core import Inputs


@dataclass
class SharedEngine:
    """One graphstep optimizer over a fresh model of the shape set, warmed up, with its two grad refills."""

    opt: object
    copy_grads: Callable[[], None]  # the grads restored by a copy from the sources
    backward: Callable[[], None]  # the backward stand-in: the same grads through autograd (and its hooks)
    notes: str

    @property
    def refill(self) -> Callable[[], None]:
        """What restores the grads before a step: with a folded norm, backward (its hooks fold), else a copy."""
        return self.backward if self.opt.config.fold_grad_norm else self.copy_grads


# Rows that time different parts of one configuration (its step, its backward, both, its norm stage) share
# one engine while they are built together (``--interleave``): at GPT-2 small each engine holds ~2 GB, and
# a table of a dozen rows would not fit in memory otherwise. Emptied by ``free_memory``.
_SHARED_ENGINES: dict = {}


def forget_shared_engines() -> None:
    """Drop the engines kept for later rows (``bench_core.free_memory``)."""
    _SHARED_ENGINES.clear()


def shared_engine(inputs: "Inputs", config, backward_stand_in: Callable) -> SharedEngine:
    """The engine for ``config`` over ``inputs``' shape set, built and warmed up once per pair;
    ``backward_stand_in(opt, params, sources)`` makes its backward (``bench_core.backward_stand_in``)."""
    key = (id(inputs), config)
    if key in _SHARED_ENGINES:
        shared = _SHARED_ENGINES[key]
        return dataclasses.replace(shared, notes=shared.notes + " (engine shared with an earlier row)")
    import graphstep as gs
    from graphstep.kernels import compiled

    compile_before = compiled.compile_seconds()
    params = inputs.new_params()
    opt = gs.get_optimizer(config, inputs.module(params))
    grads = [p.main_grad for p in params]  # views of the engine's flat grad buffer (p.grad too, for fp32)
    sources = inputs.views(inputs.grad_flat)

    def copy_grads():
        torch._foreach_copy_(grads, sources)
    engine = SharedEngine(opt, copy_grads, backward_stand_in(opt, params, sources), notes="")
    with torch.no_grad():
        engine.refill()
        for _ in range(config.capture_warmup_steps + 1 if config.capture == "graph" else 1):
            opt.step()  # eager: one step here, so a compile is not timed (graph: the warm-up and the capture)
            engine.refill()
    choice = opt.kernel_choice
    compile_s = choice.compile_s + compiled.compile_seconds() - compile_before
    notes = f"kernel={choice.name} ({choice.reason}); compile {compile_s:.1f} s"
    if config.capture == "graph":
        notes += f"; captured={opt.captured}, backend={opt.capture_backend}"
    engine.notes = notes
    _SHARED_ENGINES[key] = engine
    return engine
