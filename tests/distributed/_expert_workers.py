"""What the spawned ranks of the expert data-parallel tests run, and the single-process oracle they meet.

The MoE-ish toy: a dense embedding, a dense router over ``LOCAL`` experts, the experts (Linear layers
marked ``allreduce=False``, Megatron-Core's convention) and a dense head. With ``ep`` expert-parallel
ranks there are ``LOCAL * ep`` experts; rank r holds experts ``[LOCAL * (r % ep), LOCAL * (r % ep + 1))``
and routes its own tokens through them (the test has no token all-to-all: each token stays on its rank,
which is one valid routing). The expert data-parallel group of rank r: the ranks holding the same experts
(``{s : s % ep == r % ep}``).

The oracle is one process holding every expert: its loss is the mean over the ranks of each rank's local
loss, each rank's batch going through that rank's experts. That is the global loss the distributed run
optimizes (dense grads averaged over the data-parallel group; expert grads summed over the expert
data-parallel group and divided by the full data-parallel size, graphstep/plan/experts.py rule 1).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

import graphstep as gs
from graphstep.config import OptimizerConfig
from graphstep import get_optimizer

IN, WIDTH, LOCAL, BATCH = 12, 16, 2, 4
STEPS = 16
OVERLAP_STEPS = 8
INF_STEP = 6
INF_RANK = 1
CLIP = 0.05  # below the toy's grad norms (asserted by the tests), so clipping is active every step
BUCKET = 300  # several buckets per domain, so some ranks own nothing of some params

CONFIGS = {
    "sgd_fp32": dict(optimizer="sgd", lr=0.05, weight_decay=1e-3, sgd_momentum=0.9),
    "adam_fp32": dict(optimizer="adam", lr=3e-3, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95),
    # fp16 grads: the reduce pre-scales by 1/dp before the SUM (for experts too: 1/dp, not 1/expert-dp).
    "sgd_fp16_grads": dict(optimizer="sgd", lr=0.05, weight_decay=1e-3, sgd_momentum=0.9, fp16=True,
                           main_grads_dtype=torch.float16, loss_scale=128.0),
}


class TinyMoE(torch.nn.Module):
    def __init__(self, num_experts: int, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Linear(IN, WIDTH)
        self.router = torch.nn.Linear(WIDTH, LOCAL)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(num_experts))
        self.head = torch.nn.Linear(WIDTH, 1)
        for expert in self.experts:
            for p in expert.parameters():
                p.allreduce = False

    def forward(self, x: torch.Tensor, first_expert: int = 0) -> torch.Tensor:
        h = torch.tanh(self.embed(x.to(self.embed.weight.dtype)))
        gate = torch.softmax(self.router(h).float(), dim=-1).to(h.dtype)
        mixed = sum(gate[:, j:j + 1] * torch.relu(self.experts[first_expert + j](h)) for j in range(LOCAL))
        return self.head(h + mixed).float()


def local_model(ep: int, ep_rank: int) -> TinyMoE:
    """Rank ``ep_rank``'s model: the full model's dense params and its ``LOCAL`` experts (same values)."""
    model = TinyMoE(LOCAL * ep)
    model.experts = torch.nn.ModuleList(model.experts[LOCAL * ep_rank:LOCAL * (ep_rank + 1)])
    return model


def rank_loss(model: TinyMoE, step: int, rank: int, first_expert: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * step + rank)
    x, y = torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, 1, generator=g)
    return torch.nn.functional.mse_loss(model(x, first_expert), y)


def make_config(name: str, distributed: bool, **changes) -> OptimizerConfig:
    fields = dict(CONFIGS[name], clip_grad=CLIP, bucket_size=BUCKET, capture="eager",
                  use_distributed_optimizer=distributed, distributed_timeout_s=20.0)
    fields.update(changes)
    return OptimizerConfig(**fields)


def _named(model) -> dict:
    return {name: p.detach().clone().float() for name, p in model.named_parameters()}


def oracle(name: str, world_size: int, ep: int, steps: int = STEPS, inf_step=INF_STEP, **changes) -> dict:
    """One process, every expert: the loss is the mean over the ranks of each rank's local loss."""
    model = TinyMoE(LOCAL * ep)
    start = _named(model)
    opt = get_optimizer(make_config(name, False, **changes), model)  # expert params join the dense layout
    ok, norms = [], []
    for step in range(steps):
        opt.zero_grad()
        loss = sum(rank_loss(model, step, r, LOCAL * (r % ep)) for r in range(world_size)) / world_size
        opt.scale_loss(loss).backward()
        if step == inf_step:
            _poison(model.experts[LOCAL * (INF_RANK % ep)].weight)
        result = opt.step()
        ok.append(bool(result.update_successful.item()))
        norms.append(float(result.grad_norm.item()))
    return {"params": _named(model), "start": start, "ok": ok, "norms": norms}


