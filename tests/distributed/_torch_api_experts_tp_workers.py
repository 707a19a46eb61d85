"""Rank bodies for tests/distributed/test_torch_api_experts_tp.py: torch's get_state_dict / set_state_dict with
dcp.save / dcp.load on graphstep optimizers with MoE expert params and with tensor-parallel slices.

Every param gets an exact grad (multiples of 2^-10, tests/distributed/_layerwise_workers.py's recipe) drawn from its
*global* name and its *whole* shape, so each rank takes its slice of the same whole grad and any split of the
model reduces and updates each element bitwise alike (reference kernel, no clipping). A run saved at one size and
resumed at another must then equal the uninterrupted run bitwise, element by element of the whole params.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict, get_state_dict,
                                                     set_optimizer_state_dict, set_state_dict)

import graphstep as gs
from graphstep.checkpoint.torch_api import placed_model_state_dict

SAVE_AT, CONTINUE = 3, 3
QUANTUM = 2.0 ** -10
BUCKET = 40  # several buckets: data-parallel ranks own slivers of some params (pieces of several boxes)
CONFIGS = {
    "adam": dict(optimizer="adam", lr=3e-3, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95),
    "sgd": dict(optimizer="sgd", lr=0.05, weight_decay=1e-3, sgd_momentum=0.9),
}


def _config(name: str, distributed: bool, **changes) -> gs.OptimizerConfig:
    fields = dict(CONFIGS[name], clip_grad=0.0, kernel="reference", capture="eager", bucket_size=BUCKET,
                  use_distributed_optimizer=distributed, distributed_timeout_s=20.0)
    fields.update(changes)
    return gs.OptimizerConfig(**fields)


def whole_value(name: str, shape, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 1_000_003 * seed)
    return torch.randn(tuple(shape), generator=gen) * 0.3


def whole_grad(name: str, shape, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 7919 * step)
    return (torch.randn(tuple(shape), generator=gen) * 256).round().clamp(-8191, 8191) * QUANTUM


def _feed(model, step: int, cut, scale) -> None:
    """p.grad = scale(name) * the slice ``cut(name, p, whole)`` of the param's whole exact grad."""
    loss = 0.0
    for name, p in model.named_parameters():
        loss = loss + (p * (scale(name) * cut(name, p, whole_grad(name, model.whole_shapes[name], step)))).sum()
    loss.backward()


def _train(model, opt, first: int, steps: int, cut, scale=lambda name: 1.0) -> None:
    for step in range(first, first + steps):
        opt.zero_grad()
        _feed(model, step, cut, scale)
        opt.step()
    opt.finish_param_gather()


def _whole(name, p, whole):
    return whole


def _params(model) -> dict:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _error(call) -> str:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        return f"{type(exc).__name__}: {exc}"
    return ""


# ---- experts --------------------------------------------------------------------------------------------
IN, WIDTH, OUT, EXPERTS = 5, 7, 3, 4


class MoE(torch.nn.Module):
    """A dense embedding and head around ``held`` experts (Linear layers marked ``allreduce=False``, Megatron-
    Core's mark), kept in a ModuleDict keyed by each expert's global index, so that one name is one expert on
    every rank (``global_names=False``: a ModuleList, names local to the rank). Trained on exact grads only."""

    def __init__(self, held, seed: int = 0, global_names: bool = True):
        super().__init__()
        self.embed, self.head = torch.nn.Linear(IN, WIDTH), torch.nn.Linear(WIDTH, OUT)
        experts = {str(e): torch.nn.Linear(WIDTH, WIDTH) for e in held}
        self.experts = torch.nn.ModuleDict(experts) if global_names else torch.nn.ModuleList(experts.values())
        self.whole_shapes = {}
        for name, p in self.named_parameters():
            self.whole_shapes[name] = tuple(p.shape)
            global_name = name
            if not global_names and name.startswith("experts."):
                _, local, rest = name.split(".", 2)
                global_name = f"experts.{list(held)[int(local)]}.{rest}"
            with torch.no_grad():
                p.copy_(whole_value(global_name, p.shape, seed))
        for p in self.experts.parameters():
            p.allreduce = False


