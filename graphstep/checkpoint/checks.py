"""The checks every checkpoint load shares, and the copy of what they accepted: graphstep's flat format
(``state_dict.py``), the reshardable one (``sharded.py``) and torch's (``torch_format.py``) validate with these
before anything is copied, so a refused load raises ``StateDictError`` naming the key and changes nothing.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any, Callable

import torch
import torch.distributed

from ..families import families_of
from . import integrity

# Param-group keys that are bookkeeping, not hyperparameters: compared or skipped, never copied blindly.
_IDENTITY_GROUP_KEYS = ("params", "param_names")
# Group hyperparameters the step reads (hyperparams.group_values): numbers, never None.
_STEP_NUMBERS = ("lr", "weight_decay", "eps", "momentum")


class StateDictError(ValueError):
    """A checkpoint refused before anything was copied; the message names the offending key."""


def _fail(where: str, problem: str) -> StateDictError:
    return StateDictError(f"load_state_dict: {where} {problem}")


def check_mapping(value: Any, where: str, required=(), allowed=None) -> Mapping:
    """``value`` is a dict holding every ``required`` key (and, when ``allowed`` is given, nothing else)."""
    if not isinstance(value, Mapping):
        raise _fail(where, f"must be a dict, got {type(value).__name__}")
    missing = [k for k in required if k not in value]
    if missing:
        raise _fail(f"{where}[{missing[0]!r}]", f"is missing (required keys: {list(required)})")
    if allowed is not None:
        unknown = [k for k in value if k not in allowed]
        if unknown:
            raise _fail(f"{where}[{unknown[0]!r}]", f"is not a key this optimizer saves (keys: {list(allowed)})")
    return value


def check_tensor(value: Any, where: str, like: torch.Tensor, *, nonnegative: bool = False) -> torch.Tensor:
    """A tensor of ``like``'s dtype and shape (no silent cast), every element finite (and >= 0)."""
    if not isinstance(value, torch.Tensor):
        raise _fail(where, f"must be a tensor, got {type(value).__name__}")
    if value.dtype != like.dtype:
        raise _fail(where, f"has dtype {value.dtype}, expected {like.dtype} (graphstep does not cast a "
                           "checkpoint; convert it explicitly if that is what you want)")
    if value.shape != like.shape:
        raise _fail(where, f"has shape {tuple(value.shape)}, expected {tuple(like.shape)}")
    if value.layout != torch.strided or value.is_quantized:
        raise _fail(where, "must be a dense tensor")
    problem = integrity.state_value_problem(value, second_moment=nonnegative)  # what torch's arithmetic allows
    if problem is not None:
        raise _fail(where, problem)
    return value


def all_finite(value: torch.Tensor) -> bool:
    """Every element finite. A NaN or inf element makes the sum non-finite, so a finite sum (one fast
    reduction, no temporary) proves it; only a non-finite sum (or an overflow) takes the exact check."""
    if not value.is_floating_point() or value.numel() == 0:
        return True
    if value.element_size() == 1:  # fp8 (a model's graphstep.fp8 weights): no reduction kernels; fp32 is exact
        value = value.to(torch.float32)
    return bool(torch.isfinite(value.sum())) or bool(torch.isfinite(value).all())


def check_tensor_list(value: Any, where: str, likes, **kwargs) -> None:
    if not isinstance(value, (list, tuple)):
        raise _fail(where, f"must be a list of tensors, got {type(value).__name__}")
    if len(value) != len(likes):
        raise _fail(where, f"has {len(value)} tensors, expected {len(likes)} (one per flat buffer)")
    for b, (tensor, like) in enumerate(zip(value, likes)):
        check_tensor(tensor, f"{where}[{b}]", like, **kwargs)


