"""Rank functions for tests/distributed/test_checkpoint_resharding.py (spawned by _harness.spawn).

Train the toy on dp ranks, save with graphstep.checkpoint, resume on another data-parallel size or
bucket layout, continue. The global batch (12 rows) splits evenly over 1, 2, 3 and 4 ranks, so every run
sees the same data; between data-parallel sizes the reduction order differs, and with bf16/fp16 params the
backward's rounding too (a 6-row slice's grads, averaged, are not the 12-row batch's).
"""

from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist

import graphstep as gs
from graphstep.checkpoint import sharded
from graphstep.config import OptimizerConfig
from graphstep import get_optimizer
from _harness import local_loss, tiny_transformer

GLOBAL_BATCH = 12
SAVE_AT = 4  # steps before the save
CONTINUE = 4  # steps after it
BUCKET = 3000  # several buckets: ranks own slivers of some params and none of others
ADAM = dict(optimizer="adam", lr=3e-3, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95)
CONFIGS = {
    "sgd": dict(optimizer="sgd", lr=0.05, weight_decay=1e-3, sgd_momentum=0.9),
    "adam": ADAM,
    # bf16/fp16 model params (fp32 main params): the backward itself rounds differently per batch split.
    # fp16's dynamic loss scale starts at 2^12 so that no step of the short run is skipped for overflow.
    "adam_bf16": dict(ADAM, bf16=True),
    "adam_fp16": dict(ADAM, fp16=True, initial_loss_scale=2.0**12),
    # The precision-aware optimizer: moments stored in bf16, fp32 main params as bf16 params + 16-bit remainders.
    # Checkpoints hold fp32 values, which both store exactly again on any layout.
    "adam_bf16_moments": dict(ADAM, bf16=True, use_precision_aware_optimizer=True, exp_avg_dtype=torch.bfloat16,
                              exp_avg_sq_dtype=torch.bfloat16, store_param_remainders=True),
    # Kinds scaled per piece (a param's part of a rank's shard): a load on another layout re-encodes them with
    # the new pieces' scales, so they come back within their rounding (SCALED).
    "adam_fp8_moments": dict(ADAM, bf16=True, use_precision_aware_optimizer=True, exp_avg_dtype=torch.uint8,
                             exp_avg_sq_dtype=torch.uint8, store_param_remainders=False),
    "adam_fp16_main": dict(ADAM, bf16=True, use_precision_aware_optimizer=True, main_params_dtype=torch.float16,
                           exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16),
}
# name -> the kinds it scales, and how far a re-encoded element may move, as a fraction of its piece's amax:
# half a step of the storage's coarsest spacing (E4M3: 32 at 448, so 1/28; fp16 at 32752: 2^-11), with margin.
# A lost or misplaced value is off by about the amax itself.
SCALED = {"adam_fp8_moments": (("exp_avg", "exp_avg_sq"), 1 / 16),
          "adam_fp16_main": (("exp_avg", "exp_avg_sq", "fp32_param"), 1e-3)}


def make_model(name: str, seed: int = 0):
    """The toy in the config's param dtype (built so: graphstep's bf16/fp16 cast of an fp32 model warns)."""
    config = CONFIGS[name]
    dtype = torch.bfloat16 if config.get("bf16") else torch.float16 if config.get("fp16") else torch.float32
    return tiny_transformer(seed, dtype=dtype)


def make_config(name: str, world_size: int, bucket_size: int = BUCKET) -> OptimizerConfig:
    return OptimizerConfig(**CONFIGS[name], clip_grad=0.5, bucket_size=bucket_size, capture="eager",
                           use_distributed_optimizer=world_size > 1, distributed_timeout_s=20.0)


def train(model, opt, rank: int, world_size: int, start: int, steps: int) -> None:
    for step in range(start, start + steps):
        opt.zero_grad()
        opt.scale_loss(local_loss(model, step, rank, world_size, GLOBAL_BATCH)).backward()
        opt.step()
    opt.finish_param_gather()


def owned_state(opt) -> dict:
    """{"kind|param name": (param_start, this rank's slice)}, read through the per-param views."""
    out = {}
    for owned in opt.layout.owned_ranges(opt.rank):
        place = opt.layout.params[owned.param]
        size = owned.param_end - owned.param_start
        for kind in sharded.state_kinds(opt):
            # The values (main params or state kept below fp32 read back as fp32; fp32 main params that live in
            # the param buffer are read there).
            view = opt.buffers.read_part("main" if kind == sharded.MAIN_PARAM else kind, place.buffer,
                                         owned.shard_start, size)
            out[f"{kind}|{place.name}"] = (owned.param_start, view.clone())
    out["step"] = (0, opt.tensors.step.clone())
    return out


def params(model) -> list:
    return [p.detach().clone() for p in model.parameters()]


def save_then_continue(rank: int, world_size: int, root: str, names: tuple) -> dict:
    """Train SAVE_AT steps, save (and async-save, then keep training while it runs), train CONTINUE more:
    the uninterrupted run, and the state at the save."""
    out = {}
    for name in names:
        model = make_model(name)
        opt = get_optimizer(make_config(name, world_size), model)
        start = params(model)
        train(model, opt, rank, world_size, 0, SAVE_AT)
        gs.checkpoint.save(opt, os.path.join(root, name), model=model)
        saved, at_save = owned_state(opt), params(model)
        future = gs.checkpoint.async_save(opt, os.path.join(root, name + "-async"), model=model)
        train(model, opt, rank, world_size, SAVE_AT, CONTINUE)  # steps while the async save runs
        future.result(timeout=40)
        out[name] = {"saved": saved, "at_save": at_save, "start": start, "final": params(model)}
    return out