def _expert_case(rank: int, world: int, ep: int, seed: int = 0, global_names: bool = True):
    """(model, optimizer, grad scale) of this rank: ``ep`` expert-parallel ranks, rank r holding experts
    ``[r % ep * EXPERTS / ep, ...)``; the expert data-parallel group the ranks holding the same experts. An
    expert grad is summed over that group and divided by the whole data-parallel size (graphstep/plan/
    experts.py rule 1), so each rank feeds world / expert-dp-size times the exact grad."""
    local = EXPERTS // ep
    held = range(local * (rank % ep), local * (rank % ep + 1))
    model = MoE(held, seed, global_names)
    if world == 1:
        return model, gs.get_optimizer(_config("adam", False), model), (lambda name: 1.0)
    groups = [dist.new_group([r for r in range(world) if r % ep == e]) for e in range(ep)]
    opt = gs.get_optimizer(_config("adam", True), model, expert_data_parallel_group=groups[rank % ep])
    factor = float(world // (world // ep))
    return model, opt, (lambda name: factor if name.startswith("experts.") else 1.0)


def experts_save(rank: int, world: int, root: str, ep: int) -> dict:
    """Train, get_state_dict + dcp.save, train on: the uninterrupted run's final params."""
    model, opt, scale = _expert_case(rank, world, ep)
    _train(model, opt, 0, SAVE_AT, _whole, scale)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{root}/ep{ep}")
    _train(model, opt, SAVE_AT, CONTINUE, _whole, scale)
    return {"final": _params(model), "expert_domain": len(opt.domains) > 1}


def experts_resume(rank: int, world: int, root: str, ep: int) -> dict:
    """A fresh model (other values) on ``world`` ranks holding every expert (``world`` 1: in the dense layout),
    a step of its own, then get_state_dict + dcp.load + set_state_dict and CONTINUE steps."""
    model, opt, scale = _expert_case(rank, world, 1, seed=1)
    _train(model, opt, 0, 1, _whole, scale)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{root}/ep{ep}")
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    _train(model, opt, SAVE_AT, CONTINUE, _whole, scale)
    return {"final": _params(model)}


def experts_with_local_names(rank: int, world: int) -> dict:
    """Two expert-parallel ranks whose experts share names (a ModuleList on each): refused, both ways."""
    model, opt, _ = _expert_case(rank, world, 2, global_names=False)
    return {"get": _error(lambda: get_state_dict(model, opt)),
            "set": _error(lambda: opt.load_state_dict({"state": {}, "param_groups": []}))}


# ---- tensor parallelism ---------------------------------------------------------------------------------
D, H, EH = 6, 10, 4  # H and EH (an expert's hidden size) are split over the tensor-parallel ranks


def split_dim(name: str):
    """Megatron's split of the MLP: ``up`` by rows (weight and bias), ``down`` by columns; None: replicated."""
    if name.endswith(("up.weight", "up.bias")):
        return 0
    return 1 if name.endswith("down.weight") else None


def _mlp(hidden: int) -> torch.nn.Module:
    mlp = torch.nn.Module()
    mlp.up, mlp.down = torch.nn.Linear(D, hidden), torch.nn.Linear(hidden, D)
    return mlp


class SplitMLP(torch.nn.Module):
    """Megatron's split MLP on ``tp`` ranks, this one ``tp_rank``: ``up`` split by rows (partition_dim 0), ``down``
    by columns (partition_dim 1) with a replicated bias, a replicated LayerNorm; ``experts`` more MLPs marked as
    expert params (expert TP = TP: each split the same way), keyed by their index. Its params are the slices of the
    whole model's (``whole_shapes``); trained on exact grads only."""

    def __init__(self, tp: int, tp_rank: int, seed: int = 0, experts: int = 0):
        super().__init__()
        self.mlp = _mlp(H // tp)
        self.norm = torch.nn.LayerNorm(D)
        self.experts = torch.nn.ModuleDict({str(e): _mlp(EH // tp) for e in range(experts)})
        for p in self.experts.parameters():
            p.allreduce = False
        self.tp, self.tp_rank = tp, tp_rank
        self.whole_shapes = {}
        for name, p in self.named_parameters():
            dim = split_dim(name)
            shape = list(p.shape)
            if dim is not None:
                shape[dim] *= tp
                p.tensor_model_parallel, p.partition_dim = True, dim
            self.whole_shapes[name] = tuple(shape)
            with torch.no_grad():
                p.copy_(self.cut(name, p, whole_value(name, shape, seed)))

    def cut(self, name, p, whole):
        dim = split_dim(name)
        return whole if dim is None else whole.narrow(dim, self.tp_rank * p.shape[dim], p.shape[dim])


def _tp_case(rank: int, world: int, tp: int, optimizer: str, seed: int = 0, experts: int = 0, **changes):
    """TP groups of ``tp`` consecutive ranks, data-parallel groups across them (the distributed optimizer with
    several); every data-parallel rank feeds the same grads, so their average is exact. ``experts``: the expert
    params' own layout over the data-parallel group, split over the TP group (Megatron-Core's default); their
    grads are summed over it and divided by the data-parallel size, as the dense ones are averaged."""
    tp_rank, dp = rank % tp, world // tp
    model = SplitMLP(tp, tp_rank, seed, experts)
    if world == 1:
        return model, gs.get_optimizer(_config(optimizer, False, **changes), model)
    tp_groups = [dist.new_group(list(range(s, s + tp))) for s in range(0, world, tp)]
    dp_groups = [dist.new_group(list(range(t, world, tp))) for t in range(tp)]
    groups = {"tensor_parallel_group": tp_groups[rank // tp]}
    if dp > 1 or experts:  # (the expert layout needs the distributed optimizer, over this rank alone at DP = 1)
        groups["process_group"] = dp_groups[tp_rank]
    if experts:
        groups.update(expert_data_parallel_group=dp_groups[tp_rank], expert_tensor_parallel_group=groups[
            "tensor_parallel_group"])
    opt = gs.get_optimizer(_config(optimizer, dp > 1 or experts > 0, **changes), model, **groups)
    return model, opt


def _save(model, opt, path: str) -> None:
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": placed_model_state_dict(opt, model_sd), "optim": optim_sd}, checkpoint_id=path)


def _load(model, opt, path: str) -> None:
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": placed_model_state_dict(opt, model_sd), "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)


def tp_save(rank: int, world: int, root: str, tp: int, optimizer: str, experts: int = 0) -> dict:
    """Train, save, train on (the uninterrupted run), then load the checkpoint back into this same optimizer,
    captured, and train the same steps again: the same params, and no recapture. Full state dicts refused."""
    model, opt = _tp_case(rank, world, tp, optimizer, capture="graph", capture_warmup_steps=1, experts=experts)
    _train(model, opt, 0, SAVE_AT, model.cut)
    path = f"{root}/tp{tp}-{world}-{optimizer}-{experts}"
    _save(model, opt, path)
    _train(model, opt, SAVE_AT, CONTINUE, model.cut)
    final, recaptures = _params(model), opt.recaptures
    _load(model, opt, path)
    _train(model, opt, SAVE_AT, CONTINUE, model.cut)
    full = StateDictOptions(full_state_dict=True)
    refused = {"get": _error(lambda: get_state_dict(model, opt, options=full)),
               "set": _error(lambda: set_optimizer_state_dict(model, opt, get_optimizer_state_dict(model, opt),
                                                              options=full))}
    return {"final": final, "again": _params(model), "captured": opt.captured, "refused_full": refused,
            "recaptured": opt.recaptures - recaptures, "tp_rank": model.tp_rank,
            "expert_domain": len(opt.domains) > 1}


def tp_resume(rank: int, world: int, root: str, saved_world: int, tp: int, optimizer: str, experts: int = 0) -> dict:
    """A fresh model (other values) at ``tp`` (1: the whole model in one process), a step of its own, then the
    checkpoint saved on ``saved_world`` ranks loaded, and CONTINUE steps."""
    model, opt = _tp_case(rank, world, tp, optimizer, seed=1, experts=experts)
    _train(model, opt, 0, 1, model.cut)
    _load(model, opt, f"{root}/tp2-{saved_world}-{optimizer}-{experts}")
    _train(model, opt, SAVE_AT, CONTINUE, model.cut)
    return {"final": _params(model), "tp_rank": model.tp_rank}


def pipeline_refused(rank: int, world: int) -> dict:
    """Two pipeline stages (a model-parallel group of both ranks, no tensor-parallel split): refused."""
    model = SplitMLP(1, 0)
    for p in model.parameters():
        p.tensor_model_parallel = False
    opt = gs.get_optimizer(_config("adam", False), model, model_parallel_group=dist.group.WORLD)
    return {"get": _error(lambda: get_state_dict(model, opt))}
