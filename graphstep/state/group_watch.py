"""Edits to ``opt.param_groups`` that the static layout cannot follow, refused at the next step by group.

torch reads ``param_groups`` afresh at every step, so a user may edit them there: graphstep refreshes every
hyperparameter it implements from them (state/hyperparams.py), but the params of each group are laid out
once, and some options torch's optimizers take have no counterpart in graphstep's update. Left alone, each
would be ignored without a word: a param removed from a group would go on training, an appended one never
would, ``maximize=True`` would still minimise.
"""

from __future__ import annotations

from typing import Optional

# Options torch's optimizers take that graphstep's update does not implement, with the value that means off.
_TORCH_ONLY = {"maximize": False, "amsgrad": False, "dampening": 0}


class GroupWatch:
    def __init__(self, groups: list[dict]):
        self._groups = len(groups)
        self._params = [(group["params"], len(group["params"])) for group in groups]

    def unfollowable_edit(self, groups: list[dict]) -> Optional[str]:
        """What in ``groups`` (``opt.param_groups`` now) the step cannot follow, naming the group; or None."""
        if len(groups) != self._groups:
            return (f"opt.param_groups has {len(groups)} groups, the optimizer was built with {self._groups}: "
                    "graphstep lays the groups out once (add_param_group is refused too); build a new optimizer")
        for g, (group, (params, count)) in enumerate(zip(groups, self._params)):
            if group["params"] is not params or len(params) != count:
                return (f"param group {g}: its 'params' list was edited after get_optimizer, but graphstep laid "
                        "its params out once and would go on stepping those: build a new optimizer")
            for key, off in _TORCH_ONLY.items():
                if group.get(key, off) != off:
                    return (f"param group {g}: {key}={group[key]!r} is an option of torch's optimizers that "
                            "graphstep's update does not implement")
        return None
