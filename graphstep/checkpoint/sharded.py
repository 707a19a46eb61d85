"""The reshardable checkpoint format: per param, model-named, this rank's slice with its global offset.

``sharded_state_dict`` returns a flat dict in Megatron-Core's fully-reshardable naming
(``optimizer.state.<state>.<param name>``, ``optimizer.step``, ``optimizer.scaler.<key>``, fp8 state,
and the groups and metadata as JSON in a uint8 tensor: a load never unpickles anything); padding is never
saved. Why ``ShardedTensor`` and not ``DTensor``: a rank's slice of a param is an arbitrary contiguous range,
which DTensor's ``Shard(0)`` (torch.chunk's even split) cannot express; ShardedTensor takes explicit offsets,
computed locally from the layout, and DCP reshards it across any data-parallel size. torch warns it is
deprecated; the warning is silenced here only. ``load_sharded_state_dict`` ends with ``opt.publish_params()``
(the post-load all-gather: a resume that skips it diverges).
"""

from __future__ import annotations

import functools
import json
import warnings
from typing import Any, Callable

import torch

from ..families import state_spec
from ..fp8 import checkpoint as fp8_checkpoint
from ..step.domains import refuse_checkpoint
from . import checks
from .param_pieces import group_ranks, ownership
from .view import CheckpointView

FORMAT = "graphstep-sharded"
FORMAT_VERSION = 1
MAIN_PARAM = "fp32_param"
STATE_PREFIX = "optimizer.state."
STEP_KEY = "optimizer.step"
GROUPS_KEY = "optimizer.param_groups"
META_KEY = "optimizer.meta"
SCALER_PREFIX = "optimizer.scaler."


def state_key(kind: str, param_name: str) -> str:
    return f"{STATE_PREFIX}{kind}.{param_name}"


def state_kinds(view) -> tuple[str, ...]:
    """The per-param kinds saved: the main params, then the dense buffers' states. ``view``: a CheckpointView, or
    the optimizer (tools and tests call it with one): anything with the dense ``buffers``."""
    return (MAIN_PARAM,) + tuple(view.buffers.state)


def _buffer_kind(kind: str) -> str:
    return "main" if kind == MAIN_PARAM else kind


def _kind_part(buffers, kind: str, buffer: int, start: int, size: int) -> torch.Tensor:
    """The values of this rank's shard elements [start, start + size) of ``kind``, on the device or (CPU
    offload) host: a view, or a copy of the fp32 values of a kind kept below fp32 (graphstep/state/precision.py)."""
    return buffers.read_part(_buffer_kind(kind), buffer, start, size)


def _kind_dtype(buffers, kind: str, buffer: int) -> torch.dtype:
    """The dtype ``kind`` is saved in: its buffer's, fp32 for a kind kept below it."""
    return buffers.shard_like(_buffer_kind(kind), buffer).dtype


def _kept(buffers, kind: str, buffer: int, start: int, size: int) -> bool:
    """Whether ``kind`` has elements there: a state only for the params of the families that keep it
    (graphstep/state/state_ranges.py). The format still holds every state for every param, as it always has:
    a state another family keeps is saved as the zeros it has always been, and not loaded."""
    return kind == MAIN_PARAM or buffers.keeps_state(kind, buffer, start, size)


def _saved_part(buffers, kind: str, buffer: int, start: int, size: int) -> torch.Tensor:
    if _kept(buffers, kind, buffer, start, size):
        return _kind_part(buffers, kind, buffer, start, size)
    return torch.zeros(size, dtype=_kind_dtype(buffers, kind, buffer), device=buffers.state[kind][buffer].device)


def encode_json(value: Any) -> torch.Tensor:
    return torch.tensor(list(json.dumps(value).encode("utf-8")), dtype=torch.uint8)


