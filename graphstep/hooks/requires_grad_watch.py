"""A param frozen or unfrozen after the build is refused at the next step, by name.

graphstep lays out the params that require grad at ``get_optimizer`` and steps all of them every step: a grad
buffer is never None, so a param frozen later (``requires_grad_(False)``) would go on being moved by weight
decay and momentum, where torch's optimizers skip a param whose grad is None. A model param that was frozen
at the build and requires grad later has no place in the buffers and would never be stepped. Either would
train a different model than the user asked for without a word, so the step refuses.

torch has no hook on ``requires_grad``: the check reads the flag of every param concerned, one pass per list
(graphstep/native/param_checks.py). The held params of the flat buffers are read in the binding check's pass
(``StaticBuffers.bound_and_requiring_grad``, state/buffers.py): one visit per param for their data, grad and
flag, whose verdict the step's binding check then reuses.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..config.listing import listed
from ..native import param_checks


class RequiresGradWatch:
    """The model's params whose ``requires_grad`` the step relies on: those the optimizer holds, and the frozen
    ones it left out."""

    def __init__(self, model: list[tuple[str, torch.nn.Parameter]], held: list[tuple[str, torch.nn.Parameter]],
                 buffers: Sequence = ()):
        """``model``: (name, param) of every param of the model (``named_model_params``; none where the optimizer
        was given params, not a model); ``held``: (name, param) of the params the optimizer steps; ``buffers``:
        the engine's ``StaticBuffers``, whose held params are read in their binding pass."""
        self._held_names = [name for name, _ in held]
        self._held = [p for _, p in held]
        held_ids = {id(p) for p in self._held}
        # FSDP2's buffers hold local shards, not the model's params: those are read here, on their own.
        self._buffers = [b for b in buffers if all(id(p) in held_ids for p in b.params)]
        in_buffers = {id(p) for b in self._buffers for p in b.params}
        self._held_elsewhere = [p for p in self._held if id(p) not in in_buffers]
        frozen = [(name, p) for name, p in model if id(p) not in held_ids]
        self._frozen_names = [name for name, _ in frozen]
        self._frozen = [p for _, p in frozen]

    def check(self) -> None:
        held_ok = (all([b.bound_and_requiring_grad() for b in self._buffers])  # every buffer's verdict kept
                   and param_checks.first_unbound(self._held_elsewhere, requires_grad=True) < 0)
        if not held_ok:  # an unbound param ends a binding pass as a frozen one does: read the flags on their own
            held_ok = param_checks.first_unbound(self._held, requires_grad=True) < 0
        frozen_ok = param_checks.first_unbound(self._frozen, requires_grad=False) < 0
        if not held_ok:
            names = [n for n, p in zip(self._held_names, self._held) if not p.requires_grad]
            raise RuntimeError(
                f"graphstep: param(s) {_quoted(names)} do not require grad, but the optimizer was built with "
                "them: it steps every param it holds, so weight decay and momentum would go on moving them "
                "(torch's optimizers skip a param without a grad). Set requires_grad back, or build a new "
                "optimizer over the model after freezing them")
        if not frozen_ok:
            names = [n for n, p in zip(self._frozen_names, self._frozen) if p.requires_grad]
            raise RuntimeError(
                f"graphstep: param(s) {_quoted(names)} require grad now but were frozen when the optimizer was "
                "built: its buffers have no place for them, so they would never be stepped. Build a new "
                "optimizer over the model after unfreezing them, or freeze them again")


def _quoted(names: list[str]) -> str:
    return listed(f"'{name}'" for name in names)
