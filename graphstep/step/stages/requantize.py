"""Requantize fp8 weights from the updated fp32 main params, inside the step (graphstep.fp8).

Runs after the update, in place of the copy-back for fp8 buffers (a plain cast would be wrong: fp8 bytes hold
``value * scale``). Per fp8 weight, on this rank's piece: the local amax into one static vector, one MAX
all-reduce of it so every rank derives the same scale, then the recipe (graphstep/fp8/scaling.py) casts into this
rank's slice of ``param_flat``, which the gather stage all-gathers. A skipped step changes no byte. The recipe's
constants come from the config, checked against each weight's conversion at build.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...fp8 import is_fp8, quantize, requantize_current, requantize_delayed
from ...fp8.scaling import FP8_DTYPES
from . import Stage


def _pieces(ctx) -> list[tuple[torch.Tensor, torch.Tensor, object]]:
    """(main view, fp8 data view, meta) per fp8 weight, in layout order; empty views where not owned."""
    buffers, layout = ctx.buffers, ctx.layout
    owned = {r.param: r for r in layout.owned_ranges(ctx.rank)}
    pieces = []
    for i, place in enumerate(layout.params):
        param = buffers.params[i]
        if not is_fp8(param):
            continue
        main, flat = buffers.main_shard[place.buffer], buffers.param_flat[place.buffer]
        r = owned.get(i)
        if r is None:
            pieces.append((main[:0], flat[:0], param.fp8_meta))
            continue
        size = r.param_end - r.param_start
        pieces.append((main[r.shard_start:r.shard_start + size], flat[r.flat_start:r.flat_start + size],
                       param.fp8_meta))
    return pieces


def build(ctx, *, publish: bool = False) -> Optional[Stage]:
    """The requantize stage, or None when the model has no fp8 weights.

    ``publish=True`` (``publish_params``, after a checkpoint load copied into the main params) requantizes
    whatever the last step's ``found_inf`` was, and for the delayed recipe only recasts with the current
    scale: no amax enters the history, since no step ran. (A checkpoint load then copies the saved fp8 bytes
    and scaling state over it, graphstep/fp8/checkpoint.py, so a delayed-recipe resume is bitwise.)
    """
    pieces = _pieces(ctx)
    if not pieces:
        return None
    config, comm = ctx.config, ctx.comm
    device = pieces[0][0].device
    amaxes = torch.zeros(len(pieces), dtype=torch.float32, device=device)
    amax_views = [amaxes[k] for k in range(len(pieces))]
    owned = [(main, amax_views[k]) for k, (main, _, _) in enumerate(pieces) if main.numel() > 0]
    found_inf = torch.zeros((), dtype=torch.float32, device=device) if publish else ctx.tensors.found_inf
    margin, algo = config.fp8_margin, config.fp8_amax_compute_algo
    delayed = config.fp8_recipe == "delayed"

    if publish and delayed:
        def recast() -> None:
            for main, data, meta in pieces:
                data.copy_(quantize(main, meta.scale, data.dtype))
                meta.scale_inv.copy_(torch.reciprocal(meta.scale))

        return Stage("requantize", recast)

    def apply() -> None:
        amaxes.zero_()
        for main, target in owned:
            # max |x| = max(|min|, |max|): one reading pass, no |x| temporary. NaN propagates through
            # aminmax and maximum: a NaN amax gives scale 1.
            low, high = torch.aminmax(main)
            torch.maximum(low.abs(), high.abs(), out=target)
        comm.all_reduce_max(amaxes, "fp8 amax all-reduce (max)")
        for (main, data, meta), amax_value in zip(pieces, amax_views):
            if delayed:
                requantize_delayed(main, amax_value, data, meta.scale, meta.scale_inv, meta.amax_history,
                                   found_inf, margin, algo)
            else:
                requantize_current(main, amax_value, data, meta.scale, meta.scale_inv, found_inf, margin)

    return Stage("requantize", apply)


def is_fp8_buffer(buffer_layout) -> bool:
    """Whether a buffer of the layout holds fp8 weights (the copy-back leaves those to this stage)."""
    return buffer_layout.param_dtype in FP8_DTYPES
