"""fp8 weights in the optimizer's checkpoints: the bytes and the scaling state, exact.

The main params alone do not determine an fp8 weight under the delayed recipe: its bytes were cast with the
*previous* scale and its amax history reaches back ``fp8_amax_history_len`` steps. So both checkpoint forms
carry, per fp8 weight, ``scale``, ``scale_inv``, ``amax_history`` and its bytes (``data``, uint8), replicated
across data-parallel ranks. A load copies them in after ``publish_params``, so the next step runs bitwise as it
would have without the save.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .params import is_fp8

KINDS = ("data", "scale", "scale_inv", "amax_history")
SHARDED_PREFIX = "optimizer.fp8."


class Fp8StateError(ValueError):
    """fp8 state in a checkpoint refused (the loaders re-raise it as their own error, key named)."""


def weights(layout, params) -> list[tuple[str, torch.nn.Parameter]]:
    """(model name, param) of every fp8 weight among ``params`` (the dense flat buffers' params, laid out by
    ``layout``), in layout order: what the functions below take as ``named``."""
    return [(place.name, params[place.index]) for place in layout.params if is_fp8(params[place.index])]


def _live(param: torch.nn.Parameter, kind: str) -> torch.Tensor:
    if kind == "data":
        return param.detach().reshape(-1).view(torch.uint8)
    return getattr(param.fp8_meta, kind)


def sharded_key(kind: str, name: str) -> str:
    return f"{SHARDED_PREFIX}{kind}.{name}"


# ---- save -----------------------------------------------------------------------------------------------
def flat_state(named: list) -> Optional[dict]:
    """The flat format's ``fp8`` entry of the fp8 weights ``named`` (``weights``): their names and one list per
    kind (copies); None without fp8 weights."""
    if not named:
        return None
    state = {"params": [name for name, _ in named]}
    for kind in KINDS:
        state[kind] = [_live(p, kind).clone() for _, p in named]
    return state


def sharded_entries(named: list, *, snapshot: bool = True) -> dict:
    """The reshardable format's fp8 entries of the fp8 weights ``named`` (``weights``),
    ``optimizer.fp8.<kind>.<param name>`` (copies when ``snapshot``, else views of the live tensors)."""
    take = (lambda t: t.clone()) if snapshot else (lambda t: t)
    return {sharded_key(kind, name): take(_live(p, kind)) for name, p in named for kind in KINDS}


def sharded_template(named: list) -> dict:
    """Fresh tensors shaped like ``sharded_entries`` for DCP to load into."""
    return {sharded_key(kind, name): torch.empty_like(_live(p, kind)) for name, p in named for kind in KINDS}


# ---- load -----------------------------------------------------------------------------------------------
def _check(value: Any, where: str, like: torch.Tensor, kind: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise Fp8StateError(f"{where} must be a tensor, got {type(value).__name__}")
    if value.dtype != like.dtype or value.shape != like.shape:
        raise Fp8StateError(f"{where} is {value.dtype} {tuple(value.shape)}, expected {like.dtype} {tuple(like.shape)}")
    if kind != "data":
        if not bool(torch.isfinite(value).all()):
            raise Fp8StateError(f"{where} holds NaN or inf: refusing to load a corrupted checkpoint")
        if kind in ("scale", "scale_inv") and not bool((value > 0).all()):
            raise Fp8StateError(f"{where} is not positive: an fp8 scale is always > 0")
        if kind == "amax_history" and bool((value < 0).any()):
            raise Fp8StateError(f"{where} holds negative values: an amax is never negative")
    return value


def check_flat(named: list, saved: Any, where: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Validate the flat format's ``fp8`` entry against the fp8 weights ``named`` (``weights``); returns the
    (target, source) copies. Raises ValueError (the caller wraps it into its own error type) naming the key."""
    if not named:
        if saved is not None:
            raise Fp8StateError(f"{where} holds fp8 state but this model has no fp8 weights (graphstep.fp8.convert "
                           "the same layers before get_optimizer)")
        return []
    if saved is None:
        raise Fp8StateError(f"{where} is missing: this model has fp8 weights and the checkpoint no fp8 state (saved "
                       "without fp8 weights, or by an older graphstep)")
    if not isinstance(saved, dict) or set(saved) != {"params", *KINDS}:
        raise Fp8StateError(f"{where} must be a dict with keys {['params', *KINDS]}")
    names = [name for name, _ in named]
    if saved["params"] != names:
        raise Fp8StateError(f"{where}['params'] names other fp8 weights ({saved['params']!r:.80}) than this model's "
                       f"({names!r:.80})")
    copies = []
    for kind in KINDS:
        values = saved[kind]
        if not isinstance(values, (list, tuple)) or len(values) != len(named):
            raise Fp8StateError(f"{where}[{kind!r}] must be a list of {len(named)} tensors (one per fp8 weight)")
        for (name, p), value in zip(named, values):
            live = _live(p, kind)
            copies.append((live, _check(value, f"{where}[{kind!r}] of '{name}'", live, kind)))
    return copies


def check_sharded(named: list, sd: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Validate the reshardable format's fp8 entries against the fp8 weights ``named`` (``weights``); returns the
    (target, source) copies."""
    copies = []
    for name, p in named:
        for kind in KINDS:
            key = sharded_key(kind, name)
            if key not in sd:
                raise Fp8StateError(f"[{key!r}] is missing: this model has fp8 weights and the checkpoint no fp8 "
                               "state for it (saved without fp8 weights, or by an older graphstep)")
            live = _live(p, kind)
            copies.append((live, _check(sd[key], f"[{key!r}]", live, kind)))
    unknown = sorted(k for k in sd if k.startswith(SHARDED_PREFIX) and
                     k not in {sharded_key(kind, name) for name, _ in named for kind in KINDS})
    if unknown:
        raise Fp8StateError(f"[{unknown[0]!r}] is fp8 state of a weight this model does not hold in fp8 "
                       "(convert the same layers, with graphstep.fp8.convert, before get_optimizer)")
    return copies


@torch.no_grad()
def apply(copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy validated fp8 state in place (after ``publish_params``: it replaces the publish's recast)."""
    for target, source in copies:
        target.copy_(source)