def _poison(weight: torch.nn.Parameter) -> None:
    """An inf in one element of an expert's grad (after backward, before the step)."""
    grad = weight.grad if weight.grad is not None else weight.main_grad
    grad.view(-1)[3] = math.inf


def expert_groups(world_size: int, ep: int):
    """This rank's expert data-parallel group; every group is created on every rank (dist.new_group)."""
    groups = [dist.new_group([r for r in range(world_size) if r % ep == e]) for e in range(ep)]
    return groups[dist.get_rank() % ep]


def train(name: str, rank: int, world_size: int, ep: int, steps: int = STEPS, inf_step=INF_STEP, **changes) -> dict:
    """Rank ``rank``'s run; params renamed to the oracle's expert indices. ``inf_step=None``: no injection
    (with overlap_grad_reduce a grad poisoned after backward would miss the reduce its hook launched)."""
    ep_rank = rank % ep
    model = local_model(ep, ep_rank)
    opt = get_optimizer(make_config(name, True, **changes), model,
                        expert_data_parallel_group=expert_groups(world_size, ep))
    ok, norms = [], []
    for step in range(steps):
        opt.zero_grad()
        opt.scale_loss(rank_loss(model, step, rank)).backward()
        if step == inf_step and rank == INF_RANK:
            _poison(model.experts[0].weight)
        result = opt.step()
        ok.append(bool(result.update_successful.item()))
        norms.append(float(result.grad_norm.item()))
    opt.finish_param_gather()
    params = {}
    for key, value in _named(model).items():
        if key.startswith("experts."):
            _, j, rest = key.split(".", 2)
            key = f"experts.{LOCAL * ep_rank + int(j)}.{rest}"
        params[key] = value
    stats = opt.memory_stats()["device"]
    domains = (opt.buffers, opt.experts.buffers)
    allocated = {kind: sum(t.numel() * t.element_size() for b in domains for t in getattr(b, attr))
                 for kind, attr in (("params", "param_flat"), ("grads", "grad_flat"))}
    expert_params = sum(t.numel() * t.element_size() for t in opt.experts.buffers.param_flat)
    return {"params": params, "ok": ok, "norms": norms, "captured": opt.captured, "overlap": opt.overlap_counts,
            "folds": opt.fold_counts,
            "memory": ({k: stats[k] for k in allocated}, allocated, expert_params),
            "buckets": len(opt.layout.buckets) + len(opt.experts.layout.buckets),
            "expert_dp_size": opt.experts.layout.dp_size, "stages": [s.name for s in opt.stages]}


def parity(rank: int, world_size: int, cases: tuple) -> dict:
    """Every (name, ep, changes) case; then eager against captured (replay backend), a state_dict resume,
    and the collectives (dense and expert) overlapped with backward and forward. One spawn for all: under
    load, starting 4 ranks costs far more than these runs."""
    out = {(name, ep): train(name, rank, world_size, ep, **dict(changes)) for name, ep, changes in cases}
    out["overlap"] = train("sgd_fp32", rank, world_size, 2, steps=OVERLAP_STEPS, inf_step=None,
                           overlap_grad_reduce=True, overlap_param_gather=True)
    # fold_grad_norm: the expert domain folds after its reduce-scatter (ep 2) or local average (ep 4).
    for ep in (2, 4):
        out[("fold", ep)] = train("sgd_fp32", rank, world_size, ep, fold_grad_norm=True)
    out["fold_overlap"] = train("sgd_fp32", rank, world_size, 2, steps=OVERLAP_STEPS, inf_step=None,
                                overlap_grad_reduce=True, overlap_param_gather=True, fold_grad_norm=True)
    for mode in ("eager", "graph"):
        out[("capture", mode)] = train("adam_fp32", rank, world_size, 2, steps=INF_STEP + 2, capture=mode,
                                       capture_warmup_steps=2)
    out["resume"] = resume(rank, world_size, 2)
    return out


