"""torch's optimizer state-dict hooks, run around graphstep's own ``state_dict`` / ``load_state_dict``.

``torch.optim.Optimizer.register_state_dict_pre_hook`` and its three siblings add hooks that torch's own
``state_dict`` and ``load_state_dict`` run (frameworks use them to add or rewrite entries). graphstep's
optimizers override both methods with their own formats, so these decorators run the hooks the same way:
pre-hooks first, post-hooks after, a post-hook's (or load pre-hook's) returned dict replacing the one it was
given, and a load working on a shallow copy of the caller's dict.
"""

from __future__ import annotations

import functools


def runs_state_dict_hooks(method):
    @functools.wraps(method)
    def state_dict(self):
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        result = method(self)
        for hook in self._optimizer_state_dict_post_hooks.values():
            replaced = hook(self, result)
            result = result if replaced is None else replaced
        return result
    return state_dict


def runs_load_state_dict_hooks(method):
    @functools.wraps(method)
    def load_state_dict(self, state_dict):
        if isinstance(state_dict, dict):
            state_dict = state_dict.copy()
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            replaced = hook(self, state_dict)
            state_dict = state_dict if replaced is None else replaced
        method(self, state_dict)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)
    return load_state_dict