def plain_equal(a: Any, b: Any) -> bool:
    """Exact equality of plain nested data (tuples, lists, str, int, float): types must match, so a bool is
    not an int and a tensor (whose ``==`` is elementwise) is never equal to anything here."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(plain_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(plain_equal(a[k], b[k]) for k in a)
    if isinstance(a, (str, int, float, type(None))):
        return a == b
    return False


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_number(value: Any, where: str, *, minimum: float = -math.inf, allow_inf: bool = False) -> float:
    """A Python int or float (not a bool, not a tensor), not NaN, finite unless ``allow_inf``, >= minimum."""
    if not _is_number(value):
        raise _fail(where, f"must be a number, got {type(value).__name__} {value!r:.60}")
    if math.isnan(value) or (math.isinf(value) and not allow_inf):
        raise _fail(where, f"is {value}: must be finite")
    if value < minimum:
        raise _fail(where, f"is {value}: must be >= {minimum}")
    return float(value)


def check_step(value: Any, where: str, like: torch.Tensor) -> None:
    """The step counter: a 0-d tensor of the engine's step dtype, finite, integer-valued, >= 0."""
    check_tensor(value, where, like)
    step = float(value)
    if step < 0 or step != math.floor(step):
        raise _fail(where, f"is {step}: must be a non-negative whole number")


def check_thresholds(clip_grad: Any, skip_threshold: Any, where: str) -> None:
    check_number(clip_grad, f"{where}['clip_grad']", minimum=0.0)
    check_number(skip_threshold, f"{where}['grad_norm_skip_threshold']", minimum=0.0, allow_inf=True)
    if skip_threshold == 0:
        raise _fail(f"{where}['grad_norm_skip_threshold']", "is 0: every step would be skipped")


def _check_group_value(key: str, value: Any, current: Any, where: str) -> None:
    """One hyperparameter of a saved group, judged by the kind of value the live group holds under that key
    (bool, sequence of numbers, overrides dict, str, or number-or-None). Symmetric: whatever a load may put
    into a group, a load of the group's earlier value is accepted again."""
    if isinstance(current, bool):
        if not isinstance(value, bool):
            raise _fail(where, f"must be a bool, got {type(value).__name__}")
    elif isinstance(current, (tuple, list)):
        if not isinstance(value, (tuple, list)) or len(value) != len(current):
            raise _fail(where, f"must be a sequence like {current!r}, got {value!r:.60}")
        for i, item in enumerate(value):
            check_number(item, f"{where}[{i}]")
    elif isinstance(current, Mapping):  # the group's overrides: they identify it, like its params' names
        if not plain_equal(value, current):
            raise _fail(where, f"is {value!r:.80}, this optimizer's group has {current!r:.80} (other overrides)")
    elif _is_number(current) or current is None:
        # A number or None (e.g. min_lr=None: "no floor"); the keys the step reads must be numbers.
        if value is not None or key in _STEP_NUMBERS:
            check_number(value, where)
    elif isinstance(current, str):
        if not isinstance(value, str):
            raise _fail(where, f"must be a str, got {type(value).__name__}")
    else:
        raise _fail(where, f"holds a {type(current).__name__}, which graphstep does not load")


def check_param_groups(view, saved: Any, where: str, *, check_indices: bool) -> list[dict]:
    """The saved groups match ``view``'s (a CheckpointView's) live ones by their params' names; every
    hyperparameter is valid.

    Returns, per group, the values to copy into it (identity keys excluded). ``check_indices``: the saved
    groups also hold ``params`` as indices into this optimizer's params (the flat format).
    """
    if not isinstance(saved, (list, tuple)):
        raise _fail(where, f"must be a list of dicts, got {type(saved).__name__}")
    if len(saved) != len(view.param_groups):
        raise _fail(where, f"has {len(saved)} param groups, this optimizer {len(view.param_groups)}")
    index = {id(p): i for i, p in enumerate(all_params(view.domains))}
    updates = []
    for g, (group, saved_group) in enumerate(zip(view.param_groups, saved)):
        at = f"{where}[{g}]"
        # Every key the live group holds (a checkpoint of the same config has them all): a missing one
        # would otherwise keep its live value silently, and the round trip would not be exact.
        required = ["param_names"] + [k for k in group if k not in _IDENTITY_GROUP_KEYS]
        if check_indices:
            required.append("params")
        check_mapping(saved_group, at, required)
        if not plain_equal(saved_group["param_names"], group.get("param_names")):
            raise _fail(f"{at}['param_names']", "differ from this optimizer's group (another model or "
                                                 "other overrides)")
        if check_indices and not plain_equal(saved_group["params"], [index[id(p)] for p in group["params"]]):
            raise _fail(f"{at}['params']", "are not this group's param indices")
        values = {}
        for key, value in saved_group.items():
            if key in _IDENTITY_GROUP_KEYS:
                continue
            if not isinstance(key, str):
                raise _fail(f"{at}[{key!r}]", "is not a string key")
            _check_group_value(key, value, group.get(key), f"{at}[{key!r}]")
            values[key] = value
        for key in ("lr", "eps"):
            if key in values and values[key] < 0:
                raise _fail(f"{at}[{key!r}]", f"is {values[key]}: must be >= 0")
        family = families_of([group], view.config.optimizer)[0]
        problem = None if family.group_problem is None else family.group_problem({**group, **values}, view.config)
        if problem is not None:  # the next step would refuse the group: refused here, with nothing loaded
            raise _fail(at, problem)
        updates.append(values)
    return updates


