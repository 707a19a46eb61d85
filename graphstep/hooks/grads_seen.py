"""A one-time warning when the optimizer steps before any backward."""

from __future__ import annotations

import warnings


class GradsSeen:
    """Warns once when a step runs with no grad since the build: no backward ran since, and none had left
    grads before it.

    The update then reads all-zero grads and applies weight decay (and momentum) to every param:
    graphstep steps every param it holds, like Megatron-Core's buffers, where torch's optimizers skip
    params whose ``.grad`` is None. One-shot listeners on every param's grad hook (graphstep/hooks/param_hooks.py,
    stage "grads_seen"): the first grad to arrive removes them all, so later backwards pay nothing for them.
    Held weakly there, like every listener: the model's hooks never keep this (or its optimizer) alive.
    """

    def __init__(self, hooks, domains):
        """``hooks``: the optimizer's ``GradHooks``; ``domains``: its ``StaticBuffers`` (every param of each)."""
        self._warned = False
        self._hooks = hooks
        # Grads a backward left before the build are in the buffers already (state/allocation.py): seen.
        self.seen = any(buffers.grads_taken_at_build for buffers in domains)
        for buffers in domains:
            for index in range(len(buffers.params)):
                hooks.listen("grads_seen", buffers, index, self, "_arrived")

    def _arrived(self, _param) -> None:
        self.seen = True
        self.remove()

    def remove(self) -> None:
        self._hooks.remove(self)

    def check(self) -> None:
        if not self.seen and not self._warned:
            self._warned = True
            warnings.warn("graphstep: step() ran before any backward: unless the grads were written by hand, "
                          "every grad is zero, so this step applies only weight decay (and momentum) to every "
                          "param. graphstep steps all the params it holds (torch's optimizers skip params "
                          "without grads); run backward first",
                          RuntimeWarning, stacklevel=6)
