"""QK-clip (MuonClip) inside the step: after the update, before the copy-back, skipped step or not.

At build: the registered attention layers (``graphstep.qk_clip.register``) are found among the params
this optimizer trains; their per-head max-logit buffers become views of one static tensor (so one MAX
all-reduce covers every layer), and for each registered weight the factory precomputes where its rows
live in this rank's fp32 main params: a (rows, cols) view when the rank holds the whole weight, else a
flat slice and its element → row index (the distributed optimizer's shards cut weights anywhere).

Each step (device work only, no branch): MAX all-reduce of the maxima over the data-parallel group (a
head's max over all micro-batches of all ranks); per layer, per query group g, η_g = τ / S_g where
τ < S_g < inf, else exactly 1 (``graphstep.qk_clip.clip_factors``: S_g ≤ 0, ±inf or NaN keep 1); rows of W_q
times η^α, rows of W_k times η^(1−α), V untouched; then every buffer back to -inf for the next step's
forwards. The copy-back (and, with several ranks, the all-gather) then carries the scaled main params
to the model params. Megatron-Core runs QK-clip after ``optimizer.step()`` whether or not the step was
skipped; so does this stage (a skipped step leaves the update untouched, not the clip).

τ and α are ``OptimizerConfig`` fields, fixed for the optimizer's life (the config is frozen).
"""

from __future__ import annotations

import torch

from .. import qk_clip as qk
from . import Stage


def _targets(ctx, registration: qk.Registration) -> list:
    """(kind, 2-D view or flat slice, row index or None) per registered weight this rank owns part of."""
    index = {id(p): i for i, p in enumerate(ctx.buffers.params)}
    owned = {r.param: r for r in ctx.layout.owned_ranges(ctx.rank)}
    targets = []
    for kind, weight in registration.weights:
        if id(weight) not in index:
            raise ValueError(f"qk_clip: the {kind} weight registered for {type(registration.module).__name__} is not "
                             "trained by this optimizer (frozen, or in another model chunk); register trained "
                             "weights only")
        place = ctx.layout.params[index[id(weight)]]
        mine = owned.get(place.index)
        if mine is None:
            continue  # another rank holds all of it
        size = mine.param_end - mine.param_start
        flat = ctx.buffers.main_range(place.buffer, mine.shard_start, size)
        rows, cols = place.shape
        if size == rows * cols:
            targets.append((kind, flat.view(rows, cols), None))
        else:
            targets.append((kind, flat, qk.shard_row_index(mine.param_start, size, cols, device=flat.device)))
    return targets


def build(ctx) -> Stage:
    registrations = qk.registrations(ctx.buffers.params)
    if not registrations:
        raise ValueError("OptimizerConfig.qk_clip=True but no attention layer of the model is registered: call "
                         "graphstep.qk_clip.register(attention_module, layout=HeadLayout(...), q=..., k=...) (or "
                         "qkv=...) for each layer before get_optimizer, and graphstep.qk_clip.record(module, "
                         "scores) in its forward")
    device = ctx.buffers.main_shard[0].device
    total = sum(r.layout.num_heads for r in registrations)
    maxima = torch.full((total,), float("-inf"), device=device)
    layers, offset = [], 0
    for registration in registrations:
        heads = registration.layout.num_heads
        view = maxima[offset:offset + heads]
        view.copy_(registration.max_logits)  # keep what forwards recorded before the build
        setattr(registration.module, qk.BUFFER_NAME, view)  # record() now writes into the static tensor
        layers.append((registration.layout, view, _targets(ctx, registration)))
        offset += heads
    threshold, alpha, comm = ctx.config.qk_clip_threshold, ctx.config.qk_clip_alpha, ctx.comm

    def apply() -> None:
        comm.all_reduce_max(maxima, "qk-clip max-logit all-reduce")
        for layout, view, targets in layers:
            q_factor, k_factor = qk.clip_factors(view, layout, threshold, alpha)
            factors = qk.row_factors(layout, q_factor, k_factor)
            for kind, target, row_index in targets:
                if row_index is None:
                    target.mul_(factors[kind][:, None])
                else:
                    qk.scale_flat_rows_(target, factors[kind], row_index)
        qk.reset(maxima)

    return Stage("qk_clip", apply)
