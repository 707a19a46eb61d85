"""perf/gpu_check.py's correctness parts: eager versus captured, bitwise, on whatever device it is given.

Each part returns a list of check records (``record(...)``): the driver runs every part in its own
process, so a CUDA error that poisons a context loses one part, not the run. On the CPU the same code
runs over the CPU replay backend (capture="graph"); the parts that only mean something on a GPU (sync
debug mode, CUDA memory, pinned-memory threads, NCCL) record ``skipped: no CUDA``.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Callable, Optional

import torch

import graphstep as gs
from capture.devices import is_cuda, synchronize

PRECISIONS = {"fp32": {}, "bf16": {"bf16": True}, "fp16": {"fp16": True, "initial_loss_scale": 2.0**10}}
KERNELS = ("fused", "compiled")
# capture_warmup_steps=3: the step is captured at step 3, so the replacement and the inf grad land on replays.
STEPS, SMALL_STEPS, INF_STEP, REPLACE_STEP = 30, 10, 7, 5  # the dry run (small) stops at 10 steps
NO_CUDA = "skipped: no CUDA"


def record(check: str, status: str, detail: str = "", **numbers) -> dict:
    """One line of the report: status is "pass", "fail", "error" or a "skipped: <why>" string."""
    return {"check": check, "status": status, "detail": detail, "numbers": numbers}


def close(opt) -> None:
    """Release the captured graph and its pool where the engine offers ``close()``."""
    closer = getattr(opt, "close", None)
    if closer is not None:
        closer()


# ---- one short training run, recorded step by step -----------------------------------------------------
@dataclass
class Run:
    model: torch.nn.Module
    opt: object
    history: list  # per step: {"update_successful", "grad_norm", "loss_scale"} clones


def tiny_model(device, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64)).to(device)


def train(device, mode: str, *, precision: str = "fp32", kernel: str = "fused", steps: int = STEPS,
          replace_at: Optional[int] = None, config_extra: Optional[dict] = None, process_group=None,
          prepare: Optional[Callable[[torch.nn.Module], object]] = None) -> Run:
    """``steps`` steps of a small MLP under an LR schedule, with one injected inf grad at INF_STEP (the
    step must be skipped) and optionally a param's ``.data`` replaced before step ``replace_at``.
    ``prepare(model)`` runs before the optimizer is built (e.g. ``gs.fp8.convert``)."""
    model = tiny_model(device)
    if prepare is not None:
        prepare(model)
    config = gs.OptimizerConfig(lr=1e-3, clip_grad=0.5, capture=mode, capture_warmup_steps=3, kernel=kernel,
                                **PRECISIONS[precision], **(config_extra or {}))
    opt = gs.get_optimizer(config, model, process_group=process_group)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))
    generator = torch.Generator(device=device).manual_seed(0)
    first = next(model.parameters())
    input_dtype = next(p.dtype for p in model.parameters() if p.element_size() > 1)  # not an fp8 weight's
    history = []
    for step in range(steps):
        x = torch.randn(16, 64, device=device, generator=generator)
        opt.zero_grad()
        opt.scale_loss(model(x.to(input_dtype)).float().square().mean()).backward()
        if step == INF_STEP:
            first.main_grad.view(-1)[0] = float("inf")
        if step == replace_at:
            with torch.no_grad():
                first.data = first.data.clone()  # the engine adopts it back and recaptures
        result = opt.step()
        history.append({"update_successful": result.update_successful.clone(),
                        "grad_norm": result.grad_norm.clone(), "loss_scale": result.loss_scale.clone()})
        sched.step()
    synchronize(device)
    return Run(model, opt, history)


def _tensors(value, path: str):
    """(path, tensor-or-plain-value) leaves of a nested state dict."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors(item, f"{path}.{key}")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _tensors(item, f"{path}[{index}]")
    else:
        yield path, value


