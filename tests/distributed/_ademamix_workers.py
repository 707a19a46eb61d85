"""What the spawned ranks of tests/test_ademamix.py run: AdEMAMix with sharded state
(``use_distributed_optimizer=True``), eager and captured, α and β3 moving by the paper's warm-ups, clipping
on, one non-finite step on the last rank; the same function with one rank is the single-process reference."""

from __future__ import annotations

import math

from graphstep.config import OptimizerConfig
from graphstep import get_optimizer
from graphstep.families.ademamix import alpha_warmup, beta3_warmup
from _harness import local_loss, tiny_transformer

STEPS, INF_STEP, WARMUP = 12, 5, 8
MODES = ("eager", "graph")


def train(rank: int, world_size: int, capture: str) -> dict:
    config = OptimizerConfig(optimizer="ademamix", lr=3e-3, weight_decay=0.1, adam_beta2=0.95, ademamix_beta3=0.999,
                             ademamix_alpha=5.0, clip_grad=0.5, bucket_size=3000, capture=capture,
                             capture_warmup_steps=2, use_distributed_optimizer=world_size > 1,
                             distributed_timeout_s=20.0)
    model = tiny_transformer()
    start = [p.detach().clone() for p in model.parameters()]
    opt = get_optimizer(config, model)
    ok = []
    for step in range(STEPS):
        for group in opt.param_groups:
            group["alpha"] = alpha_warmup(step, 5.0, WARMUP)
            group["beta3"] = beta3_warmup(step, 0.999, WARMUP, beta_start=0.9)
        opt.zero_grad()
        loss = local_loss(model, step, rank, world_size)
        if step == INF_STEP and rank == world_size - 1:
            loss = loss * math.inf
        loss.backward()
        ok.append(bool(opt.step().update_successful.item()))
    opt.finish_param_gather()
    return {"params": [p.detach().clone() for p in model.parameters()], "start": start, "ok": ok,
            "captured": bool(opt.captured), "recaptures": opt.recaptures,
            "state_numel": sum(t.numel() for ts in opt.buffers.state.values() for t in ts),
            "param_numel": sum(p.numel() for p in model.parameters())}


def both_modes(rank: int, world_size: int) -> dict:
    return {mode: train(rank, world_size, mode) for mode in MODES}