def resume(rank: int, world_size: int, ep: int, steps: int = 6, save_at: int = 3) -> dict:
    """Adam: ``opt.state_dict()`` saved (through torch.save) after ``save_at`` steps, loaded into a fresh
    model and optimizer, trained on; against the uninterrupted run, bitwise."""
    import io

    config = make_config("adam_fp32", True)
    group = expert_groups(world_size, ep)

    def run(model, opt, first: int, last: int) -> None:
        for step in range(first, last):
            opt.zero_grad()
            opt.scale_loss(rank_loss(model, step, rank)).backward()
            opt.step()

    model = local_model(ep, rank % ep)
    opt = get_optimizer(config, model, expert_data_parallel_group=group)
    run(model, opt, 0, save_at)
    saved, model_saved = io.BytesIO(), {k: v.clone() for k, v in model.state_dict().items()}
    torch.save(opt.state_dict(), saved)
    run(model, opt, save_at, steps)

    fresh = local_model(ep, rank % ep)
    fresh.load_state_dict(model_saved)
    reopened = get_optimizer(config, fresh, expert_data_parallel_group=group)
    saved.seek(0)
    state = torch.load(saved, weights_only=True)
    without_experts = {k: v for k, v in state.items() if k != "experts"}
    refused = _error(lambda: reopened.load_state_dict(without_experts))  # every rank refuses alike
    reopened.load_state_dict(state)
    run(fresh, reopened, save_at, steps)
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
    moved = not all(torch.equal(a, b) for a, b in zip(model.parameters(), local_model(ep, rank % ep).parameters()))
    return {"bitwise": same, "moved": moved, "has_experts": "experts" in state, "refused": refused}


def _error(build) -> str:
    try:
        build()
    except (ValueError, NotImplementedError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def refusals(rank: int, world_size: int) -> dict:
    """Bad inputs, on 2 ranks (every rank takes the same path, so no rank waits on a peer)."""
    other = 1 - rank
    singles = [dist.new_group([0]), dist.new_group([1])]
    mine, not_mine = singles[rank], singles[other]
    out = {
        "no_distributed_optimizer": _error(lambda: get_optimizer(
            make_config("sgd_fp32", False), local_model(2, rank), expert_data_parallel_group=mine)),
        "not_a_member": _error(lambda: get_optimizer(
            make_config("sgd_fp32", True), local_model(2, rank), expert_data_parallel_group=not_mine)),
        "experts_without_group": _error(lambda: get_optimizer(make_config("sgd_fp32", True), local_model(2, rank))),
        "group_without_experts": _error(lambda: get_optimizer(
            make_config("sgd_fp32", True), torch.nn.Linear(4, 4), expert_data_parallel_group=mine)),
        "outside_the_dp_group": _error(lambda: get_optimizer(
            make_config("sgd_fp32", True), local_model(2, rank), process_group=mine,
            expert_data_parallel_group=dist.group.WORLD)),
    }
    opt = get_optimizer(make_config("sgd_fp32", True), local_model(2, rank), expert_data_parallel_group=mine)
    out["sharded_state_dict"] = _error(lambda: gs.checkpoint.sharded_state_dict(opt))
    # The debugger finds a non-finite expert grad in the expert domain's buffers (rank 1 only holds it).
    model = local_model(2, rank)
    opt = get_optimizer(make_config("sgd_fp32", True), model, expert_data_parallel_group=mine)
    rank_loss(model, 0, rank).backward()
    if rank == 1:
        _poison(model.experts[1].weight)
    report = opt.debug_step()
    out["debug"] = {"origin": str(report.nan_origin), "ok": report.update_successful,
                    "stages": [stage.name for stage in report.stages]}
    return out
