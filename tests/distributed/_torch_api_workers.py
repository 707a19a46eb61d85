"""Rank bodies for tests/distributed/test_torch_state_dict_resharding.py: torch's get_state_dict / set_state_dict with
dcp.save / dcp.load on graphstep optimizers across ranks.

Every rank feeds the same exact grads (the mean of 4 ranks' multiples of 2^-10, as tests/distributed/
_layerwise_workers.py does), with the reference kernel and no clipping: any data-parallel size then reduces
and updates them bitwise alike, so a run resumed on another size must equal the uninterrupted one bitwise.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict, get_state_dict,
                                                     set_optimizer_state_dict, set_state_dict)
from torch.nn.parallel import DistributedDataParallel as DDP

import graphstep as gs
from _layerwise_workers import _backward_exact, deep_model, mean_exact_grads
from _layerwise_workers import make_config as layerwise_config
from toy import tiny_transformer

SAVE_AT, CONTINUE = 3, 3
BUCKET = 300  # several buckets: ranks own slivers of some params (pieces of several boxes) and none of others
BASE = dict(clip_grad=0.0, kernel="reference", capture="eager", bucket_size=BUCKET, distributed_timeout_s=20.0)
CONFIGS = {
    "sgd": dict(optimizer="sgd", lr=0.05, weight_decay=1e-3, sgd_momentum=0.9),
    "adam": dict(optimizer="adam", lr=3e-3, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95),
    "adam_offload": dict(optimizer="adam", lr=3e-3, weight_decay=0.1, optimizer_cpu_offload=True,
                         optimizer_offload_fraction=0.5, pin_cpu_grads=False),
}


def odd_model(seed: int = 0) -> torch.nn.Module:
    """Params whose rows no shard boundary respects (odd sizes, a 3-D conv weight): a rank's range of one is
    several boxes; and a 0-d one. Trained on exact grads, never run forward."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(13, 37), torch.nn.Conv1d(37, 11, 3), torch.nn.Linear(11, 29),
                                torch.nn.LayerNorm(29))
    model.temperature = torch.nn.Parameter(torch.tensor(0.7 + seed))  # 0-d (CLIP's logit scale): one rank owns it
    return model


def build(name: str, distributed: bool, seed: int = 0):
    if name == "layerwise":
        model = deep_model(seed)
        return model, gs.get_optimizer(layerwise_config(2 if distributed else 1), model)
    model = odd_model(seed)
    config = gs.OptimizerConfig(**BASE, **CONFIGS[name], use_distributed_optimizer=distributed)
    return model, gs.get_optimizer(config, model)


def train(model, opt, start: int, steps: int) -> None:
    for step in range(start, start + steps):
        opt.zero_grad()
        _backward_exact(model, mean_exact_grads(model, step, 4))
        opt.step()
    opt.finish_param_gather()


def params(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def owned_state(opt) -> dict:
    """{(kind, param name): (param_start, this rank's slice)} read from the buffers, and the step."""
    out = {}
    for owned in opt.layout.owned_ranges(opt.rank):
        place = opt.layout.params[owned.param]
        for kind in opt.buffers.state:
            if opt.buffers.keeps_state(kind, place.buffer, owned.shard_start, owned.param_end - owned.param_start):
                out[(kind, place.name)] = (owned.param_start, opt.buffers.read_part(
                    kind, place.buffer, owned.shard_start, owned.param_end - owned.param_start).clone())
    out[("step", "")] = (0, opt.tensors.step.clone())
    return out


def _error(call) -> str:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        return f"{type(exc).__name__}: {exc}"
    return ""


def save(rank: int, world_size: int, root: str, names: tuple) -> dict:
    """Train SAVE_AT steps, get_state_dict + dcp.save, train CONTINUE more: the uninterrupted run."""
    out = {}
    for name in names:
        model, opt = build(name, world_size > 1)
        train(model, opt, 0, SAVE_AT)
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{root}/{name}")
        pieces = max((len(v.local_shards()) for e in optim_sd["state"].values() for v in e.values()
                      if hasattr(v, "local_shards")), default=0)
        options = StateDictOptions(full_state_dict=True)
        full = {"get": _error(lambda: get_state_dict(model, opt, options=options)),
                "set": _error(lambda: set_optimizer_state_dict(model, opt, get_optimizer_state_dict(model, opt),
                                                               options=options))}
        saved = owned_state(opt)
        train(model, opt, SAVE_AT, CONTINUE)
        out[name] = {"saved": saved, "final": params(model), "pieces": pieces, "full_refused": full}
    return out


def resume(rank: int, world_size: int, root: str, names: tuple) -> dict:
    """A fresh model (another seed) trained a step, then get_state_dict + dcp.load + set_state_dict, and
    CONTINUE steps: the loaded state and the final params."""
    out = {}
    for name in names:
        model, opt = build(name, world_size > 1, seed=1)
        train(model, opt, 0, 1)
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{root}/{name}")
        set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
        loaded = owned_state(opt)
        train(model, opt, SAVE_AT, CONTINUE)
        out[name] = {"loaded": loaded, "final": params(model)}
    return out


# ---- DDP ------------------------------------------------------------------------------------------------
DDP_STEPS = 3


def _ddp_config():
    return gs.OptimizerConfig(**BASE, **CONFIGS["adam"])


def ddp_save(rank: int, world_size: int, root: str) -> dict:
    """graphstep over torch's DDP (every rank the same data, so DDP's average is exact): save through the
    wrapper, train on."""
    torch.manual_seed(0)
    net = tiny_transformer(0)
    wrapped = DDP(net)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = gs.get_optimizer(_ddp_config(), wrapped)
    from toy import loss_fn

    def run(first, last):
        for step in range(first, last):
            opt.zero_grad()
            loss_fn(wrapped, step).backward()
            opt.step()

    run(0, DDP_STEPS)
    model_sd, optim_sd = get_state_dict(wrapped, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{root}/ddp")
    keys = sorted(optim_sd["state"])
    run(DDP_STEPS, 2 * DDP_STEPS)
    return {"final": params(net), "keys": keys, "names": sorted(n for n, _ in net.named_parameters())}


def ddp_resume_alone(rank: int, world_size: int, root: str) -> dict:
    """One process, a plain model (no DDP): load the DDP run's checkpoint and train on."""
    from toy import loss_fn

    net = tiny_transformer(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = gs.get_optimizer(_ddp_config(), net)
    model_sd, optim_sd = get_state_dict(net, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{root}/ddp")
    set_state_dict(net, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    for step in range(DDP_STEPS, 2 * DDP_STEPS):
        opt.zero_grad()
        loss_fn(net, step).backward()
        opt.step()
    return {"final": params(net)}