def decode_json(tensor: Any, where: str) -> Any:
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.uint8 or tensor.dim() != 1:
        raise checks.StateDictError(f"load_sharded_state_dict: {where} must be a 1-D uint8 tensor of JSON text")
    try:
        return json.loads(bytes(tensor.tolist()).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise checks.StateDictError(f"load_sharded_state_dict: {where} is not valid JSON ({exc})") from None


def _sharded(local: torch.Tensor | None, place, owners: list, global_ranks: list[int], rank: int,
             dtype: torch.dtype):
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

    device = "cpu" if local is None else local.device
    shards_md = [ShardMetadata([o.param_start], [o.param_end - o.param_start],
                               f"rank:{global_ranks[r]}/{device}") for r, o in owners]
    metadata = ShardedTensorMetadata(shards_md, torch.Size([place.numel]),
                                     TensorProperties(dtype=dtype, layout=torch.strided))
    local_shards = [] if local is None else [Shard(local, shards_md[[r for r, _ in owners].index(rank)])]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ShardedTensor's deprecation notice: see the module docstring
        return ShardedTensor._init_from_local_shards_and_global_metadata(local_shards, metadata)


def _build(view: CheckpointView, slice_fn: Callable[[torch.Tensor], torch.Tensor]) -> dict:
    """The per-param entries, each rank's slice produced by ``slice_fn(view of the live slice)``."""
    layout, rank, buffers = view.layout, view.rank, view.buffers
    owners = ownership(layout)
    sharded = layout.dp_size > 1
    global_ranks = group_ranks(view.comm.dp_group, layout.dp_size) if sharded else None
    out = {}
    for kind in state_kinds(view):
        for place in layout.params:
            mine = [o for r, o in owners[place.index] if r == rank]
            local = None
            if mine:
                o = mine[0]
                local = slice_fn(_saved_part(buffers, kind, place.buffer, o.shard_start, o.param_end - o.param_start))
            dtype = _kind_dtype(buffers, kind, place.buffer)
            out[state_key(kind, place.name)] = (
                _sharded(local, place, owners[place.index], global_ranks, rank, dtype) if sharded else local)
    return out


def _meta(view: CheckpointView) -> dict:
    clip_grad, skip_threshold = view.thresholds()
    return {"format": FORMAT, "version": FORMAT_VERSION, "optimizer": view.config.optimizer,
            "state": list(view.buffers.state), "params": {p.name: list(p.shape) for p in view.layout.params},
            "scaler": None if view.scaler is None else sorted(view.scaler.state_dict()),
            "clip_grad": clip_grad, "grad_norm_skip_threshold": skip_threshold}


def _groups(view: CheckpointView) -> list[dict]:
    return [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"}
            for g in view.param_groups]


def sharded_state_dict(opt, *, snapshot: bool = False) -> dict:
    """This rank's part of the reshardable checkpoint of the optimizer ``opt``: a flat dict of
    ``optimizer.state.<fp32_param|exp_avg|exp_avg_sq|momentum_buffer|...>.<param name>`` (the param's flattened
    elements, global shape ``(numel,)``: a ``ShardedTensor`` of this rank's owned ranges with several
    data-parallel ranks, else a plain tensor), ``optimizer.step`` and ``optimizer.scaler.<key>`` (0-d fp32),
    ``optimizer.fp8.<data|scale|scale_inv|amax_history>.<param name>`` with fp8 weights, and
    ``optimizer.param_groups`` / ``optimizer.meta`` (JSON text in a uint8 tensor).

    The per-param entries are views of the live buffers (no copy; a kind kept below fp32 is a copy of its
    values) unless ``snapshot``: then they are copies, so the dict keeps the state of this call while training
    goes on (what an async save needs).
    """
    return entries(opt.checkpoint_view(), snapshot=snapshot)


def entries(view: CheckpointView, *, snapshot: bool = False) -> dict:
    """``sharded_state_dict`` of the optimizer ``view`` shows."""
    refuse_checkpoint(view, "sharded_state_dict")
    view.finish_param_gather()
    take = (lambda part: part.clone()) if snapshot else (lambda part: part)
    sd = _build(view, take)
    sd[STEP_KEY] = view.step.clone()
    if view.scaler is not None:
        for key, value in view.scaler.state_dict().items():
            sd[SCALER_PREFIX + key] = value.clone()
    sd.update(fp8_checkpoint.sharded_entries(view.fp8_weights(), snapshot=snapshot))  # replicated: saved once
    sd[GROUPS_KEY] = encode_json(_groups(view))
    sd[META_KEY] = encode_json(_meta(view))
    return sd


def load_template(view: CheckpointView, json_sizes: dict[str, int]) -> dict:
    """Fresh tensors shaped like ``entries(view)`` for DCP to load into (``json_sizes``: the saved lengths of the
    JSON entries, from the checkpoint's metadata)."""
    refuse_checkpoint(view, "load")
    sd = _build(view, torch.empty_like)
    sd[STEP_KEY] = torch.empty_like(view.step)
    if view.scaler is not None:
        for key, value in view.scaler.state_dict().items():
            sd[SCALER_PREFIX + key] = torch.empty_like(value)
    sd.update(fp8_checkpoint.sharded_template(view.fp8_weights()))
    for key in (GROUPS_KEY, META_KEY):
        sd[key] = torch.empty(json_sizes[key], dtype=torch.uint8)
    return sd


def _fail(where: str, problem: str) -> checks.StateDictError:
    return checks.StateDictError(f"load_sharded_state_dict: {where} {problem}")


def check_meta(view: CheckpointView, meta: Any) -> None:
    """Format and version known; the same params (names and shapes) and state kinds as this optimizer."""
    checks.check_mapping(meta, f"[{META_KEY!r}]", ("format", "version", "params", "state", "scaler", "clip_grad",
                                                  "grad_norm_skip_threshold"))
    if meta["format"] != FORMAT:
        raise _fail(f"[{META_KEY!r}]['format']", f"is {meta['format']!r:.60}, expected {FORMAT!r}")
    if meta["version"] != FORMAT_VERSION or type(meta["version"]) is not int:
        raise _fail(f"[{META_KEY!r}]['version']", f"is {meta['version']!r:.30}: this graphstep reads format "
                                                   f"version {FORMAT_VERSION} only (upgrade graphstep?)")
    if meta.get("optimizer") != view.config.optimizer:
        raise _fail(f"[{META_KEY!r}]['optimizer']", f"is {meta.get('optimizer')!r:.30}, this optimizer is "
                                                     f"{view.config.optimizer!r}")
    saved = meta["params"]
    if not isinstance(saved, dict):
        raise _fail(f"[{META_KEY!r}]['params']", "must be a dict of param name to shape")
    live = {p.name: list(p.shape) for p in view.layout.params}
    where = f"[{META_KEY!r}]['params']"
    for name in live:
        if name not in saved:
            raise _fail(f"param '{name}'", f"is missing from the checkpoint's {where} (saved from another "
                                           "model?)")
        if saved[name] != live[name]:
            raise _fail(f"param '{name}'", f"has shape {saved[name]!r:.40} in the checkpoint's {where}, "
                                           f"{live[name]} here")
    for name in saved:
        if name not in live:
            raise _fail(f"param '{name}'", f"is in the checkpoint's {where} but not in this model (another "
                                           "model?)")
    if meta["state"] != list(view.buffers.state):
        raise _fail(f"[{META_KEY!r}]['state']", f"is {meta['state']!r:.80}, this optimizer keeps "
                                                 f"{list(view.buffers.state)} (another optimizer family?)")


def _check_entry(buffers, value: Any, key: str, place, owned, nonnegative: bool) -> torch.Tensor | None:
    """This rank's slice of one per-param entry, validated; None where this rank owns none of it."""
    size = 0 if owned is None else owned.param_end - owned.param_start
    like = torch.empty(size, dtype=buffers.shard_like("main", place.buffer).dtype)
    if value is None and owned is None:
        return None
    if hasattr(value, "local_shards"):  # a ShardedTensor: exactly this rank's range
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ShardedTensor's deprecation notice: see the module docstring
            global_shape, shards = tuple(value.size()), value.local_shards()
        if global_shape != (place.numel,):
            raise _fail(f"[{key!r}]", f"has global shape {global_shape}, expected ({place.numel},)")
        offsets = [s.metadata.shard_offsets[0] for s in shards]
        expected = [] if owned is None else [owned.param_start]
        if offsets != expected:
            raise _fail(f"[{key!r}]", f"holds offsets {offsets} on this rank, expected {expected}")
        if owned is None:
            return None
        value = shards[0].tensor
    elif isinstance(value, torch.Tensor) and value.dim() == 1 and value.shape[0] == place.numel and size:
        value = value[owned.param_start:owned.param_end]  # a full (unsharded) entry: take this rank's part
    elif isinstance(value, torch.Tensor) and tuple(value.shape) == (place.numel,) and owned is None:
        return None  # a full entry of a param this rank owns none of
    return checks.check_tensor(value, f"[{key!r}]", like, nonnegative=nonnegative)


@torch.no_grad()
def load_sharded_state_dict(opt, sd: Any) -> None:
    """Validate ``sd`` (see the module docstring) entirely, then copy into the optimizer ``opt``'s static buffers
    and publish the params (collective with several ranks). A refused checkpoint names the key; nothing changed."""
    load(opt.checkpoint_view(), sd)


def load(view: CheckpointView, sd: Any) -> None:
    """``load_sharded_state_dict`` into the optimizer ``view`` shows."""
    refuse_checkpoint(view, "load_sharded_state_dict")
    apply_validated(view, validate_everywhere(view, sd))


def validate_everywhere(view: CheckpointView, sd: Any) -> dict:
    """``validate`` on this rank, refusing together with the other data-parallel ranks."""
    return checks.refuse_together(view, lambda: validate(view, sd), "load_sharded_state_dict")


def validate(view: CheckpointView, sd: Any) -> dict:
    """Every check of a load, nothing copied; returns what ``apply_validated`` copies."""
    checks.check_mapping(sd, "sharded state dict", (META_KEY, GROUPS_KEY, STEP_KEY))
    meta = decode_json(sd[META_KEY], f"[{META_KEY!r}]")
    check_meta(view, meta)
    buffers = view.buffers
    owned = {o.param: o for o in view.layout.owned_ranges(view.rank)}
    copies = []
    for kind in state_kinds(view):
        for place in view.layout.params:
            key = state_key(kind, place.name)
            if key not in sd:
                raise _fail(f"[{key!r}]", "is missing")
            mine = owned.get(place.index)
            nonnegative = kind != MAIN_PARAM and state_spec(kind).nonnegative  # as its family declares
            source = _check_entry(buffers, sd[key], key, place, mine, nonnegative=nonnegative)
            if source is not None and _kept(buffers, kind, place.buffer, mine.shard_start, source.numel()):
                copies.append(functools.partial(buffers.write_part, _buffer_kind(kind), place.buffer,
                                                mine.shard_start, source.numel(), source))
    checks.check_step(sd[STEP_KEY], f"[{STEP_KEY!r}]", view.step)
    scaler = None
    if meta["scaler"] is not None:
        if not isinstance(meta["scaler"], list) or not all(isinstance(k, str) for k in meta["scaler"]):
            raise _fail(f"[{META_KEY!r}]['scaler']", "must be a list of the scaler's keys")
        scaler = {k: sd.get(SCALER_PREFIX + k) for k in meta["scaler"]}
    checks.check_scaler(view.scaler, scaler, "[optimizer.scaler.*]", name=lambda key: f"[{SCALER_PREFIX + key!r}]")
    groups = _match_groups(view.param_groups, decode_json(sd[GROUPS_KEY], f"[{GROUPS_KEY!r}]"))
    updates = checks.check_param_groups(view, groups, f"[{GROUPS_KEY!r}]", check_indices=False)
    for values, group in zip(updates, view.param_groups):
        for key, value in values.items():  # JSON has no tuples: give back the live group's type
            if isinstance(group.get(key), tuple) and isinstance(value, list):
                values[key] = tuple(value)
    checks.check_thresholds(meta["clip_grad"], meta["grad_norm_skip_threshold"], f"[{META_KEY!r}]")
    try:
        fp8_copies = fp8_checkpoint.check_sharded(view.fp8_weights(), sd)
    except fp8_checkpoint.Fp8StateError as exc:
        raise checks.StateDictError(f"load_sharded_state_dict: {exc}") from None
    return {"copies": copies, "fp8_copies": fp8_copies, "step": sd[STEP_KEY], "groups": updates, "scaler": scaler,
            "clip_grad": meta["clip_grad"], "grad_norm_skip_threshold": meta["grad_norm_skip_threshold"]}


@torch.no_grad()
def apply_validated(view: CheckpointView, plan: dict) -> None:
    """Copy what ``validate`` accepted into the static buffers, then publish the params (collective)."""
    for write in plan["copies"]:
        write()
    checks.apply_common(view, plan["step"], plan["groups"], plan["scaler"], plan["clip_grad"],
                        plan["grad_norm_skip_threshold"])
    view.publish_params()
    fp8_checkpoint.apply(plan["fp8_copies"])  # the saved fp8 bytes and scales replace the publish's recast


def _match_groups(param_groups: list, saved: Any) -> list:
    """The saved groups in the order of ``param_groups`` (the optimizer's), matched by their params' names."""
    if not isinstance(saved, list) or not all(isinstance(g, dict) for g in saved):
        raise _fail(f"[{GROUPS_KEY!r}]", "must be a list of dicts")
    by_names = {}
    for g in saved:
        names = g.get("param_names")
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise _fail(f"[{GROUPS_KEY!r}]['param_names']", "must be a list of param names in every group")
        by_names[frozenset(names)] = g
    ordered = []
    for i, group in enumerate(param_groups):
        match = by_names.get(frozenset(group.get("param_names", ())))
        if match is None:
            raise _fail(f"[{GROUPS_KEY!r}]", f"has no group with the params of this optimizer's group {i} "
                                             f"({group.get('param_names', [])[:3]}...): other overrides?")
        ordered.append({**match, "param_names": list(group["param_names"])})
    return ordered + [g for g in saved if frozenset(g["param_names"]) not in
                      {frozenset(x.get("param_names", ())) for x in param_groups}]
