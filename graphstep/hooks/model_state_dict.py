"""The model's own ``state_dict`` while graphstep manages it: one storage object per param, so safetensors
saves every weight (docs/trainers.md, "Saving the model").

Why. graphstep makes every model param a view of one flat buffer (graphstep/state/buffers.py), so by default all
of ``model.state_dict()``'s tensors share one storage. Savers that deduplicate shared tensors by storage
(safetensors' ``save_model`` / ``load_model``, accelerate's ``save_state``, transformers'
``save_pretrained``) then see one storage that no tensor covers: they refuse to save, or keep one tensor
and drop the rest with a warning.

What. A state-dict post-hook on every module that holds a managed param puts, in place of the detached
param (``param.detach()``, what ``Module._save_to_state_dict`` stores), a zero-copy *alias* (``alias``): a
tensor over exactly that param's bytes whose storage object is its own. Nothing is copied: a write into a
state-dict value (``torch.distributed.checkpoint`` loads in place) lands in the param. The hooks belong to the
model, not to the optimizer (``ModelStateDict``).
"""

from __future__ import annotations

import weakref
from typing import Iterable, Optional, Sequence

import torch


def alias(view: torch.Tensor) -> torch.Tensor:
    """A tensor equal to the contiguous ``view`` in memory, shape and dtype, with a storage object of its
    own covering exactly its bytes (``flat.untyped_storage()[a:b]``: zero-copy, the storage slice shares the
    memory and holds a reference to ``view``'s, keeping it alive)."""
    if not view.is_contiguous():
        raise ValueError("graphstep: a param view of the flat buffer is expected to be contiguous")
    start = view.storage_offset() * view.element_size()
    storage = view.untyped_storage()[start:start + view.numel() * view.element_size()]
    return torch.empty(0, dtype=view.dtype, device=view.device).set_(storage, 0, view.shape, view.stride())