def resume(rank: int, world_size: int, root: str, names: tuple, bucket_sizes: tuple, suffix: str = "",
           with_model: bool = True, damaged: bool = False) -> dict:
    """Per bucket size: a fresh model (another seed), load, read the state back, train CONTINUE steps.
    Without ``with_model`` only the optimizer is loaded: the model params come from the post-load
    publish (main params copied in and all-gathered). With ``damaged``, the last optimizer then tries
    damaged copies of its checkpoint (``refuse_damaged``), under ``out["damaged"]``."""
    out = {}
    for bucket in bucket_sizes:
        for name in names:
            model = make_model(name, seed=1)
            opt = get_optimizer(make_config(name, world_size, bucket), model)
            gs.checkpoint.load(opt, os.path.join(root, name + suffix), model=model if with_model else None)
            loaded, at_load = owned_state(opt), params(model)
            train(model, opt, rank, world_size, SAVE_AT, CONTINUE)
            out[(bucket, name)] = {"loaded": loaded, "at_load": at_load, "final": params(model),
                                   "buckets": len(opt.layout.buckets)}
    if damaged:
        out["damaged"] = refuse_damaged(rank, opt, model, os.path.join(root, names[-1] + suffix))
    return out


def _garbage(f) -> None:
    size = f.seek(0, os.SEEK_END)
    f.seek(0)
    f.write(b"\x5a" * size)  # same size: only decoding the bytes can tell


def _truncated(f) -> None:
    f.truncate(f.seek(0, os.SEEK_END) // 2)


def _flipped(f) -> None:
    f.seek(f.seek(0, os.SEEK_END) // 2)
    byte = f.read(1)[0]
    f.seek(-1, os.SEEK_CUR)
    f.write(bytes([byte ^ 0x01]))  # one bit: the size is right, and a tensor's bytes decode whatever they hold


DAMAGES = {"garbage": _garbage, "truncated": _truncated, "flipped": _flipped}


def refuse_damaged(rank: int, opt, model, checkpoint: str) -> dict:
    """Load copies of ``checkpoint`` (saved on 2 ranks) whose rank-1 data file is damaged (garbage bytes
    of the same size; cut in half; one bit flipped), on every rank: {damage: (error type, message, the
    damaged file)}, and under "unchanged" whether the owned state and the params stayed as they were."""
    before, out = (owned_state(opt), params(model)), {}
    data_file = "__1_0.distcp"  # what rank 1 of the saving 2 wrote
    for damage, spoil in DAMAGES.items():
        path = f"{checkpoint}-{damage}"
        if rank == 0:
            shutil.copytree(checkpoint, path)
            with open(os.path.join(path, data_file), "r+b") as f:
                spoil(f)
        dist.barrier()
        try:
            gs.checkpoint.load(opt, path, model=model)
            out[damage] = None
        except Exception as exc:  # what a resume path catches
            out[damage] = (type(exc).__name__, str(exc), os.path.join(path, data_file))
    out["unchanged"] = _same(before, (owned_state(opt), params(model)))
    return out


def refuse_on_one_rank(rank: int, world_size: int) -> dict:
    """A sharded state dict whose last rank's slice holds a NaN: every rank refuses, nothing changes."""
    model = tiny_transformer()
    opt = get_optimizer(make_config("adam", world_size), model)
    train(model, opt, rank, world_size, 0, 2)
    sd = gs.checkpoint.sharded_state_dict(opt, snapshot=True)  # copies: the live buffers move on
    train(model, opt, rank, world_size, 2, 1)  # now the checkpoint differs from the live state
    before = (owned_state(opt), params(model))
    if rank == world_size - 1:
        key = next(k for k, v in sd.items() if k.startswith("optimizer.state.exp_avg.") and v.local_shards())
        sd[key].local_shards()[0].tensor[0] = float("nan")
    return _refused_load(opt, model, before, lambda: opt.load_sharded_state_dict(sd))


def refuse_flat_on_one_rank(rank: int, world_size: int) -> dict:
    """The flat (per-rank) state dict, NaN on the last rank only: every rank refuses, nothing changes, and
    no rank is left waiting in the post-load all-gather."""
    model = tiny_transformer()
    opt = get_optimizer(make_config("adam", world_size), model)
    train(model, opt, rank, world_size, 0, 2)
    sd = opt.state_dict()
    train(model, opt, rank, world_size, 2, 1)
    before = (owned_state(opt), params(model))
    if rank == world_size - 1:
        sd["state"]["exp_avg"][0][0] = float("nan")
    return _refused_load(opt, model, before, lambda: opt.load_state_dict(sd))


def _refused_load(opt, model, before, load) -> dict:
    """Run ``load``; its error message (None if it loaded) and whether the owned state and params are
    still ``before``."""
    try:
        load()
        message = None
    except ValueError as exc:
        message = str(exc)
    return {"message": message, "unchanged": _same(before, (owned_state(opt), params(model)))}


def _same(before, after) -> bool:
    """``(owned_state, params)`` pairs bitwise equal."""
    return all(torch.equal(a[1], b[1]) for a, b in zip(before[0].values(), after[0].values())) and \
        all(torch.equal(a, b) for a, b in zip(before[1], after[1]))
