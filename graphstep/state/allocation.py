"""Allocate a ``Layout`` once, as ``StaticBuffers`` (graphstep/state/buffers.py), and make the model's params
views of it, values preserved; main params and state kept below fp32 (graphstep/state/precision.py) get their
``StoredState`` here, with their pieces."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from ..plan.layout import Layout
from ..fp8.engine_support import main_values
from .buffers import StaticBuffers
from .precision import RemainderMain, Storage, StoredState
from .state_ranges import plan_state_ranges


def allocate(layout: Layout, params: Sequence[torch.nn.Parameter], *, rank: int, device: torch.device,
             main_dtype: torch.dtype, state_names: Sequence[str], host: Optional[Any] = None,
             group_states: Optional[Sequence[Sequence[str]]] = None,
             state_storage: Optional[dict[str, Storage]] = None,
             main_storage: Optional[dict[torch.dtype, Storage]] = None) -> StaticBuffers:
    """Allocate ``layout`` and make ``params`` (in layout order) views of it, values preserved.

    ``host`` (graphstep.offload.HostShards): the device keeps main params and state for the prefix
    ``[0, host.splits[b])`` of each shard only; the host part is seeded here like the device part.

    ``group_states`` (per param group, the state names its family keeps): each state buffer then holds only
    the elements of those groups (graphstep/state/state_ranges.py); without it, or with ``host``, every state
    buffer spans the whole shard.

    ``state_storage`` (name -> graphstep/state/precision.py ``Storage``): states kept below fp32, each piece of
    them (one param's part of the shard) with a scale of its own where the dtype is scaled. ``main_storage``
    (param dtype -> ``Storage``): the main params of buffers of such params, kept below ``main_dtype``.

    The main params are seeded from the params' values *before* any cast to the model dtype, so a model
    built in fp32 and trained in bf16 keeps its fp32 initialisation in the main params. An fp8 weight
    (graphstep.fp8) seeds them with its dequantized values.

    No hook is registered here: the fp32 main grads accumulate once the optimizer's one hook per param
    listens for them (``listen_for_main_grads``).
    """
    if len(params) != len(layout.params):
        raise ValueError(f"allocate: {len(params)} params for a layout of {len(layout.params)}")
    main_storage = main_storage or {}
    originals = [_original(p) for p in params]
    dp_size = layout.dp_size

    param_flat, grad_flat, main_shard = [], [], []
    device_numel = [buf.shard_numel if host is None else host.splits[b] for b, buf in enumerate(layout.buffers)]
    for b, buf in enumerate(layout.buffers):
        param_flat.append(torch.zeros(buf.numel, dtype=buf.param_dtype, device=device))
        grad_flat.append(torch.zeros(buf.numel, dtype=buf.grad_dtype, device=device))
        below = main_storage.get(buf.param_dtype)
        if buf.param_dtype == main_dtype:
            main_shard.append(param_flat[-1])  # the params are the main params: updated in place
        else:
            main_shard.append(torch.zeros(device_numel[b], dtype=main_dtype if below is None else below.dtype,
                                          device=device))
    if dp_size == 1:
        grad_shard = list(grad_flat)
    else:  # per bucket, this rank's slice of the grads: the reduce-scatter's in-place output
        grad_shard = [grad_flat[b.buffer][slice(*b.shard_range(rank))] for b in layout.buckets]
    kept_by = [state_names] * layout.num_groups if group_states is None else group_states
    ranges = plan_state_ranges(layout, rank, kept_by, state_names, whole=host is not None)
    low = {name: s for name, s in (state_storage or {}).items() if name in state_names and s.dtype != main_dtype}
    state = {name: [torch.zeros(n if ranges[name].whole(b) else ranges[name].numel[b],
                                dtype=low[name].dtype if name in low else main_dtype, device=device)
                    for b, n in enumerate(device_numel)] for name in state_names}
    stored = {}
    for name, storage in low.items():
        if host is not None or not all(ranges[name].whole(b) for b in range(len(layout.buffers))):
            raise ValueError(f"state {name!r} below fp32 needs every param group to keep it on the device")
        stored[name] = [StoredState(storage, data, _piece_starts(layout, rank, b, data.numel()))
                        for b, data in enumerate(state[name])]

    buffers = StaticBuffers(layout, rank, param_flat, grad_flat, main_shard, grad_shard, state, list(params),
                            host=host, state_ranges=ranges, stored=stored)
    if any(main_storage.get(buf.param_dtype) for buf in layout.buffers):
        if host is not None:
            raise ValueError("main params below fp32 stay on the device: not with CPU offload")
        buffers.stored["main"] = [_stored_main(buffers, b, main_storage.get(buf.param_dtype))
                                  for b, buf in enumerate(layout.buffers)]
    grads_before = []
    for i, p in enumerate(params):
        place = layout.params[i]
        if tuple(p.shape) != place.shape:
            raise ValueError(f"param '{place.name}': shape {tuple(p.shape)} does not match the layout's "
                             f"{place.shape}")
        view = buffers.param_view(i)
        view.copy_(originals[i])
        grads_before.append(p.grad)
        p.grad = None  # before the (maybe dtype-changing) rebind; its values go into the grad buffer below
        p.data = view
    for owned in layout.owned_ranges(rank):
        buf = layout.params[owned.param].buffer
        size = owned.param_end - owned.param_start
        on_device = owned.shard_start + size <= device_numel[buf]
        if on_device and main_shard[buf].data_ptr() == param_flat[buf].data_ptr():
            continue  # fp32 params: the main params are the params
        source = main_values(params[owned.param], originals[owned.param]).reshape(-1)
        source = source[owned.param_start:owned.param_end]
        buffers.write_part("main", buf, owned.shard_start, size, source)

    for i, p in enumerate(params):
        p.main_grad = buffers.grad_view(i)  # also what marks the param as owned by these buffers (owns)
        buffers._main_grads.append(p.main_grad)
    buffers.record_bindings()
    buffers.bind_grads()
    _take_grads(buffers, grads_before)
    return buffers


def _original(param: torch.nn.Parameter) -> torch.Tensor:
    """The param's values as they were before the rebind: a detached alias of its storage, which rebinding
    ``param.data`` to a view of the flat buffer leaves untouched and alive while the alias holds it. No
    copy: a clone of every param would be a second copy of the model in memory during the build and one
    more pass over it. A tensor subclass (an fp8 weight) is still cloned: its
    ``detach`` need not keep the values its ``data`` held."""
    values = param.detach()
    return values if type(values) is torch.Tensor else values.clone()


def _take_grads(buffers: StaticBuffers, grads: list) -> None:
    """The grads a backward left before the build go into the grad buffers (as main grads: cast to their
    dtype), so the first step applies them, as a torch optimizer built after that backward would."""
    for i, grad in enumerate(grads):
        if grad is not None:
            buffers.grad_view(i).copy_(grad)
            buffers.grads_taken_at_build += 1


def _stored_main(buffers: StaticBuffers, buffer: int, storage: Optional[Storage]) -> Optional[StoredState]:
    if storage is None:
        return None
    data, starts = buffers.main_shard[buffer], _piece_starts(buffers.layout, buffers.rank, buffer,
                                                              buffers.main_shard[buffer].numel())
    if not storage.remainder:
        return StoredState(storage, data, starts)

    def high(start: int, end: int) -> torch.Tensor:
        flat = buffers._flat_offset(buffer, start, end - start)
        return buffers.param_flat[buffer][flat:flat + end - start]

    return RemainderMain(data, starts, high)


def _piece_starts(layout: Layout, rank: int, buffer: int, numel: int) -> list[int]:
    """Where each piece of this rank's shard of ``buffer`` starts: a piece is one param's part of the shard
    (what checkpoints address) or a run of padding, so every segment (the update's unit) and every bucket's
    shard is whole pieces."""
    owned = [o for o in layout.owned_ranges(rank) if layout.params[o.param].buffer == buffer]
    segments = [s for s in layout.segments(rank) if s.buffer == buffer]
    starts = {0} | {o.shard_start for o in owned} | {o.shard_start + o.param_end - o.param_start for o in owned}
    starts |= {s.shard_start for s in segments} | {s.shard_end for s in segments}
    starts |= {layout.buckets[i].shard_offset for i in layout.buffers[buffer].buckets}
    return sorted(x for x in starts if x < numel)
