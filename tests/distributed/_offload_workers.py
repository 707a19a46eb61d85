"""What the spawned ranks of tests/distributed/test_offload_sharded.py run: the distributed optimizer with
hybrid CPU offload against the same run without it."""

from __future__ import annotations

import math

import torch

from graphstep.config import OptimizerConfig
from graphstep import get_optimizer
from _harness import local_loss, tiny_transformer

STEPS = 12
INF_STEP = 5
FRACTIONS = (None, 0.3, 0.5, 1.0)  # None: no offload, the reference
RUNS = (("adam", {}, "eager"), ("adam", {"bf16": True}, "graph"),
        ("sgd", {"fp16": True, "initial_loss_scale": 2.0**10}, "eager"),
        ("adam", {"bf16": True, "main_grads_dtype": torch.bfloat16}, "eager"))  # bf16 grads: cast for the update


def _config(rule: str, precision: dict, mode: str, fraction, world_size: int) -> OptimizerConfig:
    offload = {} if fraction is None else {"optimizer_cpu_offload": True, "optimizer_offload_fraction": fraction}
    return OptimizerConfig(optimizer=rule, lr=3e-3, weight_decay=0.1, clip_grad=0.5, bucket_size=3000,
                           use_distributed_optimizer=True, capture=mode, capture_warmup_steps=2,
                           distributed_timeout_s=20.0, **precision, **offload)


def _train(config: OptimizerConfig, rank: int, world_size: int) -> dict:
    model = tiny_transformer()
    opt = get_optimizer(config, model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))
    ok = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = local_loss(model, step, rank, world_size)
        if step == INF_STEP and rank == world_size - 1:
            loss = loss * math.inf
        opt.scale_loss(loss).backward()
        ok.append(bool(opt.step().update_successful))
        sched.step()
    opt.finish_param_gather()
    sd = opt.state_dict()
    sharded = {k: _local(v) for k, v in opt.sharded_state_dict().items() if k.startswith("optimizer.state.")}
    return {"params": [p.detach().clone() for p in model.parameters()], "ok": ok,
            "main": sd["main_params"], "state": sd["state"], "sharded": sharded,
            "host_numel": sum(t.numel() for t in opt.host_tensors.get("main_params", [])),
            # Separate fp32 main params only (fp32 params are their own main params, in param_flat).
            "device_main_numel": sum(0 if is_param else t.numel()
                                     for t, is_param in zip(opt.buffers.main_shard, opt.buffers.main_is_param)),
            "device_state_numel": sum(t.numel() for tensors in opt.buffers.state.values() for t in tensors),
            "grad_cast_numel": sum(t.numel() for t in opt.buffers.scratch.get("grad_cast", [])),
            "device_part_numel": sum(opt.buffers.device_numel(b) for b in range(len(opt.layout.buffers))),
            "captured": opt.captured}


def _local(entry):
    """This rank's slice of a per-param entry (None where it owns none): a ShardedTensor does not pickle."""
    if not hasattr(entry, "local_shards"):
        return entry
    shards = entry.local_shards()
    return shards[0].tensor.clone() if shards else None


def offload_parity(rank: int, world_size: int) -> dict:
    return {(rule, str(precision), mode, fraction): _train(_config(rule, precision, mode, fraction, world_size),
                                                           rank, world_size)
            for rule, precision, mode in RUNS for fraction in FRACTIONS}


def overlap_refused(rank: int, world_size: int) -> str:
    config = _config("adam", {}, "eager", 0.5, world_size).replace(overlap_cpu_optimizer_d2h_h2d=True)
    try:
        get_optimizer(config, tiny_transformer())
    except ValueError as exc:
        return str(exc)
    return "no error"
