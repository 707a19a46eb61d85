"""A one-time warning when the optimizer steps before any backward (moved out of engine.py unchanged)."""

from __future__ import annotations

import warnings


class GradsSeen:
    """Warns once when a step runs before any backward since build.

    The update then reads all-zero grads and applies weight decay (and momentum) to every param:
    graphstep steps every param it holds, like Megatron-Core's buffers, where torch's optimizers skip
    params whose ``.grad`` is None. One-shot hooks: the first grad to arrive removes them all, so later
    backwards pay nothing.
    """

    def __init__(self, params):
        self.seen = False
        self._warned = False
        self._handles = [p.register_post_accumulate_grad_hook(self._arrived) for p in params]

    def _arrived(self, _param) -> None:
        self.seen = True
        self.remove()

    def remove(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()

    def check(self) -> None:
        if not self.seen and not self._warned:
            self._warned = True
            warnings.warn("graphstep: step() ran before any backward: every grad is zero, so this step applies "
                          "only weight decay (and momentum) to every param. graphstep steps all the params it "
                          "holds (torch's optimizers skip params without grads); run backward first",
                          RuntimeWarning, stacklevel=6)