def differences(eager: Run, captured: Run) -> list[str]:
    """Where two runs differ: model params, every leaf of ``state_dict()`` (step, main params, every
    state tensor, the loss scaler), and each step's found_inf, grad norm and loss scale."""
    out = []
    for i, (a, b) in enumerate(zip(eager.model.parameters(), captured.model.parameters())):
        if not torch.equal(a, b):
            out.append(f"param {i}")
    leaves_a = dict(_tensors(eager.opt.state_dict(), "state_dict"))
    leaves_b = dict(_tensors(captured.opt.state_dict(), "state_dict"))
    for path in sorted(set(leaves_a) | set(leaves_b)):
        a, b = leaves_a.get(path), leaves_b.get(path)
        same = torch.equal(a, b) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) else a == b
        if not same:
            out.append(path)
    for step, (a, b) in enumerate(zip(eager.history, captured.history)):
        out += [f"step {step} {key}" for key in a if not torch.equal(a[key], b[key])]
    return out


def compare(name: str, eager: Run, captured: Run, expected_recaptures: int = 0, **numbers) -> dict:
    """A check record for eager versus captured: bitwise equal everywhere, captured, recaptures as expected."""
    diffs = differences(eager, captured)
    count = captured.opt.recaptures
    skipped = [not bool(h["update_successful"]) for h in captured.history]
    problems = []
    if not captured.opt.captured:
        problems.append(f"not captured (backend {captured.opt.capture_backend})")
    if count != expected_recaptures:
        problems.append(f"recaptures {count}, expected {expected_recaptures}")
    if diffs:
        problems.append(f"{len(diffs)} differences, first: {', '.join(diffs[:4])}")
    if not skipped[INF_STEP]:
        problems.append(f"the inf step {INF_STEP} was not skipped")
    detail = "; ".join(problems) or (f"bitwise equal over {len(captured.history)} steps (params, state_dict, "
                                     f"found_inf, grad norm, loss scale); inf step skipped; recaptures {count}")
    return record(name, "fail" if problems else "pass", detail, recaptures=count, differences=len(diffs),
                  backend=captured.opt.capture_backend, skipped_steps=sum(skipped), **numbers)


# ---- the parts --------------------------------------------------------------------------------------------
def part_bitwise(device, small: bool) -> list[dict]:
    """Eager vs captured for every precision x kernel, then replays under CUDA's sync debug mode."""
    out = []
    for precision in PRECISIONS:
        for kernel in KERNELS:
            name = f"bitwise-{precision}-{kernel}"
            try:
                steps = SMALL_STEPS if small else STEPS
                eager = train(device, "eager", precision=precision, kernel=kernel, steps=steps)
                captured = train(device, "graph", precision=precision, kernel=kernel, steps=steps)
                out.append(compare(name, eager, captured))
                close(captured.opt)
            except Exception as error:
                out.append(record(name, "error", f"{type(error).__name__}: {error}"))
    out.append(sync_debug_replays(device))
    return out


def part_negative_control(device, small: bool) -> list[dict]:
    """The comparison itself can fail: two identical eager runs agree, and one element changed is found."""
    return [negative_control(device)]


def negative_control(device) -> dict:
    name = "bitwise-negative-control"
    base, again = train(device, "eager", steps=8), train(device, "eager", steps=8)
    same = differences(base, again)
    with torch.no_grad():
        next(again.model.parameters()).view(-1)[0] += 1e-3  # one element off, as a broken replay would be
    found = differences(base, again)
    ok = bool(found) and not same
    return record(name, "pass" if ok else "fail",
                  f"a one-element change found as {found[:2]}; two identical eager runs: {len(same)} differences")


def sync_debug_replays(device) -> dict:
    """Five replays of a captured step under ``torch.cuda.set_sync_debug_mode("error")``, the lr changed
    before each as a schedule would: any host sync in ``opt.step()`` (the hyperparameter refresh included)
    raises."""
    name = "replay-without-host-sync"
    if not is_cuda(device):
        return record(name, NO_CUDA)
    run = train(device, "graph", steps=8)
    try:
        torch.cuda.set_sync_debug_mode("error")
        for _ in range(5):
            for group in run.opt.param_groups:
                group["lr"] *= 0.9
            run.opt.step()
    except Exception as error:
        return record(name, "fail", f"a replay synchronised with the host: {type(error).__name__}: {error}")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    synchronize(device)
    if run.opt.recaptures != 0:
        return record(name, "fail", f"the lr change recaptured the step ({run.opt.recaptures} recaptures)")
    return record(name, "pass", "5 replays with a changed lr under set_sync_debug_mode('error'), no recapture")


