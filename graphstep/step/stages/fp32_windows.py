"""The update's fp32 windows onto main params and optimizer state kept below fp32
(``use_precision_aware_optimizer``: graphstep/state/precision.py).

A group whose segments hold such a kind is updated a chunk of whole pieces at a time: each stored kind's
chunk is read into an fp32 scratch (one per kind, as long as the longest chunk), the family's kernel runs on
those windows and the chunk's other views, and the windows are written back (stages/update.py runs it).
"""

from __future__ import annotations

from typing import Optional

import torch

from ...families import GroupViews
from ...state import precision


def scratch(ctx, segments) -> dict[str, torch.Tensor]:
    """Per kind kept below fp32 (a state, or "main": graphstep/state/precision.py), the one fp32 scratch its
    chunks are read into: as long as the longest chunk of any segment."""
    buffers, longest = ctx.buffers, 0
    for segment in segments:
        stored = stored_in(buffers, segment.buffer)
        if stored:
            kind, state = next(iter(stored.items()))
            start = offset(buffers, kind, segment)
            runs = precision.chunks(state, start, start + segment.numel)
            longest = max([longest] + [end - start for start, end in runs])
    kinds = {kind for segment in segments for kind in stored_in(buffers, segment.buffer)}
    scratch = {kind: torch.empty(longest, dtype=torch.float32, device=buffers.grad_flat[0].device)
               for kind in sorted(kinds)}
    if scratch:
        buffers.scratch["state_fp32"] = list(scratch.values())
    return scratch


def stored_in(buffers, buffer: int) -> dict:
    """kind -> its ``StoredState`` in ``buffer``, for each kind kept below fp32 there."""
    return {kind: per_buffer[buffer] for kind, per_buffer in buffers.stored.items() if per_buffer[buffer] is not None}


def offset(buffers, kind: str, segment) -> int:
    """Where ``segment`` starts in ``kind``'s buffer (a compact state buffer, or the main params' shard)."""
    if kind == "main":
        return segment.shard_start
    return buffers.state_ranges[kind].offset(segment.buffer, segment.shard_start, segment.numel)


def chunks(ctx, views: GroupViews, segments, scratch: dict[str, torch.Tensor]) -> Optional[list]:
    """For a group with main params or a state kept below fp32: its update cut into chunks of whole pieces,
    each ``(views over the chunk, [(StoredState, start, end, fp32 window)])``, the stored kinds' views
    replaced by windows onto their scratch. None for a group with everything in full precision."""
    buffers = ctx.buffers
    if not any(stored_in(buffers, segment.buffer) for segment in segments):
        return None
    chunks = []
    for k, segment in enumerate(segments):
        stored = {kind: state for kind, state in stored_in(buffers, segment.buffer).items()
                  if kind == "main" or kind in views.state}
        if not stored:  # a buffer of other params in the same group: its segment whole, as it lies
            chunks.append((GroupViews([views.params[k]], [views.grads[k]],
                                      {name: [tensors[k]] for name, tensors in views.state.items()}), []))
            continue
        offsets = {kind: offset(buffers, kind, segment) for kind in stored}
        first = next(iter(stored))  # every stored kind of a buffer has the same pieces: chunk by any
        for start, end in precision.chunks(stored[first], offsets[first], offsets[first] + segment.numel):
            lo, numel = start - offsets[first], end - start

            def window(kind, tensors):
                return scratch[kind][:numel] if kind in stored else tensors[k][lo:lo + numel]

            chunk_views = GroupViews([window("main", views.params)], [views.grads[k][lo:lo + numel]],
                                     {name: [window(name, tensors)] for name, tensors in views.state.items()})
            windows = [(state, offsets[kind] + lo, offsets[kind] + lo + numel, scratch[kind][:numel])
                       for kind, state in stored.items()]
            chunks.append((chunk_views, windows))
    return chunks


def run(family, kernels, chunks: list, kwargs: dict, scalars, config, grad_scale, keep: torch.Tensor) -> None:
    """One group's update over ``chunks``: read each chunk's windows, run the family's kernel, write them back
    (``keep``, 0-d bool: False on a skipped step, which keeps the stored scales)."""
    for chunk_views, windows in chunks:
        scaled = next((w for w in windows if w[0].storage.scaled), None)
        index = None if scaled is None else scaled[0].piece_index(scaled[1], scaled[2])  # the chunk's kinds share it
        for state, start, end, window in windows:
            state.read(start, end, out=window, index=index)
        family.run(kernels, [(chunk_views, kwargs)], scalars, config, grad_scale)
        for state, start, end, window in windows:
            state.write(start, end, window, keep=keep, index=index)
