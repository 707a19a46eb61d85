"""What the spawned ranks of test_layerwise_muon.py run (module-level, so "spawn" can import them).

The model: the toy's embedding and head (routed to Adam) around three encoder layers, so there are twelve
Muon matrices of four shapes, and at 2 and 4 ranks some rank owns several matrices of one shape (its
update runs them as one batch).

Two kinds of grads:
- ``exact``: every rank feeds its own grads, multiples of 2⁻¹⁰ of magnitude < 8, through a backward of
  Σ p·g (which yields g exactly). Any sum of four of them is exact in fp32 and 1/dp is a power of two, so
  the reduce-scatter's mean equals the mean a single process is given, bitwise, whatever order the
  backend sums in. Same grads, same matrix math on the owner: the runs must agree bitwise.
- ``data``: real data-parallel training on slices of the global batch (clipping on): only the reduction
  order differs from a single process, so the comparison is the drift of docs/design.md §8.
"""

from __future__ import annotations

import os

import torch

import graphstep as gs
from _harness import local_loss
from toy import VOCAB, WIDTH

STEPS = 4
INF_STEP = 1  # the last rank makes grads non-finite (one element of a Muon matrix's): every rank must skip
MUON_VICTIM = 3  # index in model.parameters() of 1.self_attn.out_proj.weight
GRAD_QUANTUM = 2.0 ** -10
CONTINUE = 2  # steps after a checkpoint save or load


def deep_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = [torch.nn.TransformerEncoderLayer(WIDTH, 4, 2 * WIDTH, dropout=0.0, batch_first=True)
              for _ in range(3)]
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, WIDTH), *layers, torch.nn.LayerNorm(WIDTH),
                                torch.nn.Linear(WIDTH, VOCAB))
    model[0].weight.is_embedding_or_output_parameter = True
    model[-1].weight.is_embedding_or_output_parameter = True
    return model


def make_config(world_size: int, **changes) -> gs.OptimizerConfig:
    fields = dict(optimizer="muon", lr=0.02, weight_decay=0.05, muon_momentum=0.9, muon_fp32_matmul_prec="highest",
                  clip_grad=0.0, kernel="reference", capture="eager", capture_warmup_steps=2, bucket_size=1500,
                  use_distributed_optimizer=world_size > 1, distributed_timeout_s=20.0)
    fields.update(changes)
    return gs.OptimizerConfig(**fields)


def exact_grads(model, step: int, rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7919 * step + 104729 * rank)
    return [(torch.randn(p.shape, generator=gen) * 256).round().clamp(-8191, 8191) * GRAD_QUANTUM
            for p in model.parameters()]


def mean_exact_grads(model, step: int, world_size: int) -> list[torch.Tensor]:
    per_rank = [exact_grads(model, step, r) for r in range(world_size)]
    return [sum(gs_) / world_size for gs_ in zip(*per_rank)]  # exact: see the module docstring


def _backward_exact(model, grads) -> None:
    sum((p * g).sum() for p, g in zip(model.parameters(), grads)).backward()


def muon_names(opt) -> set[str]:
    return {name for group in opt.param_groups if group["optimizer"] == "muon" for name in group["param_names"]}


def run(rank: int, world_size: int, *, grads: str, reference_world: int = 0, capture: str = "eager",
        steps: int = STEPS, **changes) -> dict:
    """Train ``steps``; ``reference_world`` > 0: a single process fed the mean of that many ranks' grads."""
    model = deep_model()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = gs.get_optimizer(make_config(world_size, capture=capture, **changes), model)
    ok = []
    for step in range(steps):
        opt.zero_grad()
        # In the backward itself (not written into the grads after it): with overlap_grad_reduce the
        # reduce-scatter may already have left when backward returns.
        poison = step == INF_STEP and rank == world_size - 1
        if grads == "exact":
            given = (mean_exact_grads(model, step, reference_world) if reference_world
                     else exact_grads(model, step, rank))
            if poison:
                given[MUON_VICTIM].view(-1)[5] = float("inf")
            _backward_exact(model, given)
        else:
            # the single process sees every rank's slice: the global batch
            loss = local_loss(model, step, 0, 1, 12) if reference_world else local_loss(model, step, rank,
                                                                                         world_size, 12)
            (loss * float("inf") if poison else loss).backward()
        ok.append(bool(opt.step().update_successful.item()))
    opt.finish_param_gather()
    owned = sorted(opt.layout.params[o.param].name for o in opt.layout.owned_ranges(opt.rank)
                   if opt.layout.params[o.param].name in muon_names(opt))
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "start": start, "ok": ok,
            "muon": sorted(muon_names(opt)), "owned_muon": owned, "captured": opt.captured,
            "buckets": [(b.whole_matrices, b.numel) for b in opt.layout.buckets], "overlap": opt.overlap_counts}


CASES = {
    "exact_eager": dict(grads="exact"),
    "exact_graph": dict(grads="exact", capture="graph", capture_warmup_steps=1),
    "exact_medium": dict(grads="exact", muon_fp32_matmul_prec="medium"),
    "data": dict(grads="data", clip_grad=0.5),
    "data_overlap": dict(grads="data", clip_grad=0.5, overlap_grad_reduce=True, overlap_param_gather=True),
    "data_bf16": dict(grads="data", clip_grad=0.5, bf16=True),  # bf16 params, fp32 main params and grads
}


def parity(rank: int, world_size: int, cases: tuple) -> dict:
    """The ``cases`` of test_layerwise_muon.py this spawn runs (one spawn per world size)."""
    return {case: run(rank, world_size, **CASES[case]) for case in cases}


def save_checkpoint(rank: int, world_size: int, root: str) -> dict:
    """Train STEPS on exact grads, save, train CONTINUE more: the uninterrupted run and the state at the save."""
    model = deep_model()
    opt = gs.get_optimizer(make_config(world_size), model)
    for step in range(STEPS):
        opt.zero_grad()
        _backward_exact(model, mean_exact_grads(model, step, 4))
        opt.step()
    gs.checkpoint.save(opt, os.path.join(root, "muon"), model=model)
    at_save = {n: p.detach().clone() for n, p in model.named_parameters()}
    for step in range(STEPS, STEPS + CONTINUE):
        opt.zero_grad()
        _backward_exact(model, mean_exact_grads(model, step, 4))
        opt.step()
    return {"at_save": at_save, "final": {n: p.detach().clone() for n, p in model.named_parameters()},
            "owners": owners_of(opt)}


def owners_of(opt) -> dict[str, int]:
    """Muon param name -> the rank whose shard holds it (read off the layout: the same on every rank)."""
    layout, out = opt.layout, {}
    for bucket in layout.buckets:
        if bucket.whole_matrices:
            for i in bucket.params:
                out[layout.params[i].name] = (layout.params[i].start - bucket.start) // bucket.shard_numel
    return out


def resume_checkpoint(rank: int, world_size: int, root: str) -> dict:
    """A fresh model (another seed) at this data-parallel size: load, then the same CONTINUE steps."""
    model = deep_model(seed=1)
    opt = gs.get_optimizer(make_config(world_size), model)
    gs.checkpoint.load(opt, os.path.join(root, "muon"), model=model)
    at_load = {n: p.detach().clone() for n, p in model.named_parameters()}
    for step in range(STEPS, STEPS + CONTINUE):
        opt.zero_grad()
        _backward_exact(model, mean_exact_grads(model, step, 4))
        opt.step()
    return {"at_load": at_load, "final": {n: p.detach().clone() for n, p in model.named_parameters()},
            "owners": owners_of(opt)}
