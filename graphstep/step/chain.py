"""The order of the stages (graphstep/step/stages/): the step every caller runs, and the publish step a
checkpoint load runs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from . import qk_clip
from .stages import Stage, clip, gather, loss_scale, norm, reduce, requantize, update, zeros

if TYPE_CHECKING:
    from .domains import Domain


def default_chain(domains: Sequence["Domain"]) -> list[Stage]:
    """The step's stages, in order, for the domains' layouts and the config.

    ``domains`` (domains.py): the dense params' first, then any expert one (the MoE expert params',
    graphstep/plan/experts.py). Each domain's reduce, update, copy-back, requantize and gather stages run in
    turn, named by the domain (``expert_*``); the norm, zero count, clip and loss-scale stages run once over
    all of them, on the first domain's step scalars (shared by every context), and only the first domain's
    update advances the step count they share.
    """
    contexts = [domain.ctx for domain in domains]
    first = contexts[0]
    stages = [domain.named(stage) for domain in domains for stage in reduce.first_stages(domain.ctx)]
    stages.append(norm.build(*contexts))
    if first.tensors.num_zeros is not None:
        stages.append(zeros.build(*contexts))
    stages.append(clip.build(first))
    stages += [domain.named(update.build(domain.ctx, advance_step=domain.ctx is first)) for domain in domains]
    if first.config.qk_clip:
        stages.append(qk_clip.build_stage(first))  # dense weights, on the main params: before copy-back and requantize
    for domain in domains:
        stages.append(domain.named(update.build_copy_back(domain.ctx)))
        fp8_requantize = requantize.build(domain.ctx)  # None without fp8 weights
        if fp8_requantize is not None:
            stages.append(domain.named(fp8_requantize))
    stages += [domain.named(gather.build(domain.ctx)) for domain in domains if domain.layout.dp_size > 1]
    stages.append(loss_scale.build(first))
    return stages


def publish_chain(domains: Sequence["Domain"]) -> list[Stage]:
    """Main params → model params (and the all-gather across ranks), per domain: what a checkpoint load runs."""
    stages = []
    for domain in domains:
        stages.append(update.build_copy_back(domain.ctx))
        fp8_requantize = requantize.build(domain.ctx, publish=True)
        if fp8_requantize is not None:
            stages.append(fp8_requantize)
        if domain.layout.dp_size > 1:
            stages.append(gather.build(domain.ctx, deferrable=False))
    return stages