class _Alias:
    """A managed param, its alias, and what the param must still be for the alias to stand for it."""

    __slots__ = ("param", "tensor", "data_ptr", "dtype", "shape")

    def __init__(self, param: torch.nn.Parameter, view: torch.Tensor):
        self.param, self.tensor = param, alias(view)
        self.data_ptr, self.dtype, self.shape = view.data_ptr(), view.dtype, view.shape

    @staticmethod
    def is_view(param: torch.Tensor, view: torch.Tensor) -> bool:
        """Whether ``param`` is ``view``'s memory now (not replaced through ``p.data`` since)."""
        return param.data_ptr() == view.data_ptr() and param.dtype == view.dtype and param.shape == view.shape

    def stands_for(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is the param's memory as the flat buffer lays it out (pointers are unique per
        device only, but a param never changes device while it is a view of the flat buffer)."""
        return (tensor.data_ptr() == self.data_ptr and tensor.dtype == self.dtype and tensor.shape == self.shape
                and tensor.is_contiguous())


class ModelStateDict:
    """The aliases of one optimizer's params and the hooks on the model's modules that hand them out.

    One alias per param, made at install, so a param under two names (tied weights: the user's own tie) gives
    two tensors over one storage, which every saver keeps as one tensor and ``torch.load`` / ``load_model`` tie
    again.

    The params stay views of the flat buffer (the step reads static addresses) after the optimizer is closed or
    dropped too, so the hooks stay as long as the modules do. They hold the aliases, which keep alive only the
    params' own memory (the flat param buffer, which the params keep alive anyway), never the optimizer's
    grads, state or main params. A later optimizer over the same model takes over: it drops an earlier one's
    aliases of the params it lays out anew (whose old buffer would otherwise stay alive through them) and its
    hooks with no param left. When the earlier one takes its params back (its next step re-adopts them), it
    makes their aliases anew and the later one drops its own: the aliases follow whichever optimizer the
    params are views of."""

    def __init__(self, modules: Iterable[torch.nn.Module], domain_buffers: Sequence):
        self._aliases: dict[int, _Alias] = {}
        self._modules = [weakref.ref(module) for module in modules]  # weakly: the optimizer keeps no model alive
        self._handles: dict[int, tuple] = {}  # id(module) -> (module's hook handle, ids of its managed params)
        self.generation = 0
        """Bumped whenever an alias is made or dropped: a reader of ``alias_of`` knows when to look again."""
        self.adopt(domain_buffers)

    def adopt(self, domain_buffers: Sequence) -> None:
        """Alias every param of ``domain_buffers`` that is a view of its flat buffer and has no alias standing
        for that view (all of them at the build; after a later optimizer took them over, those the step took
        back), take them over from other optimizers' hooks, and hook the modules that hold them."""
        taken = {}
        for buffers in domain_buffers:
            for index, param in enumerate(buffers.params):
                view = buffers.param_view(index)
                entry = self._aliases.get(id(param))
                if (entry is None or entry.param is not param or not entry.stands_for(view)) \
                        and _Alias.is_view(param, view):
                    # Keyed by the param's id; the entry holds the param, so the id stays its own.
                    taken[id(param)] = _Alias(param, view)
        if not taken:
            return
        self._aliases.update(taken)
        self.generation += 1
        for module in filter(None, (ref() for ref in self._modules)):
            _take_over(module, taken, keep=self)
            mine = {id(p) for p in module._parameters.values() if p is not None and id(p) in self._aliases}
            if mine and id(module) not in self._handles:
                self._handles[id(module)] = (module.register_state_dict_post_hook(_Hook(self)), mine)
            elif mine:
                self._handles[id(module)][1].update(mine)

    def alias_of(self, param: torch.nn.Parameter) -> Optional[torch.Tensor]:
        """The alias handed out for ``param``, or None (not aliased by this optimizer now). An alias has a
        version counter of its own, not the param's: a write through it moves only the alias's, so the watch on
        writes into bf16/fp16 params (graphstep/state/param_writes.py) reads both."""
        entry = self._aliases.get(id(param))
        return None if entry is None or entry.param is not param else entry.tensor

    def replace_detached_params(self, module: torch.nn.Module, state_dict: dict, prefix: str,
                                local_metadata: dict) -> None:
        """The post-hook: each of ``module``'s managed params stored detached becomes its alias. Left as they
        are: ``keep_vars=True`` entries (the Parameters themselves), a param the user replaced (``p.data = ...``:
        no longer a view of the flat buffer, so its detached tensor is its own already; the next step adopts it
        back and aliasing resumes), params graphstep does not manage, and any value another hook or override
        put there."""
        for name, param in module._parameters.items():
            entry = self._aliases.get(id(param))
            if entry is None or entry.param is not param:
                continue
            value = state_dict.get(prefix + name)
            # type() is exact: a Parameter (keep_vars=True) or a subclass someone else stored stays.
            if type(value) is torch.Tensor and entry.stands_for(value) and entry.stands_for(param):
                state_dict[prefix + name] = entry.tensor.detach()  # one storage per param, a fresh tensor

    def forget(self, param_ids: set) -> None:
        """A later optimizer laid these params out anew: drop their aliases, and every hook left with none."""
        dropped = param_ids & self._aliases.keys()
        for key in dropped:
            del self._aliases[key]
        self.generation += bool(dropped)
        for module_id, (handle, mine) in list(self._handles.items()):
            if not mine & self._aliases.keys():
                handle.remove()
                del self._handles[module_id]


class _Hook:
    """The state-dict post-hook, an object (torch marks the hooks it registers with an attribute) that names
    its owner, so that a later optimizer finds it."""

    def __init__(self, owner: ModelStateDict):
        self.owner = owner

    def __call__(self, module, state_dict, prefix, local_metadata) -> None:
        self.owner.replace_detached_params(module, state_dict, prefix, local_metadata)


def _take_over(module: torch.nn.Module, aliases: dict, keep: "ModelStateDict") -> None:
    """Other optimizers' hooks on ``module`` forget the params ``keep`` aliases now (``aliases``' keys)."""
    for hook in list(getattr(module, "_state_dict_hooks", {}).values()):
        if isinstance(hook, _Hook) and hook.owner is not keep:
            hook.owner.forget(set(aliases))


def install(model_chunks: Sequence[torch.nn.Module], domain_buffers: Sequence) -> ModelStateDict:
    """Hooks on the modules of ``model_chunks`` that hold params of ``domain_buffers`` (each a
    StaticBuffers: the dense one, then the experts'). They stay while the modules do (``ModelStateDict``)."""
    seen, modules = set(), []
    for chunk in model_chunks:
        for module in chunk.modules():
            if id(module) not in seen:
                seen.add(id(module))
                modules.append(module)
    return ModelStateDict(modules, domain_buffers)
