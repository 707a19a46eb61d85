"""perf/gpu_check.py's FSDP2 part: a ``fully_shard`` model's step captured, then its whole iteration, on a
one-rank mesh.

One GPU gives a one-rank NCCL group (several ranks: tests/distributed/test_fsdp2.py): FSDP2's reduce-scatter
stream, its post-reduce event and the param all-gather still run, and graphstep's captured step must read the
grads FSDP2 wrote and give the same params as the eager step, bitwise, over the steps. The iteration row
captures forward and backward too, with FSDP2 allocating and freeing its unsharded params' memory inside the
graph: the same params as the eager iteration, bitwise. On the CPU (the dry run) the same over a one-rank gloo
group and the replay backend.
"""

from __future__ import annotations

import os

import torch

import graphstep as gs
from capture.devices import is_cuda, synchronize
from gpu_check_numerics import record

NAME = "fsdp2-one-rank-captured-vs-eager"
ITERATION_NAME = "fsdp2-one-rank-iteration-captured-vs-eager"
STEPS, SMALL_STEPS = 12, 6
WIDTH = 64  # a multiple of 16: bitwise claims hold on every CPU vector width (docs/design.md §8)


def _model(device) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU(), torch.nn.Linear(WIDTH, WIDTH)).to(device)
    for layer in (m[0], m[2]):
        fully_shard(layer)
    fully_shard(m)
    return m


def _loss(model, x):
    return model(x).square().mean()


def _run(device, capture: str, steps: int, whole_iteration: bool) -> tuple[list, dict]:
    """``steps`` steps of the user's loop (backward, ``opt.step()``), or of ``graphstep.Iteration``: the final
    params, and whether (and how) the run was captured."""
    from graphstep.iteration import Iteration

    model = _model(device)
    opt = gs.get_optimizer(gs.OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=1.0, capture=capture,
                                              capture_warmup_steps=2, kernel="fused"), model)
    captured = Iteration(model, opt, _loss, capture=capture) if whole_iteration else opt
    generator = torch.Generator(device=device).manual_seed(0)
    for _ in range(steps):
        x = torch.randn(8, WIDTH, device=device, generator=generator)
        if whole_iteration:
            captured(batch=x)
        else:
            _loss(model, x).backward()
            opt.step()
            opt.zero_grad()
    synchronize(device)
    params = [p._local_tensor.detach().clone() for p in model.parameters()]
    how = {"captured": captured.captured, "recaptures": captured.recaptures, "backend": captured.capture_backend}
    if whole_iteration:
        captured.close()
    return params, how


def _verdict(name: str, device, steps: int, whole_iteration: bool) -> dict:
    import torch.distributed as dist

    eager, _ = _run(device, "eager", steps, whole_iteration)
    captured, how = _run(device, "graph", steps, whole_iteration)
    differ = [i for i, (a, b) in enumerate(zip(eager, captured)) if not torch.equal(a, b)]
    problems = ([] if how["captured"] else [f"not captured (backend {how['backend']})"]) + \
        ([f"recaptures {how['recaptures']}, expected 0"] if how["recaptures"] else []) + \
        ([f"params {differ} differ from eager"] if differ else [])
    what = "iterations" if whole_iteration else "steps"
    detail = "; ".join(problems) or (f"{steps} {what} on a one-rank {dist.get_backend()} mesh: params bitwise "
                                     f"equal to eager, captured, no recapture")
    return record(name, "fail" if problems else "pass", detail, recaptures=how["recaptures"],
                  backend=how["backend"])


def part_fsdp2(device, small: bool) -> list[dict]:
    import torch.distributed as dist

    from graphstep.app.demo_dist import free_port

    made = not dist.is_initialized()
    if made:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        if is_cuda(device):
            index = device.index if device.index is not None else torch.cuda.current_device()
            dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", index))
        else:
            dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        steps = SMALL_STEPS if small else STEPS
        rows = [_verdict(NAME, device, steps, whole_iteration=False)]
        try:
            rows.append(_verdict(ITERATION_NAME, device, steps, whole_iteration=True))
        except Exception as error:  # the step's row stands; the runner starts a fresh worker after an "error"
            rows.append(record(ITERATION_NAME, "error", f"{type(error).__name__}: {error}"))
        return rows
    finally:
        if made:
            dist.destroy_process_group()