def part_recapture(device, small: bool) -> list[dict]:
    """A param's .data replaced after capture: one recapture, still bitwise equal to eager (which adopts
    the same replacement)."""
    steps = SMALL_STEPS if small else STEPS
    eager = train(device, "eager", replace_at=REPLACE_STEP, steps=steps)
    captured = train(device, "graph", replace_at=REPLACE_STEP, steps=steps)
    return [compare("forced-recapture", eager, captured, expected_recaptures=1)]


def part_memory(device, small: bool) -> list[dict]:
    """Device memory over 10 recaptures of the same step, each forced by replacing a param's ``.data`` (which
    the engine adopts back): reserved memory flat, so no graph pool outlives its capture. The recapture
    count is checked on every device (the CPU replay backend counts the same way); memory only on CUDA."""
    name = "memory-flat-over-10-recaptures"
    run = train(device, "graph", steps=6)
    first = next(run.model.parameters())
    allocated, reserved, counts = [], [], []
    for _ in range(MEMORY_ROUNDS):
        with torch.no_grad():
            first.data = first.data.clone()
        for _ in range(STEPS_PER_RECAPTURE):
            run.opt.step()
        synchronize(device)
        counts.append(run.opt.recaptures)
        if is_cuda(device):
            allocated.append(torch.cuda.memory_allocated(device))
            reserved.append(torch.cuda.memory_reserved(device))
    return [memory_verdict(name, counts, allocated, reserved, cuda=is_cuda(device))]


MEMORY_ROUNDS = 10
# A replacement is adopted at the next step, which runs eagerly (the runner precedes every recapture with one
# eager step, RECAPTURE_WARMUP_STEPS); the step after it recaptures. One step per replacement would land every
# other replacement on that eager step, which recaptures nothing: 5 recaptures from 10 replacements.
STEPS_PER_RECAPTURE = 2


def memory_verdict(name: str, counts: list, allocated: list, reserved: list, *, cuda: bool) -> dict:
    """The memory row's verdict: one recapture per round, and (on CUDA) allocated and reserved memory flat
    within 1 MiB from the first round to the last."""
    problems = []
    if counts != list(range(1, len(counts) + 1)):
        problems.append(f"recaptures after each round {counts}, expected {list(range(1, len(counts) + 1))}")
    slack = 1 << 20
    if cuda and (allocated[-1] - allocated[0] > slack or reserved[-1] - reserved[0] > slack):
        problems.append("memory grew")
    memory = (f"allocated {allocated[0] / 2**20:.1f} -> {allocated[-1] / 2**20:.1f} MiB, reserved "
              f"{reserved[0] / 2**20:.1f} -> {reserved[-1] / 2**20:.1f} MiB (growth allowed: 1 MiB)"
              if cuda else "memory not measured without CUDA")
    detail = "; ".join(problems + [memory, f"{counts[-1] if counts else 0} recaptures over {len(counts)} rounds"])
    status = "fail" if problems else ("pass" if cuda else NO_CUDA)
    return record(name, status, detail, allocated=allocated, reserved=reserved, recaptures=counts)


def part_pinned_thread(device, small: bool) -> list[dict]:
    """Capture while another thread pins host memory and copies from it (a DataLoader's pin_memory
    thread): the capture must survive it and the run stay bitwise equal to eager."""
    name = "capture-with-pinned-memory-thread"
    if not is_cuda(device):
        return [record(name, NO_CUDA)]
    stop, copies, failures = threading.Event(), [0], []

    def pin_and_copy():
        side = torch.cuda.Stream(device)
        target = torch.empty(1 << 20, device=device)
        try:
            while not stop.is_set():
                source = torch.randn(1 << 20).pin_memory()
                with torch.cuda.stream(side):
                    target.copy_(source, non_blocking=True)
                side.synchronize()
                copies[0] += 1
        except Exception as error:  # reported below: the thread's own failures are part of the result
            failures.append(f"{type(error).__name__}: {error}")

    eager = train(device, "eager")
    thread = threading.Thread(target=pin_and_copy, daemon=True)
    thread.start()
    try:
        captured = train(device, "graph")
    finally:
        stop.set()
        thread.join(timeout=30)
    result = compare(name, eager, captured, copies_during_run=copies[0])
    if failures:
        result["status"] = "fail"
        result["detail"] += f"; the copying thread failed: {failures[0]}"
    return [result]


