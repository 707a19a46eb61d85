"""Rank bodies for tests/distributed/test_ddp.py: graphstep beside torch's DistributedDataParallel."""

from __future__ import annotations

import warnings

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import graphstep as gs

STEPS, BATCH = 6, 16


def model():
    # Params of at least one 4,096-element row: units the folded norm's backward hooks would fold.
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))


def data(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 64, generator=g), torch.randn(BATCH, 64, generator=g)


def config(**changes):
    return gs.OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.5, capture="graph", kernel="fused", **changes)


def train(net, opt, rows):
    for step in range(STEPS):
        inputs, targets = data(step)
        torch.nn.functional.mse_loss(net(inputs[rows]), targets[rows]).backward()
        opt.step()
        opt.zero_grad()


def single_process() -> list:
    """The oracle: one process, the global batch."""
    net = model()
    with warnings.catch_warnings():  # it runs inside a rank: the ranks-train-apart warning is expected here
        warnings.simplefilter("ignore")
        opt = gs.get_optimizer(config(), net, config_overrides={})
        train(net, opt, slice(None))
    return [p.detach().clone() for p in net.parameters()]


def scenarios(rank: int, world_size: int) -> dict:
    from graphstep.step import folded_sums

    folded_sums.UNIT_ROWS, folded_sums.HOOK_MIN_ELEMENTS = 1, 1  # units of one row, as small_fold_units (tests/conftest.py)
    rows = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)
    out = {"reference": single_process(), "start": [p.detach().clone() for p in model().parameters()]}

    # DDP around the model, then the optimizer over it; and the optimizer first, DDP wrapped after it; and DDP
    # with gradient_as_bucket_view=True, which points every .grad at its own buckets after each all-reduce.
    for order in ("ddp_first", "optimizer_first", "bucket_view"):
        net = model()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            if order in ("ddp_first", "bucket_view"):
                wrapped = DDP(net, gradient_as_bucket_view=order == "bucket_view")
                opt = gs.get_optimizer(config(), wrapped, config_overrides={})
            else:
                opt = gs.get_optimizer(config(), net, config_overrides={})
                wrapped = DDP(net)
            train(wrapped, opt, rows)
        out[order] = {"params": [p.detach().clone() for p in net.parameters()], "folds": opt.fold_counts,
                      "units": len(opt.build_record.fold.hooked.current), "captured": opt.captured,
                      "warnings": [str(w.message) for w in seen if "graphstep" in str(w.message)]}

    # Neither DDP nor the distributed optimizer: warned at the first forward.
    net = model()
    opt = gs.get_optimizer(config(), net, config_overrides={})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        train(net, opt, rows)
    out["alone_warnings"] = [str(w.message) for w in seen if "graphstep" in str(w.message)]

    # DDP with the distributed optimizer: refused at build, or at the first forward when DDP comes later.
    try:
        gs.get_optimizer(config(use_distributed_optimizer=True), DDP(model()), config_overrides={})
        out["refused_at_build"] = None
    except ValueError as err:
        out["refused_at_build"] = str(err)
    net = model()
    opt = gs.get_optimizer(config(use_distributed_optimizer=True), net, config_overrides={})
    try:
        DDP(net)(data(0)[0][rows])
        out["refused_at_forward"] = None
    except RuntimeError as err:
        out["refused_at_forward"] = str(err)
    return out
