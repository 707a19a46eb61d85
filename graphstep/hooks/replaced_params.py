"""A model param replaced by a new Parameter object after the build is refused at the next step.

``model.load_state_dict(sd, assign=True)``, or ``module.weight = nn.Parameter(...)``, registers a new param
object in the module. The optimizer holds the old one: it would go on stepping that one, the model would
compute with the new one, and training would stop without a word (the per-step binding check looks at the
params the optimizer holds, which are all still bound). torch announces every such registration to its
global parameter-registration hooks, so one hook per optimizer notes a replaced param as it happens, and the
step refuses to run, naming it: a check of one list per step, however many params there are.

A replacement by a param this optimizer also holds (tying one weight to another) leaves nothing untrained
and is let through. Registrations that bypass ``register_parameter`` (writing ``module._parameters``
directly) are not seen.
"""

from __future__ import annotations

import weakref

import torch

from . import weak_hooks


class ReplacedParams:
    """The optimizer's watch: ``replaced`` lists the qualified names of held params swapped out so far."""

    def __init__(self, chunks, params):
        """``chunks``: the model's modules; ``params``: (qualified name, param) the optimizer holds."""
        self._held = {id(p): name for name, p in params}
        # Per module (weakly: a dropped model is not kept), its held params: attribute name -> (id, qualified name).
        self._watched: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()
        for chunk in chunks:
            for module in chunk.modules():
                names = {name: (id(p), self._held[id(p)]) for name, p in module._parameters.items()
                         if p is not None and id(p) in self._held}
                if names:
                    self._watched[module] = names
        self.replaced: list[str] = []
        self._handles = weak_hooks.Handles(self)  # the global hook goes when this watch (its optimizer) goes
        self._handles.append(torch.nn.modules.module.register_module_parameter_registration_hook(
            weak_hooks.calling(self, "_registered")))

    def _registered(self, module, name: str, param) -> None:
        held = self._watched.get(module, {}).get(name)
        if held is not None and held[0] != id(param) and id(param) not in self._held:
            self.replaced.append(held[1])

    def check(self) -> None:
        if self.replaced:
            names = ", ".join(f"'{name}'" for name in dict.fromkeys(self.replaced))
            raise RuntimeError(
                f"graphstep: model param(s) {names} were replaced by new Parameter objects after get_optimizer "
                "(model.load_state_dict(..., assign=True), or an assignment to the module attribute): the "
                "optimizer holds the old ones and would train those, not the model's. Load with assign=False "
                "(it copies into the params the optimizer holds), or build the optimizer after the replacement")
