"""What the spawned ranks of tests/distributed/test_fp8_sharded.py run (module-level for "spawn")."""

from __future__ import annotations

import math

import torch

from graphstep import fp8
from graphstep.config import OptimizerConfig
from graphstep import get_optimizer
from _harness import local_loss, tiny_transformer

STEPS = 12
INF_STEP = 5
BUCKET = 1000  # one fp8 weight per bucket: every rank owns a slice of each, none a whole one


def fp8_config(recipe: str, world_size: int, **changes) -> OptimizerConfig:
    extra = dict(fp8_amax_history_len=3, fp8_amax_compute_algo="max") if recipe == "delayed" else {}
    fields = dict(lr=3e-3, weight_decay=0.1, clip_grad=0.5, bucket_size=BUCKET, capture="eager", bf16=True,
                  use_distributed_optimizer=world_size > 1, distributed_timeout_s=20.0, fp8_recipe=recipe,
                  **extra)
    fields.update(changes)
    return OptimizerConfig(**fields)


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8).clone()


def train(recipe: str, rank: int, world_size: int, capture: str = "eager") -> dict:
    """Train an fp8 toy; the last rank makes step INF_STEP's grads non-finite. Per step: every fp8 byte and
    scale; the bytes each all-gather moved (counted from the eager calls)."""
    model = tiny_transformer(dtype=torch.bfloat16)
    fp8.convert(model, recipe=recipe, **(dict(amax_history_len=3, amax_compute_algo="max")
                                         if recipe == "delayed" else {}))
    opt = get_optimizer(fp8_config(recipe, world_size, capture=capture, capture_warmup_steps=2), model)
    weights = [p for p in model.parameters() if fp8.is_fp8(p)]
    gathered = []  # (dtype, bytes) per all-gather call
    plain_all_gather = opt.comm.all_gather

    def counting_all_gather(whole, mine, what, **kwargs):
        gathered.append((str(whole.dtype), whole.numel() * whole.element_size()))
        return plain_all_gather(whole, mine, what, **kwargs)

    opt.comm.all_gather = counting_all_gather
    steps = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = local_loss(model, step, rank, world_size)
        if step == INF_STEP and rank == world_size - 1:
            loss = loss * math.inf
        loss.backward()
        ok = bool(opt.step().update_successful.item())
        steps.append({
            "ok": ok,
            "bytes": [_raw(p) for p in weights],
            "scale": [p.fp8_meta.scale.clone() for p in weights],
            "scale_inv": [p.fp8_meta.scale_inv.clone() for p in weights],
            "history": [p.fp8_meta.amax_history.clone() for p in weights],
            "loss": float(loss.item()) if ok else None,
        })
    fp8_buffers = [b for b, buf in enumerate(opt.layout.buffers) if buf.param_dtype in fp8.FP8_DTYPES]
    return {
        "steps": steps,
        "gathered": gathered,
        "fp8_buffer_numel": sum(opt.layout.buffers[b].numel for b in fp8_buffers),
        "other_buffer_bytes": sum(opt.layout.buffers[b].numel * 2 for b in range(len(opt.layout.buffers))
                                  if b not in fp8_buffers),
        "fp8_numel": sum(p.numel() for p in weights),
        "captured": bool(opt.captured),
        "params": [p.detach().float().clone() for p in model.parameters()],
    }


def both_recipes(rank: int, world_size: int) -> dict:
    return {recipe: train(recipe, rank, world_size) for recipe in ("tensorwise", "delayed")}


def capture_vs_eager(rank: int, world_size: int) -> dict:
    return {mode: train("delayed", rank, world_size, capture=mode) for mode in ("eager", "graph")}


def overlap_vs_plain(rank: int, world_size: int) -> dict:
    """The same fp8 run with ``overlap_param_gather`` (all-gathers deferred to forward pre-hooks) and without."""
    out = {}
    for overlap in (False, True):
        model = tiny_transformer(dtype=torch.bfloat16)
        fp8.convert(model)
        opt = get_optimizer(fp8_config("tensorwise", world_size, overlap_param_gather=overlap,
                                       overlap_grad_reduce=overlap), model)
        for step in range(6):
            opt.zero_grad()
            local_loss(model, step, rank, world_size).backward()
            opt.step()
        opt.finish_param_gather()
        out[overlap] = {"params": [_raw(p) for p in model.parameters()], "counts": opt.overlap_counts}
    return out


# ---- checkpoints (tests/distributed/test_fp8_checkpoint_resharding.py) ----------------------------------------------
def _fp8_state(model) -> list:
    """Every byte of the model: fp8 bytes and their scale, scale_inv, amax history; the other params."""
    out = []
    for p in model.parameters():
        out.append(_raw(p))
        if fp8.is_fp8(p):
            out += [_raw(p.fp8_meta.scale), _raw(p.fp8_meta.scale_inv), _raw(p.fp8_meta.amax_history)]
    return out


def _fp8_engine(recipe: str, world_size: int):
    model = tiny_transformer(dtype=torch.bfloat16)
    fp8.convert(model, recipe=recipe, **(dict(amax_history_len=3, amax_compute_algo="max")
                                         if recipe == "delayed" else {}))
    return model, get_optimizer(fp8_config(recipe, world_size), model)


def _steps(model, opt, rank: int, world_size: int, steps) -> None:
    for step in steps:
        opt.zero_grad()
        local_loss(model, step, rank, world_size).backward()
        opt.step()


def checkpoint_then_continue(rank: int, world_size: int, root: str) -> dict:
    """Per recipe: 3 steps, ``graphstep.checkpoint.save``, 3 more; the state at the save and at the end."""
    import graphstep as gs

    out = {}
    for recipe in ("tensorwise", "delayed"):
        model, opt = _fp8_engine(recipe, world_size)
        _steps(model, opt, rank, world_size, range(3))
        gs.checkpoint.save(opt, f"{root}/{recipe}")
        at_save = _fp8_state(model)
        _steps(model, opt, rank, world_size, range(3, 6))
        out[recipe] = {"at_save": at_save, "final": _fp8_state(model)}
    return out


def resume_from_checkpoint(rank: int, world_size: int, root: str) -> dict:
    """Per recipe: a fresh fp8 model and optimizer at this data-parallel size, ``graphstep.checkpoint.load``,
    the same 3 steps the saving run took after its save; the state after the load and at the end."""
    import graphstep as gs

    out = {}
    for recipe in ("tensorwise", "delayed"):
        model, opt = _fp8_engine(recipe, world_size)
        fresh = _fp8_state(model)
        gs.checkpoint.load(opt, f"{root}/{recipe}")
        at_load = _fp8_state(model)
        _steps(model, opt, rank, world_size, range(3, 6))
        out[recipe] = {"fresh": fresh, "at_load": at_load, "final": _fp8_state(model)}
    return out