def part_nccl(device, small: bool) -> list[dict]:
    """A world-size-1 NCCL group: reduce-scatter, all-gather and all-reduce captured in one graph and
    replayed against their eager results. (The distributed optimizer over one rank runs no collective at
    all; it is checked with two ranks, perf/gpu_check_multi.py.)"""
    names = ("nccl-world1-collectives-captured",)
    if not is_cuda(device):
        return [record(n, NO_CUDA) for n in names]
    import torch.distributed as dist

    import capture

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    index = device.index if device.index is not None else torch.cuda.current_device()
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device(device.type, index))
    out = []
    try:
        x = torch.randn(4096, device=device)
        shard, gathered, doubled = (torch.empty(4096, device=device) for _ in range(3))

        def collectives():
            dist.reduce_scatter_tensor(shard, x)
            dist.all_gather_into_tensor(gathered, shard)
            dist.all_reduce(gathered)
            doubled.copy_(gathered * 2)

        graph = capture.graph(collectives, warmup=1, backend="cuda")
        mismatches = 0
        for i in range(4):  # warm-up, capture (+ replay), two replays
            x.copy_(torch.randn(4096, device=device, generator=torch.Generator(device=device).manual_seed(i)))
            graph()
            mismatches += int(not torch.equal(doubled, x * 2))
        graph.close()
        out.append(record(names[0], "pass" if mismatches == 0 else "fail",
                          f"{mismatches} of 4 calls differ from 2x (world size 1: every collective is the identity)"))
    except Exception as error:
        out += [record(n, "error", f"{type(error).__name__}: {error}") for n in names[len(out):]]
    finally:
        dist.destroy_process_group()
    return out


def _fp8_first_layer(model: torch.nn.Module) -> None:
    gs.fp8.convert(model, "tensorwise", modules=lambda name, module: name == "0")


# The optimizer families and features beyond Adam: (OptimizerConfig fields, model preparation or None); a
# row runs only where the config accepts its fields.
FAMILIES = {"muon": ({"optimizer": "muon"}, None),
            "offload": ({"optimizer_cpu_offload": True, "optimizer_offload_fraction": 0.5}, None),
            # The precision-aware optimizer: fp8 / bf16 moments and bf16 params with 16-bit remainders, whose
            # encode and decode (a multi-tensor max per block, index_fill, cumsum, integer bit ops) must capture on
            # CUDA.
            "precision-aware": ({"bf16": True, "use_precision_aware_optimizer": True, "exp_avg_dtype": torch.uint8,
                                 "exp_avg_sq_dtype": torch.bfloat16}, None)}


FP8 = {"fp8": ({"bf16": True, "fp8_recipe": "tensorwise"}, _fp8_first_layer)}


def part_families(device, small: bool, families: Optional[dict] = None) -> list[dict]:
    """Muon, CPU offload and the precision-aware optimizer, eager vs captured, where ``OptimizerConfig``
    accepts them."""
    out = []
    for family, (fields, prepare) in (families or FAMILIES).items():
        name = f"family-{family}"
        try:
            gs.OptimizerConfig(**fields)
        except (TypeError, ValueError) as error:
            out.append(record(name, f"skipped: OptimizerConfig does not accept {fields} ({type(error).__name__})",
                              str(error)[:200]))
            continue
        try:
            steps = SMALL_STEPS if small else STEPS
            eager = train(device, "eager", config_extra=fields, steps=steps, prepare=prepare)
            captured = train(device, "graph", config_extra=fields, steps=steps, prepare=prepare)
            out.append(compare(name, eager, captured))
        except Exception as error:
            out.append(record(name, "error", f"{type(error).__name__}: {error}"))
    return out


def part_fp8(device, small: bool) -> list[dict]:
    """fp8 params (one tensorwise-scaled layer over bf16), eager vs captured."""
    return part_families(device, small, FP8)
