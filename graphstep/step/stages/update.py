"""The update on the main params, skip folded in; and the copy back into the model params.

One kernel call per param group over its segments of this rank's shard (Adam: one for all its groups), through
the group's family, whose views are cut once, here, at build (fp32 windows for state kept below fp32; Muon's
(n, r, c) runs). The step count advances by ``1 - found_inf`` first, so a skipped step leaves it, the params and
the state bitwise unchanged. Each kernel argument is resolved at build: a live field is the group's 0-d tensor, a
baked one read from the last refresh's host values; the baked floats are what this stage reports as baked.
The kernel gets the grad scale only when it can differ from 1: torch's fused kernels write the divided grads
back whenever they get one, bytes an unclipped, unscaled step need not move. That is a host choice a capture
bakes in; a flip recaptures.
"""

from __future__ import annotations

import dataclasses

import torch

from ...families import StepScalars, ViewSources
from ...kernels import compiled
from ...state import precision
from . import Stage, fp32_windows, grad_prescale, stored_kernel
from .requantize import is_fp8_buffer


def build(ctx, *, advance_step: bool = True) -> Stage:
    """``advance_step=False``: a second domain's update (expert params) in the same step, which must not
    advance the one step count the first already advanced."""
    buffers, hyper, kernels, t, config = ctx.buffers, ctx.hyper, ctx.kernels, ctx.tensors, ctx.config

    casts, kernel_grads, grads_in_flat = _kernel_grads(ctx)
    sources = ViewSources(buffers.main_shard, kernel_grads, buffers.state,
                          main_in_flat=_main_in_flat(ctx), grads_in_flat=grads_in_flat,
                          state_offset=_state_offset(buffers))

    scalars = StepScalars(t.step, t.found_inf)
    # Per (family, its kernels module): (family, kernels, its groups' [(views, live kwargs, baked)]), baked
    # as (keyword, row, column) of the host values.
    calls = []
    baked_sources = []  # (group, field, row, column), for the baked report
    segments = device_segments(ctx)
    planned = []  # (group, family, its kernels, views, segments, the stored-state kernels or None)
    for group, family in enumerate(ctx.families):
        if family.check is not None:
            family.check(ctx, group)
        mine = [s for s in segments if s.group == group]
        if not mine:
            continue  # this rank owns nothing of the group
        views = family.views(ctx, group, mine, sources.only(family.state_names(config)))
        family_kernels = _compiled_twin(family.kernels_for(kernels), kernels)
        planned.append((group, family, family_kernels, views, mine,
                        stored_kernel.build(ctx, family, family_kernels, views, mine)))
    # The fp32 windows' scratch only for the groups the compiled stored-state kernel does not run.
    decode_scratch = fp32_windows.scratch(ctx, [s for *_, mine, on_bytes in planned if on_bytes is None
                                                for s in mine])
    for group, family, family_kernels, views, mine, on_bytes in planned:
        stored_chunks = None if on_bytes is not None else fp32_windows.chunks(ctx, views, mine, decode_scratch)
        live = family.live_fields(kernels)
        live_kwargs, baked = {}, []
        for keyword, field in family.hyperparameters:
            if field in live:
                live_kwargs[keyword] = hyper.tensor(field, group)
            else:
                row, column = hyper.position(field, group)
                baked.append((keyword, row, column))
                baked_sources.append((group, field, row, column))
        if on_bytes is not None:  # its own call: the compiled kernel over this group's stored bytes
            family_kernels = on_bytes
        call = next((c for c in calls if c[0] is family and c[1] is family_kernels), None)
        if call is None:
            call = (family, family_kernels, [])
            calls.append(call)
        call[2].append((views, live_kwargs, tuple(baked), stored_chunks))

    clip_row, clip_column = hyper.position("clip_grad")
    scaled, torch_amp = ctx.scaler is not None, ctx.torch_amp
    host = hyper.host_rows  # a list the refresh updates in place: read it, never rebind it
    prescale = grad_prescale.build(ctx, segments, kernel_grads, grads_in_flat) if calls else None

    def loss_scaled() -> bool:
        return scaled or (torch_amp is not None and torch_amp.scaled)

    def uses_grad_scale() -> bool:
        return loss_scaled() or host[clip_row][clip_column] > 0

    def kernel_grad_scale():
        if not uses_grad_scale():
            return None
        if prescale is None or not loss_scaled():  # without a loss scale the factor is 1 / coefficient: finite
            return t.grad_scale
        return prescale()

    def apply() -> None:
        for source, target in casts:
            target.copy_(source)
        if advance_step:
            t.step.add_(1.0 - t.found_inf)
        grad_scale = kernel_grad_scale()
        keep = None
        for family, family_kernels, groups in calls:
            resolved, chunked = [], []
            for views, live_kwargs, baked, stored_chunks in groups:
                kwargs = {**live_kwargs, **{keyword: host[row][column] for keyword, row, column in baked}}
                (resolved if stored_chunks is None else chunked).append((views, kwargs, stored_chunks))
            if resolved:
                family.run(family_kernels, [(views, kwargs) for views, kwargs, _ in resolved], scalars, config,
                           grad_scale)
            for _, kwargs, stored_chunks in chunked:
                keep = t.found_inf == 0 if keep is None else keep
                fp32_windows.run(family, family_kernels, stored_chunks, kwargs, scalars, config, grad_scale, keep)

    def baked_values() -> tuple:
        values = tuple((f"group {group}", field, host[row][column]) for group, field, row, column in baked_sources)
        return values + (("step", "grad scale passed to the kernel", uses_grad_scale()),
                         ("step", "loss-scaled grads (the grad scale split where it overflows)", loss_scaled()))

    return Stage("update", apply, baked_values)


