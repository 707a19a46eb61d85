"""What the spawned ranks of test_fsdp2_hooks_and_loads_sharded.py run: a user's post-accumulate-grad hook on every
param of an FSDP2 model, registered after graphstep's optimizer was built, through backward and steps; and a
load in torch's format whose state is damaged on one rank only, refused on every rank with nothing changed."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import graphstep as gs
from _fsdp2_workers import config, full_params, local_batch, net, sharded, train


def late_user_hooks(rank: int, world: int) -> dict:
    """Hooks registered after the build on every DTensor param: they run once per param per backward, and the
    steps equal those of a model without them."""
    with_hooks, without = sharded(net()), sharded(net())
    opts = [gs.get_optimizer(config(), m, config_overrides={}) for m in (with_hooks, without)]
    calls = []
    for name, p in with_hooks.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: calls.append(name))
    counts = []
    for step in range(3):
        for m, opt in zip((with_hooks, without), opts):
            x, y = local_batch(step, rank, world)
            F.mse_loss(m(x), y[:, :m.out]).backward()
            opt.step()
            opt.zero_grad()
        counts.append(sorted(calls))
        calls.clear()
    names = sorted(name for name, _ in with_hooks.named_parameters())
    return {"calls_per_step_right": all(c == names for c in counts),
            "steps_equal": all(torch.equal(a, b) for a, b in zip(full_params(with_hooks), full_params(without)))}


def damaged_on_one_rank(rank: int, world: int) -> dict:
    """Rank 1's part of a state dict holds a NaN second moment: every rank refuses, nothing changes anywhere."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    source, target = sharded(net(seed=3)), sharded(net())
    source_opt = gs.get_optimizer(config(), source, config_overrides={})
    target_opt = gs.get_optimizer(config(), target, config_overrides={})
    train(source, source_opt, range(10, 13), rank, world)
    train(target, target_opt, range(2), rank, world)
    saved = get_optimizer_state_dict(source, source_opt)
    saved = {"state": {k: {n: v.detach().clone() for n, v in e.items()} for k, e in saved["state"].items()},
             "param_groups": saved["param_groups"]}
    if rank == 1:
        for entry in saved["state"].values():
            local = entry["exp_avg_sq"]._local_tensor
            if local.numel():
                local.view(-1)[0] = float("nan")
                break
    before = [t.clone() for ts in target_opt.buffers.state.values() for t in ts] + [target_opt.tensors.step.clone()]
    try:
        set_optimizer_state_dict(target, target_opt, saved)
        error = None
    except ValueError as exc:
        error = str(exc)
    after = [t.clone() for ts in target_opt.buffers.state.values() for t in ts] + [target_opt.tensors.step.clone()]
    return {"error": error, "unchanged": all(torch.equal(a, b) for a, b in zip(before, after))}


def cases(rank: int, world: int) -> dict:
    return {"hooks": late_user_hooks(rank, world), "damaged": damaged_on_one_rank(rank, world)}
