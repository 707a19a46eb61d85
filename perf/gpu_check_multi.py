"""perf/gpu_check.py's multi-rank part: what only two or more GPUs can settle.

One rank per GPU (NCCL), or two gloo ranks on the CPU in the dry run, spawned from this part's process
with one deadline; a rank that hangs is killed and its checks say so. On a machine with one GPU the part
is skipped with that reason, so the same script runs unchanged where there are more.

- multi-captured-step-matches-eager: the distributed optimizer captured and eager, side by side on every
  rank over the same data: params bitwise equal after the steps (the captured step replays NCCL's own
  collectives, so nothing but the launch differs);
- multi-teardown-after-capture: ``destroy_process_group()`` with a captured step still held (the optimizer
  never closed) returns; with NCCL >= 2.26 it waits for every graph holding a communicator, so graphstep
  must release its graph first (graphstep/parallel/teardown.py);
- multi-dead-peer-bounded: after capture the last rank exits; the survivors' next step raises within
  ``distributed_timeout_s`` plus a margin (at the recapture agreement or the collective), with no host
  sync before it.
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from capture.devices import is_cuda
from graphstep.app.demo_dist import free_port
from gpu_check_numerics import record

CHECKS = ("multi-captured-step-matches-eager", "multi-teardown-after-capture", "multi-dead-peer-bounded")
STEPS, DEAD_AT, TIMEOUT_S, TEARDOWN_LIMIT_S, SPAWN_DEADLINE_S = 8, 5, 10.0, 30.0, 100.0


def _model(device) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64)).to(device)


def _backward(model, step: int, rank: int, device) -> None:
    generator = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own batch
    x = torch.randn(16, 64, generator=generator).to(device)
    model(x).square().mean().backward()


def _optimizer(model, capture: str):
    import graphstep as gs

    config = gs.OptimizerConfig(lr=1e-3, use_distributed_optimizer=True, capture=capture, capture_warmup_steps=1,
                                distributed_timeout_s=TIMEOUT_S, kernel="fused")
    return gs.get_optimizer(config, model)


def _steps(model, opt, steps: int, rank: int, device, first: int = 0) -> None:
    for step in range(first, first + steps):
        opt.zero_grad()
        _backward(model, step, rank, device)
        opt.step()


def _scenario_step_and_teardown(rank: int, device, report) -> None:
    import torch.distributed as dist

    eager_model, captured_model = _model(device), _model(device)
    eager, captured = _optimizer(eager_model, "eager"), _optimizer(captured_model, "graph")
    _steps(eager_model, eager, STEPS, rank, device)
    _steps(captured_model, captured, STEPS, rank, device)
    equal = all(torch.equal(a, b) for a, b in zip(eager_model.parameters(), captured_model.parameters()))
    report(equal=equal, captured=captured.captured, teardown_s=None)
    start = time.perf_counter()
    dist.destroy_process_group()  # the captured optimizer is still alive and was never closed
    report(teardown_s=time.perf_counter() - start, captured_after=captured.captured)


def _scenario_dead_peer(rank: int, device, report) -> None:
    import torch.distributed as dist

    world = dist.get_world_size()
    model = _model(device)
    opt = _optimizer(model, "graph")
    _steps(model, opt, DEAD_AT, rank, device)
    report(captured=opt.captured, raised=None)
    if rank == world - 1:
        os._exit(0)  # dies between steps, as a crashed rank would
    start = time.perf_counter()
    try:
        _steps(model, opt, 3, rank, device, first=DEAD_AT)
        report(raised="nothing", elapsed_s=time.perf_counter() - start)
    except Exception as error:  # CollectiveError, or torch's RuntimeError from the gloo agreement
        report(raised=f"{type(error).__name__}: {str(error)[:200]}", elapsed_s=time.perf_counter() - start)


SCENARIOS = {"step_and_teardown": _scenario_step_and_teardown, "dead_peer": _scenario_dead_peer}


def _rank_main(rank: int, world: int, port: int, backend: str, outdir: str, scenario: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    path = Path(outdir) / f"rank{rank}.json"
    found: dict = {}

    def report(**values) -> None:  # written at once: a rank that hangs later still leaves what it saw
        found.update(values)
        path.write_text(json.dumps(found))

    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        SCENARIOS[scenario](rank, device, report)
    except BaseException as error:
        report(error=f"{type(error).__name__}: {str(error)[:300]}")
    os._exit(0)  # no destroy at exit: with a dead peer it could block


def spawn(scenario: str, world: int, backend: str) -> list[dict]:
    """Every rank's report (``{"killed": True}`` for a rank still running at the deadline)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as outdir:
        procs = [ctx.Process(target=_rank_main, args=(rank, world, port, backend, outdir, scenario))
                 for rank in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + SPAWN_DEADLINE_S
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        reports = []
        for rank, p in enumerate(procs):
            killed = p.is_alive()
            if killed:
                p.kill()
                p.join()
            path = Path(outdir) / f"rank{rank}.json"
            reports.append({**(json.loads(path.read_text()) if path.exists() else {}), "killed": killed})
    return reports


def _verdicts(step: list[dict], dead: list[dict]) -> list[dict]:
    errors = [r.get("error") for r in step + dead[:-1] if r.get("error")]
    if errors:
        return [record(c, "error", errors[0]) for c in CHECKS]
    equal = all(r.get("equal") for r in step)
    out = [record(CHECKS[0], "pass" if equal and all(r.get("captured") for r in step) else "fail",
                  f"{len(step)} ranks, {STEPS} steps: params {'bitwise equal' if equal else 'differ'} "
                  "(captured vs eager)")]
    times = [r.get("teardown_s") for r in step]
    hung = [rank for rank, r in enumerate(step) if r["killed"] or r.get("teardown_s") is None]
    slow = hung or [rank for rank, t in enumerate(times) if t > TEARDOWN_LIMIT_S]
    kept = [rank for rank, r in enumerate(step) if r.get("captured_after")]
    if slow:
        detail = f"rank(s) {slow} did not return from destroy_process_group within {TEARDOWN_LIMIT_S:g} s"
    elif kept:
        detail = f"rank(s) {kept} still held the captured step after destroy_process_group"
    else:
        detail = (f"destroy_process_group returned in {max(times):.2f} s with a captured step held, which "
                  "graphstep released first")
    out.append(record(CHECKS[1], "fail" if slow or kept else "pass", detail, teardown_s=times))
    survivors = dead[:-1]
    bounded = [r for r in survivors if not r["killed"] and r.get("raised") not in (None, "nothing")
               and r.get("elapsed_s", 1e9) <= TIMEOUT_S + 5.0]
    detail = "; ".join(f"rank {rank}: " + ("hung (killed at the deadline)" if r["killed"] else
                                            f"{r.get('raised')} after {r.get('elapsed_s', float('nan')):.2f} s")
                       for rank, r in enumerate(survivors))
    out.append(record(CHECKS[2], "pass" if len(bounded) == len(survivors) else "fail",
                      f"{detail} (bound: distributed_timeout_s={TIMEOUT_S:g} s + 5 s)"))
    return out


def part_multi(device, small: bool, run_ranks: bool = False) -> list[dict]:
    """The rows, run only with ``--multi`` (``run_ranks``: its own run and time limit, outside the one-GPU
    budget); otherwise each says why it was skipped."""
    if is_cuda(device):
        world, backend = torch.cuda.device_count(), "nccl"
        if world < 2:
            return [record(c, f"skipped: needs >= 2 GPUs, found {world}") for c in CHECKS]
    else:
        world, backend = 2, "gloo"  # the dry run: the same scenarios on two CPU ranks
    if not run_ranks:
        why = f"skipped: multi-rank rows run with --multi ({world} {'GPUs' if backend == 'nccl' else 'gloo ranks'})"
        return [record(c, why) for c in CHECKS]
    return _verdicts(spawn("step_and_teardown", world, backend), spawn("dead_peer", world, backend))