def _compiled_twin(family_kernels, configured):
    """A family's own kernels module, or under ``kernel="compiled"`` its compiled twin where it has one
    (``compiled_twin()``: AdEMAMix's)."""
    if configured is compiled and family_kernels is not configured and hasattr(family_kernels, "compiled_twin"):
        return family_kernels.compiled_twin()
    return family_kernels


def device_segments(ctx) -> list:
    """This rank's segments, cut to the part of the shard the device holds main params for: all of it, or
    with CPU offload the prefix ``[0, buffers.device_numel(b))`` (graphstep.offload updates the rest)."""
    limits = [ctx.buffers.device_numel(b) for b in range(len(ctx.buffers.main_shard))]
    cut = []
    for s in ctx.layout.segments(ctx.rank):
        end = min(s.shard_end, limits[s.buffer])
        if end > s.shard_start:
            cut.append(s if end == s.shard_end else
                       dataclasses.replace(s, shard_end=end, flat_end=s.flat_start + end - s.shard_start))
    return cut


def _main_in_flat(ctx) -> tuple[bool, ...]:
    """Per buffer: the main params are ``param_flat`` itself, addressed in flat coordinates (with one rank
    these equal the shard coordinates)."""
    return tuple(is_param and ctx.layout.dp_size > 1 for is_param in ctx.buffers.main_is_param)


def _kernel_grads(ctx) -> tuple[list, list, tuple[bool, ...]]:
    """(casts, per-buffer grads the kernel reads, whether each is addressed in flat coordinates).

    The kernel reads grads in the main params' dtype. Such grads are read where they lie: ``grad_flat``,
    whose slices this rank owns hold the reduced grads (stages/reduce.py). Other grads (half grads with
    fp32 main params) are cast into a compact fp32 scratch of this rank's shard before the kernels (of its
    device part, ``[0, buffers.device_numel(b))``, with CPU offload): ``casts`` lists (source piece, target
    piece) copies, and the scratch is registered as "grad_cast".
    """
    buffers, layout = ctx.buffers, ctx.layout
    main_dtype = precision.main_compute_dtype(ctx.config)
    casts, grads, in_flat, scratches = [], [], [], []
    for b, flat in enumerate(buffers.grad_flat):
        if flat.dtype == main_dtype:
            grads.append(flat)
            in_flat.append(layout.dp_size > 1)
            continue
        # With CPU offload only the device part: the host casts its own part.
        scratch = torch.empty(buffers.device_numel(b), dtype=main_dtype, device=flat.device)
        scratches.append(scratch)
        casts += [(flat[lo:lo + size], scratch[start:start + size]) for lo, start, size in _device_pieces(ctx, b)]
        grads.append(scratch)
        in_flat.append(False)
    if scratches:
        buffers.scratch["grad_cast"] = scratches
    return casts, grads, tuple(in_flat)


