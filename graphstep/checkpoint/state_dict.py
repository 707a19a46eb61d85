"""The engine's ``state_dict`` / ``load_state_dict``: this rank's flat buffers, exact, for ``torch.save`` flows.

A load is all or nothing: every key is validated first, then copied into the existing static buffers
(addresses never change, so a captured step stays valid); a refused load names the key and changes nothing.
Called by torch.distributed.checkpoint.state_dict, ``state_dict`` answers in torch's format instead
(``torch_format.py``). The checks every format shares live in ``checks.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..families import state_spec
from ..fp8 import checkpoint as fp8_checkpoint
from . import torch_format
from .checks import (StateDictError, _fail, all_params, apply_common, check_mapping, check_param_groups, check_scaler,
                     check_step, check_tensor_list, check_thresholds, plain_equal, refuse_together)
from .view import CheckpointView

STATE_DICT_FORMAT = "graphstep/1"
_TOP_KEYS = ("format", "layout", "rank", "step", "main_params", "state", "param_groups", "scaler", "clip_grad",
             "grad_norm_skip_threshold")
_FP8_KEY = "fp8"  # only with fp8 weights (graphstep.fp8.checkpoint): their bytes and scaling state
# A domain's entries (graphstep/step/domains.py): the dense one's at the top level, an expert one's under its
# role's ``checkpoint_path`` (the expert params': "experts").
_DOMAIN_KEYS = ("layout", "rank", "main_params", "state")


def state_dict(view: CheckpointView) -> dict:
    """This rank's flat buffers, exact, for ``torch.save`` flows at the same layout: every domain's entries
    (graphstep/step/domains.py; the expert params' under ``"experts"``), then the step-wide ones. Called by
    torch's checkpoint API, torch's optimizer format instead (``torch_format.py``)."""
    caller = torch_format.torch_api_caller()
    if caller is not None:
        return torch_format.state_dict(view, caller)
    view.finish_param_gather()
    groups = []
    index = {id(p): i for i, p in enumerate(all_params(view.domains))}
    for group in view.param_groups:
        saved = {k: v for k, v in group.items() if k != "params"}
        saved["params"] = [index[id(p)] for p in group["params"]]
        groups.append(saved)
    clip_grad, skip_threshold = view.thresholds()
    saved = {
        "format": STATE_DICT_FORMAT,
        "step": view.step.clone(),
        "param_groups": groups,
        "scaler": None if view.scaler is None else view.scaler.state_dict(),
        "clip_grad": clip_grad,
        "grad_norm_skip_threshold": skip_threshold,
    }
    for domain in view.domains:
        _at(saved, domain.role.checkpoint_path).update(_domain_entries(domain))
    fp8_state = fp8_checkpoint.flat_state(view.fp8_weights())
    if fp8_state is not None:
        saved[_FP8_KEY] = fp8_state
    # The top-level keys in their documented order, then the expert domains' and fp8's.
    return {key: saved[key] for key in (*_TOP_KEYS, *(k for k in saved if k not in _TOP_KEYS))}


def _domain_entries(domain) -> dict:
    buffers = domain.buffers
    return {
        "layout": domain.layout.fingerprint(),
        "rank": domain.rank,
        # Whole shards (copies), wherever their elements live (device, or host with CPU offload).
        "main_params": [buffers.full_shard("main", b) for b in range(len(buffers.main_shard))],
        "state": {name: [buffers.full_shard(name, b) for b in range(len(tensors))]
                  for name, tensors in buffers.state.items()},
    }


def _at(mapping: dict, path: tuple[str, ...]) -> dict:
    """The nested dict at ``path`` in ``mapping`` (created empty where missing); ``mapping`` itself for ()."""
    for key in path:
        mapping = mapping.setdefault(key, {})
    return mapping


def _check_buffers(buffers, saved: Mapping, where: str) -> Mapping:
    """``saved['main_params']`` and ``saved['state']`` match ``buffers``; returns the state by name."""
    # Whole compact shards, as saved (wherever their elements live: device, or host with CPU offload).
    check_tensor_list(saved["main_params"], f"{where}['main_params']",
                      [buffers.shard_like("main", b) for b in range(len(buffers.main_shard))])
    states = dict(check_mapping(saved["state"], f"{where}['state']", tuple(buffers.state),
                                allowed=tuple(buffers.state)))
    for name, tensors in buffers.state.items():  # each state's invariants as its family declares them
        states[name] = _kept_state(buffers, name, states[name])
        check_tensor_list(states[name], f"{where}['state'][{name!r}]", [buffers.shard_like(name, b)
                          for b in range(len(tensors))], nonnegative=state_spec(name).nonnegative)
    return states


def _kept_state(buffers, name: str, saved: Any) -> Any:
    """A state's saved shards reduced to the elements this optimizer keeps (``shard_like``'s shape): a
    checkpoint written while every state buffer spanned the whole shard holds them for every group.
    Anything else is returned as it is, for ``check_tensor_list`` to judge."""
    if not isinstance(saved, (list, tuple)) or len(saved) != len(buffers.state[name]):
        return saved
    return [buffers.compact_state(name, b, t)
            if torch.is_tensor(t) and t.dim() == 1 and t.numel() == buffers.layout.buffers[b].shard_numel else t
            for b, t in enumerate(saved)]


# ---- load -----------------------------------------------------------------------------------------------
@torch.no_grad()
def load_state_dict(view: CheckpointView, state_dict: Any) -> None:
    """Validate everything (on every data-parallel rank, refusing together), then copy into the existing
    buffers (addresses never change) and refresh the model params. A refused checkpoint raises
    ``StateDictError`` naming the key; nothing has changed on any rank. A dict in torch's optimizer format
    (``{"state", "param_groups"}``: torch's ``set_state_dict`` passes one) loads through ``torch_format.py``."""
    if torch_format.is_torch_format(state_dict):
        torch_format.load_state_dict(view, state_dict)
        return
    states, updates, fp8_copies = refuse_together(view, lambda: _validate(view, state_dict), "load_state_dict")

    # Everything is valid: copy. Nothing below can fail on a checked value.
    for buffers, saved, saved_states in states:
        for b, source in enumerate(saved["main_params"]):
            buffers.load_shard("main", b, source)
        for name in buffers.state:
            for b, source in enumerate(saved_states[name]):
                buffers.load_shard(name, b, source)
    apply_common(view, state_dict["step"], updates, state_dict["scaler"], state_dict["clip_grad"],
                 state_dict["grad_norm_skip_threshold"])
    view.publish_params()
    fp8_checkpoint.apply(fp8_copies)  # the saved fp8 bytes and scales replace the publish's recast


def _check_domain(domain, state_dict: Mapping, where: str) -> tuple:
    """A domain's saved entries match it: (its buffers, its saved mapping, its state tensors by name)."""
    saved = state_dict
    for key in domain.role.checkpoint_path:
        where = f"{where}[{key!r}]"
        saved = check_mapping(saved[key], where, _DOMAIN_KEYS, allowed=_DOMAIN_KEYS)
    if not plain_equal(saved["layout"], domain.layout.fingerprint()):
        raise _fail(f"{where}['layout']", domain.role.layout_mismatch)
    if type(saved["rank"]) is not int or saved["rank"] != domain.rank:
        raise _fail(f"{where}['rank']", domain.role.rank_mismatch.format(saved=saved["rank"], rank=domain.rank))
    return domain.buffers, saved, _check_buffers(domain.buffers, saved, where)


def _validate(view: CheckpointView, state_dict: Any) -> tuple:
    """Every check of a flat load, nothing copied: ((buffers, saved entries, state tensors by name) per
    domain, the group updates, the fp8 copies)."""
    where = "state_dict"
    keys = _TOP_KEYS + tuple(d.role.checkpoint_path[0] for d in view.domains if d.role.checkpoint_path)
    check_mapping(state_dict, where, keys, allowed=keys + (_FP8_KEY,))
    if not plain_equal(state_dict["format"], STATE_DICT_FORMAT):
        raise _fail(f"{where}['format']", f"is {state_dict['format']!r:.60}, expected {STATE_DICT_FORMAT!r}")
    check_step(state_dict["step"], f"{where}['step']", view.step)
    states = [_check_domain(domain, state_dict, where) for domain in view.domains]
    updates = check_param_groups(view, state_dict["param_groups"], f"{where}['param_groups']", check_indices=True)
    check_scaler(view.scaler, state_dict["scaler"], f"{where}['scaler']")
    check_thresholds(state_dict["clip_grad"], state_dict["grad_norm_skip_threshold"], where)
    try:
        fp8_copies = fp8_checkpoint.check_flat(view.fp8_weights(), state_dict.get(_FP8_KEY), f"{where}[{_FP8_KEY!r}]")
    except fp8_checkpoint.Fp8StateError as exc:
        raise StateDictError(f"load_state_dict: {exc}") from None
    return states, updates, fp8_copies
