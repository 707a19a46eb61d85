"""A one-time warning when the optimizer steps before any backward."""

from __future__ import annotations


from ..config.warn import warn_user
from . import weak_hooks


class GradsSeen:
    """Warns once when a step runs with no grad since the build: no backward ran since, and none had left
    grads before it.

    The update then reads all-zero grads and applies weight decay (and momentum) to every param:
    graphstep steps every param it holds, like Megatron-Core's buffers, where torch's optimizers skip
    params whose ``.grad`` is None. One-shot listeners on every param's grad hook (graphstep/hooks/param_hooks.py,
    stage "grads_seen"): the first grad to arrive removes them all, so later backwards pay nothing for them.
    Held weakly there, like every listener: the model's hooks never keep this (or its optimizer) alive.
    """

    def __init__(self, hooks, domains, *, taken_at_build: bool = False, foreign_params=()):
        """``hooks``: the optimizer's ``GradHooks``; ``domains``: its ``StaticBuffers`` (every param of each).
        ``taken_at_build``: grads a backward left before the build were taken in elsewhere (FSDP2's bindings).
        ``foreign_params``: params whose grads arrive without the buffers' params' hooks firing (an FSDP2 model's
        DTensor params, whose local shards the buffers hold): a post-accumulate-grad hook on each sets the flag."""
        self._warned = False
        self._hooks = hooks
        # Grads a backward left before the build are in the buffers already (state/allocation.py): seen.
        self.seen = taken_at_build or any(buffers.grads_taken_at_build for buffers in domains)
        for buffers in domains:
            for index in range(len(buffers.params)):
                hooks.listen("grads_seen", buffers, index, self, "_arrived")
        self._foreign_handles = [] if self.seen else [
            p.register_post_accumulate_grad_hook(weak_hooks.calling(self, "_foreign_arrived"))
            for p in foreign_params]

    def _arrived(self, _param) -> None:
        self.seen = True
        self.remove()

    def _foreign_arrived(self, _param) -> None:
        """Only a flag: FSDP2 calls these hooks while iterating the param's live hook dict (torch's autograd
        iterates a copy), so removing a handle here would break that loop wherever another hook follows ours
        (``OrderedDict mutated during iteration``). They go at the next step, outside any backward."""
        self.seen = True

    def _remove_foreign(self) -> None:
        for handle in self._foreign_handles:
            handle.remove()
        self._foreign_handles = []

    def remove(self) -> None:
        self._hooks.remove(self)
        self._remove_foreign()

    def check(self) -> None:
        if self.seen:
            self._remove_foreign()  # done with: later backwards pay nothing for them
        if not self.seen and not self._warned:
            self._warned = True
            warn_user("graphstep: step() ran before any backward: unless the grads were written by hand, "
                      "every grad is zero, so this step applies only weight decay (and momentum) to every "
                      "param. graphstep steps all the params it holds (torch's optimizers skip params "
                      "without grads); run backward first",
                      RuntimeWarning)