def build_copy_back(ctx) -> Stage:
    """Copy the updated main params into the model dtype. A skipped step copies unchanged main params, which
    round to the params' own values, or (main params kept in fp16) leaves the params as they are."""
    pairs = _copy_back_pairs(ctx)
    decoded = _decoded_copy_back(ctx)

    t = ctx.tensors

    def apply() -> None:
        for param_part, main_part in pairs:
            param_part.copy_(main_part)
        keep = t.found_inf == 0 if decoded else None
        for param_part, state, start, end in decoded:
            # The params need not be the decoded main params (at the first step they are the model's own values,
            # which the per-param fp16 encoding may not hold exactly): a skipped step keeps them as they are.
            param_part.copy_(torch.where(keep, state.read(start, end), param_part))

    return Stage("copy_back", apply)


def _copy_back_pairs(ctx) -> list:
    """(model-param view, main-param view) pairs the update copies into the model dtype.

    Nothing for buffers whose main params are the params (fp32 params, at any data-parallel size: the
    update wrote them in place). One copy of the whole buffer with one rank; with several, each bucket's
    owned shard (the gather stage then all-gathers the rest). Only the part of the shard whose main
    params are on the device (all of it without CPU offload; graphstep.offload copies the host part).
    """
    buffers = ctx.buffers
    pairs = []
    for b, buf in enumerate(ctx.layout.buffers):
        if buffers.main_is_param[b] or is_fp8_buffer(buf):  # fp8: the requantize stage writes those bytes
            continue
        if buffers.stored_kind("main", b) is not None:  # _decoded_copy_back's
            continue
        pairs += [(buffers.param_flat[b][lo:lo + size], buffers.main_shard[b][start:start + size])
                  for lo, start, size in _device_pieces(ctx, b)]
    return pairs


def _decoded_copy_back(ctx) -> list:
    """(model-param view, StoredState, start, end) of the main params kept in fp16 (graphstep/state/precision.py):
    copied back from their fp32 values, a chunk at a time (``precision.chunks``: the fp32 temporary stays a
    chunk's, as in the update). None for remainders: there the params are the main params' high half, which
    the update wrote."""
    buffers, copies = ctx.buffers, []
    for b in range(len(ctx.layout.buffers)):
        stored = buffers.stored_kind("main", b)
        if stored is None or stored.storage.remainder:
            continue
        for lo, start, size in _device_pieces(ctx, b):
            copies += [(buffers.param_flat[b][lo + first - start:lo + last - start], stored, first, last)
                       for first, last in precision.chunks(stored, start, start + size)]
    return copies


def _device_pieces(ctx, b: int) -> list[tuple[int, int, int]]:
    """(start in the flat buffer, start in the shard, size) of each piece of buffer ``b`` that this rank owns
    and whose main params are on the device (the prefix ``[0, buffers.device_numel(b))`` of the shard): with
    one rank the whole prefix in one piece, with several this rank's slice of each bucket, cut there."""
    on_device = ctx.buffers.device_numel(b)
    if ctx.layout.dp_size == 1:
        return [(0, 0, on_device)] if on_device else []
    pieces = []
    for index in ctx.layout.buffers[b].buckets:
        bucket = ctx.layout.buckets[index]
        size = min(bucket.shard_numel, on_device - bucket.shard_offset)
        if size > 0:
            pieces.append((bucket.shard_range(ctx.rank)[0], bucket.shard_offset, size))
    return pieces


def _state_offset(buffers):
    """Where a shard range sits in each (compact) state buffer: graphstep/state/state_ranges.py."""
    ranges = buffers.state_ranges
    return lambda name, buffer, start, numel: ranges[name].offset(buffer, start, numel)
