"""Rank bodies for tests/distributed/test_ddp_half_params.py: bf16/fp16 params (fp32 main grads) under torch's
DistributedDataParallel, against the oracle of the same DDP over the same model with ``torch.optim.AdamW`` over
fp32 master copies of the params (what a torch user writes for half params: DDP averages ``p.grad``, the master
grads are its fp32 copy, unscaled, clipped by ``clip_grad_norm_``)."""

from __future__ import annotations

import warnings
from contextlib import nullcontext

import torch
import torch.utils.checkpoint
from torch.nn.parallel import DistributedDataParallel as DDP

import graphstep as gs

STEPS, BATCH = 5, 16  # 3 eager warm-up steps, then the captured step is replayed
LR, WEIGHT_DECAY, CLIP = 1e-2, 0.1, 0.5
LOSS_SCALE = 1024.0  # fp16's constant loss scale: a power of two, so unscaling is exact
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Checkpointed(torch.nn.Module):
    """The model under ``checkpoint(use_reentrant=True)``: its params' grads arrive in a nested backward."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.inner, x.requires_grad_(), use_reentrant=True)


def model(dtype: torch.dtype, checkpointed: bool = False) -> torch.nn.Module:
    # Params of at least one 4,096-element row: units the folded norm's backward hooks would fold.
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64)).to(dtype)
    return Checkpointed(net) if checkpointed else net


def data(step: int, micro: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(100 + 10 * step + micro)
    return torch.randn(BATCH, 64, generator=g).to(dtype), torch.randn(BATCH, 64, generator=g).to(dtype)


def config(precision: str, capture: str, **changes) -> gs.OptimizerConfig:
    scale = {"loss_scale": LOSS_SCALE} if precision == "fp16" else {}
    return gs.OptimizerConfig(lr=LR, weight_decay=WEIGHT_DECAY, clip_grad=CLIP, capture=capture, kernel="fused",
                              **{precision: True}, **scale, **changes)


def backward(net, rows, step: int, micro_batches: str, scale: float, after_reduced=lambda: None) -> None:
    """One step's backwards: one micro-batch ("one"), or two, the first under DDP's ``no_sync()`` ("no_sync")
    or both reduced ("both_reduced"). ``after_reduced()`` runs after each backward DDP reduced."""
    dtype = next(net.parameters()).dtype
    count = 1 if micro_batches == "one" else 2
    for micro in range(count):
        inputs, targets = data(step, micro, dtype)
        quiet = micro < count - 1 and micro_batches == "no_sync"
        with net.no_sync() if quiet else nullcontext():
            loss = torch.nn.functional.mse_loss(net(inputs[rows]).float(), targets[rows].float()) / count
            (loss * scale).backward()
        if not quiet:
            after_reduced()


def oracle(precision: str, rows, ddp_options: dict, micro_batches: str, checkpointed: bool, betas, eps) -> list:
    """DDP averages the half grads, each reduced backward's average is added into fp32 master grads; AdamW
    steps the fp32 master copies; the params are their rounding."""
    net = model(DTYPES[precision], checkpointed)
    wrapped = DDP(net, **ddp_options)
    master = [p.detach().float().clone() for p in net.parameters()]
    opt = torch.optim.AdamW(master, lr=LR, weight_decay=WEIGHT_DECAY, betas=betas, eps=eps)
    scale = LOSS_SCALE if precision == "fp16" else 1.0

    def take_average() -> None:
        for m, p in zip(master, net.parameters()):
            m.grad = p.grad.float() if m.grad is None else m.grad + p.grad.float()
            p.grad = None

    for step in range(STEPS):
        backward(wrapped, rows, step, micro_batches, scale, take_average)
        for m in master:
            m.grad /= scale
        torch.nn.utils.clip_grad_norm_(master, CLIP)
        opt.step()
        with torch.no_grad():
            for m, p in zip(master, net.parameters()):
                p.copy_(m)
        opt.zero_grad(set_to_none=True)
    return [m.clone() for m in master]


def graphstep_run(precision: str, capture: str, rows, *, ddp_options: dict, micro_batches: str = "one",
                  checkpointed: bool = False, ddp_after_build: bool = False, **changes) -> dict:
    net = model(DTYPES[precision], checkpointed)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if ddp_after_build:
            opt = gs.get_optimizer(config(precision, capture, **changes), net, config_overrides={})
            wrapped = DDP(net, **ddp_options)
        else:
            wrapped = DDP(net, **ddp_options)
            opt = gs.get_optimizer(config(precision, capture, **changes), wrapped, config_overrides={})
        scale = LOSS_SCALE if precision == "fp16" else 1.0
        for step in range(STEPS):
            backward(wrapped, rows, step, micro_batches, scale)
            opt.step()
            opt.zero_grad()
    group = opt.param_groups[0]
    return {"params": [p.detach().float().clone() for p in net.parameters()],
            "main_params": [t.clone() for t in _main_params(opt)],
            "betas": group["betas"], "eps": group["eps"], "captured": opt.captured,
            "grads_left": [p.grad is not None for p in net.parameters()],
            "warnings": [str(w.message) for w in seen if "graphstep" in str(w.message)]}


def _main_params(opt) -> list:
    """The fp32 main params, param by param (this rank holds them all: no distributed optimizer)."""
    buffers = opt.buffers
    out = [None] * len(buffers.params)
    for owned in buffers.layout.owned_ranges(buffers.rank):
        place = buffers.layout.params[owned.param]
        out[owned.param] = buffers.main_range(place.buffer, owned.shard_start, place.end - place.start).clone()
    return [values.view(place.shape) for values, place in zip(out, buffers.layout.params)]


# (name, precision, capture, DDP's options, micro-batches, graphstep config changes, extra options of the run:
# DDP wrapped after the build, the model under a reentrant checkpoint)
CASES = (
    ("bf16_eager", "bf16", "eager", {}, "one", {}, {}),
    ("bf16_graph", "bf16", "graph", {}, "one", {}, {}),
    ("fp16_eager", "fp16", "eager", {}, "one", {}, {}),
    ("fp16_graph", "fp16", "graph", {}, "one", {}, {}),
    ("bf16_ddp_after_build", "bf16", "graph", {}, "one", {}, {"ddp_after_build": True}),
    ("bf16_bucket_view", "bf16", "graph", {"gradient_as_bucket_view": True}, "one", {}, {}),
    ("fp16_bucket_view", "fp16", "graph", {"gradient_as_bucket_view": True}, "one", {}, {}),
    ("bf16_static_graph", "bf16", "graph", {"static_graph": True}, "one", {}, {}),
    ("bf16_no_sync", "bf16", "graph", {}, "no_sync", {}, {}),
    ("fp16_no_sync_bucket_view", "fp16", "eager", {"gradient_as_bucket_view": True}, "no_sync", {}, {}),
    ("bf16_both_reduced", "bf16", "graph", {}, "both_reduced", {}, {}),
    ("bf16_unfolded_norm", "bf16", "graph", {}, "one", {"fold_grad_norm": False}, {}),
    ("bf16_reentrant_checkpoint", "bf16", "eager", {}, "one", {}, {"checkpointed": True}),
    # (torch's DDP itself fails no_sync() with a static graph.)
    ("bf16_reentrant_checkpoint_static_graph", "bf16", "graph", {"static_graph": True}, "one", {},
     {"checkpointed": True}),
)


def scenarios(rank: int, world_size: int) -> dict:
    from graphstep.step import folded_sums

    folded_sums.UNIT_ROWS, folded_sums.HOOK_MIN_ELEMENTS = 1, 1  # units of one row, as small_fold_units (tests/conftest.py)
    rows = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)
    out = {}
    for name, precision, capture, ddp_options, micro_batches, changes, extra in CASES:
        run = graphstep_run(precision, capture, rows, ddp_options=ddp_options, micro_batches=micro_batches, **extra,
                            **changes)
        run["oracle"] = oracle(precision, rows, ddp_options, micro_batches, extra.get("checkpointed", False),
                               run["betas"], run["eps"])
        run["start"] = [p.detach().float().clone() for p in model(DTYPES[precision]).parameters()]
        out[name] = run

    # A float32 model inside DDP, cast to bf16 by the build: DDP's hooks stay on the float32 grad accumulators.
    try:
        gs.get_optimizer(config("bf16", "eager"), DDP(model(torch.float32)), config_overrides={})
        out["cast_after_wrapping"] = None
    except ValueError as err:
        out["cast_after_wrapping"] = str(err)

    # The distributed optimizer reduces the fp32 main grads itself: DDP around it would average twice.
    try:
        gs.get_optimizer(config("bf16", "eager", use_distributed_optimizer=True), DDP(model(torch.bfloat16)),
                         config_overrides={})
        out["refused_at_build"] = None
    except ValueError as err:
        out["refused_at_build"] = str(err)
    net = model(torch.bfloat16)
    opt = gs.get_optimizer(config("bf16", "eager", use_distributed_optimizer=True), net, config_overrides={})
    try:
        DDP(net)(data(0, 0, torch.bfloat16)[0][rows])
        out["refused_at_forward"] = None
    except RuntimeError as err:
        out["refused_at_forward"] = str(err)
    del opt
    return out