def check_scaler(scaler, saved: Any, where: str, name=None) -> None:
    """The loss-scaler state: None without a ``scaler`` (the optimizer's, or None); else exactly its keys, 0-d
    fp32, sane values. ``name(key)`` says how a key is named in messages (default ``where[key]``)."""
    name = name or (lambda key: f"{where}[{key!r}]")
    if scaler is None:
        if saved is not None:
            raise _fail(where, "holds loss-scaler state but this optimizer does not scale the loss (the "
                               "checkpoint was saved with fp16 or loss_scale set: use the same config)")
        return
    if saved is None:
        raise _fail(where, "is None: the checkpoint has no loss-scaler state, this optimizer scales the loss")
    live = scaler.state_dict()
    if isinstance(saved, Mapping):
        missing = [k for k in live if k not in saved]
        if missing:
            raise _fail(name(missing[0]), "is missing")
    check_mapping(saved, where, tuple(live), allowed=tuple(live))
    for key, like in live.items():
        check_tensor(saved[key], name(key), like)
    try:  # the values: exactly the scaler's own rules (scale in [2**-126, 2**127], whole trackers, ...)
        scaler.validate_state_dict(saved)
    except ValueError as exc:
        key = next((k for k in live if f"'{k}'" in str(exc)), None)  # the scaler names the key it refused
        raise _fail(where if key is None else name(key), f"is refused by the loss scaler: {exc}") from None


def apply_common(view, step, group_updates, scaler_state, clip_grad, skip_threshold) -> None:
    """Copy the validated step, groups, scaler and thresholds into ``view``'s optimizer (a CheckpointView's; call
    only after every check passed)."""
    view.step.copy_(step)
    if view.scaler is not None:
        view.scaler.load_state_dict(scaler_state)
    for group, values in zip(view.param_groups, group_updates):
        group.update(copy.deepcopy(values))  # the live groups never alias the checkpoint's objects
    view.set_thresholds(clip_grad, skip_threshold)


def refuse_together(view, validate: Callable[[], Any], what: str) -> Any:
    """``validate()`` on this rank, then agree with the other data-parallel ranks of ``view``'s optimizer (a
    CheckpointView's; ``refuse_over``). Returns what ``validate`` returned."""
    group = view.comm.dp_group if view.layout.dp_size > 1 else None
    return refuse_over(group, validate, view.step.device, view.rank,
                       f"{what}: data-parallel rank {{rank}} refused the checkpoint")


def refuse_over(group, validate: Callable[[], Any], device, rank: int, refusal: str) -> Any:
    """``validate()`` on this rank, then agree over ``group`` (one small all-reduce; None: this rank alone): a
    rank that refuses refuses for all, so none of them copies anything and none waits in a post-load collective
    for a rank that raised. ``refusal`` names the refusing rank (``{rank}``, the rank in ``group`` that
    ``rank`` is) for the ranks that did not refuse. Returns what ``validate`` returned."""
    error = None
    try:
        validated = validate()
    except (ValueError, TypeError) as exc:
        error = exc
    if group is not None:
        refused = torch.tensor([0.0 if error is None else 1.0 + rank], device=device)
        torch.distributed.all_reduce(refused, op=torch.distributed.ReduceOp.MAX, group=group)
        if error is None and refused.item() > 0:  # host read: loading happens between steps
            raise StateDictError(refusal.format(rank=int(refused.item()) - 1)
                                 + " (see its error); nothing was loaded on any rank")
    if error is not None:
        raise error
    return validated


def all_params(domains) -> list:
    """The params the flat format indexes: every domain's, the dense params' first."""
    return [p for domain in domains for p in domain.buffers.params]
