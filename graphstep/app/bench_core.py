"""The benchmark core shared by ``graphstep bench`` (graphstep/app/bench.py), perf/harness.py,
perf/bench_capture.py and perf/gpu_check.py: the timers, the inputs and the pipelines they time.

Every pipeline is built from one ``Inputs`` (flat fp32 sources of initial params and grads over a shape
set) and comes back as a ``Pipeline``: the step to time, and the untimed ``refill`` that restores the
grads a step rewrites in place (torch's unscale_ and clip, graphstep's fused kernel under a grad scale).

Timing is wall clock on the CPU (kernels run synchronously there) and device events elsewhere, with one
synchronisation after all timed steps; ``time_interleaved`` runs several pipelines round-robin so that a
shared machine's slow phases fall on every row alike. What is computed from the times (medians,
percentiles, a ratio's bootstrap interval) is in ``bench_stats``.
"""

from __future__ import annotations

import gc
import math
import platform
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from capture.profile import OpCounter

from capture.devices import accelerator_available, is_cuda, synchronize

from . import bench_engines, bench_shapes

LR, WEIGHT_DECAY, BETAS, EPS, CLIP = 3e-4, 0.1, (0.9, 0.95), 1e-8, 1.0
LOSS_SCALE = 1024.0
# Bytes each pipeline must move per fp32 param and step (docs/design.md §6): Adam reads param, grad, m, v and
# writes param, m, v (28); graphstep adds one grad read for the norm, which is also the inf check (32);
# torch's AMP pipeline adds unscale_ (read + write grads, 8), the clip norm (read, 4) and the clip
# multiply (read + write, 8): 48. The memory stream reads and writes each element: 8.
STREAM_BYTES, ADAM_BYTES, NORM_BYTES = 8, 28, 4
GRAPHSTEP_BYTES = ADAM_BYTES + NORM_BYTES
# The backward stand-in (``backward_stand_in``): zero the grad (write), then grad += source (read both,
# write): 16. Folding the norm in it adds one read of the just-written grad (20) and takes it off the step.
BACKWARD_BYTES = 16
TORCH_AMP_BYTES = 8 + 4 + 8 + ADAM_BYTES
CLIP_ADAMW_BYTES = 4 + 8 + ADAM_BYTES  # clip_grad_norm_ (the norm's read, the multiply's read + write) + AdamW
# torch's fused kernels, given a grad scale (every clipped or loss-scaled step), write the divided grads back:
# 4 more bytes per param than the compiled kernel, which only reads them (graphstep/kernels/__init__.py).
GRAD_WRITEBACK_BYTES = 4


def step_bytes(kernel: str, scaled: bool) -> int:
    """Bytes per fp32 param graphstep's full step moves with ``kernel``, clipped or loss-scaled or not."""
    return GRAPHSTEP_BYTES + (GRAD_WRITEBACK_BYTES if scaled and kernel != "compiled" else 0)


# ---- devices -------------------------------------------------------------------------------------------
def pick_device(name: str = "auto") -> torch.device:
    """``name`` as a torch.device; "auto" is the accelerator when there is one, else the CPU."""
    if name != "auto":
        return torch.device(name)
    if accelerator_available():
        return torch.accelerator.current_accelerator()
    return torch.device("cpu")


def device_name(device: torch.device) -> str:
    """A human name for the device (the GPU's model, or the CPU's)."""
    if is_cuda(device):
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def free_memory(device: torch.device) -> None:
    """Drop what the last pipeline left behind (its caching-allocator blocks too on a GPU)."""
    bench_engines.forget_shared_engines()
    gc.collect()
    if is_cuda(device):
        torch.cuda.empty_cache()


# ---- timing --------------------------------------------------------------------------------------------
def time_interleaved(steps_by_key: dict[str, Callable[[], object]], device: torch.device, warmup: int,
                     rounds: int, before: Optional[dict[str, Callable[[], object]]] = None) -> dict[str, list[float]]:
    """ms per call of each step, timed in ``rounds`` round-robin rounds (one call of every step per round).

    ``before[key]``, when given, runs before every call of that step, untimed (a grad refill). A shared
    machine's slow phases then fall on every row alike instead of on whichever row ran in them: the
    ratios between rows are what this steadies.
    """
    before = before or {}
    for key, step in steps_by_key.items():
        for _ in range(warmup):
            _call(before.get(key))
            step()
    on_cpu = device.type == "cpu"  # device events elsewhere; on the CPU the wall time is the step's
    synchronize(device)
    marks: dict[str, list] = {key: [] for key in steps_by_key}
    for _ in range(rounds):
        for key, step in steps_by_key.items():
            _call(before.get(key))
            if on_cpu:
                t0 = time.perf_counter()
                step()
                marks[key].append((time.perf_counter() - t0) * 1e3)
            else:  # the refill sits between the previous end and this start on the stream: never timed
                start, end = torch.Event(device=device, enable_timing=True), torch.Event(device=device,
                                                                                       enable_timing=True)
                start.record()
                step()
                end.record()
                marks[key].append((start, end))
    if on_cpu:
        return marks
    synchronize(device)  # the one sync: after all timed steps
    return {key: [start.elapsed_time(end) for start, end in pairs] for key, pairs in marks.items()}


def time_steps(step: Callable[[], object], device: torch.device, warmup: int, steps: int,
               before: Optional[Callable[[], object]] = None) -> list[float]:
    """ms per call of ``step``, ``steps`` timed calls after ``warmup`` untimed ones."""
    return time_interleaved({"step": step}, device, warmup, steps, {"step": before} if before else None)["step"]


def _call(fn: Optional[Callable[[], object]]) -> None:
    if fn is not None:
        fn()


def count_ops(pipeline: "Pipeline") -> tuple[Optional[int], str]:
    """Aten ops dispatched in one step of ``pipeline``, or (None, why they could not be counted)."""
    _call(pipeline.refill)
    try:
        counter = OpCounter()
        with counter:
            pipeline.step()
        return counter.count, ""
    except Exception as error:  # torch.compile refuses some dispatch modes
        return None, f"ops not countable: {type(error).__name__}: {str(error)[:120]}"


# ---- the shared inputs ---------------------------------------------------------------------------------
class Inputs:
    """One flat fp32 source of initial params and one of grads over a shape set; every pipeline copies
    from them, so all rows start from the same numbers."""

    def __init__(self, shapes: bench_shapes.Shapes, device: torch.device, seed: int = 0,
                 grad_std: float = 1e-3):
        self.shapes = shapes
        self.numel = bench_shapes.numel(shapes)
        self.device = device
        generator = torch.Generator(device=device).manual_seed(seed)
        self.param_flat = torch.randn(self.numel, generator=generator, device=device).mul_(0.02)
        self.grad_flat = torch.randn(self.numel, generator=generator, device=device).mul_(grad_std)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """``flat`` cut into one view per shape of the set."""
        out, start = [], 0
        for _, shape in self.shapes:
            n = math.prod(shape)
            out.append(flat[start:start + n].view(shape))
            start += n
        return out

    def new_params(self) -> list[torch.nn.Parameter]:
        return [torch.nn.Parameter(v.clone()) for v in self.views(self.param_flat)]

    def decay_groups(self, params) -> list[dict]:
        """Two param groups by the standard rule: weight decay except on biases and 1-D params."""
        pairs = list(zip(self.shapes, params))
        decay = [p for (name, shape), p in pairs if not bench_shapes.is_no_decay(name, shape)]
        no_decay = [p for (name, shape), p in pairs if bench_shapes.is_no_decay(name, shape)]
        return [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}]

    def module(self, params: list[torch.nn.Parameter]) -> torch.nn.Module:
        """An nn.Module whose named_parameters() carry the shape set's dotted names (``h.0.attn.c_attn.weight``)."""
        root = torch.nn.Module()
        for (name, _), p in zip(self.shapes, params):
            *path, leaf = name.split(".")
            module = root
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, torch.nn.Module())
                module = getattr(module, part)
            module.register_parameter(leaf, p)
            if name in ("wte", "wpe"):
                p.is_embedding_or_output_parameter = True
        return root


@dataclass
class Pipeline:
    """One benchmarked step. ``refill`` (untimed) restores the grads the step rewrites in place; the
    objects the step closes over are freed with it. ``skipped_steps``: for a row that runs graphstep's step,
    its optimizer's device counter of skipped steps (``StepResult.skipped_steps``), read once after timing."""

    step: Callable[[], object]
    refill: Optional[Callable[[], object]] = None
    optimizer: object = None
    notes: str = ""
    skipped_steps: Optional[torch.Tensor] = None


# ---- the pipelines -------------------------------------------------------------------------------------
def build_stream(numel: int, device: torch.device) -> Pipeline:
    """``x.mul_(1.0001)`` over one buffer: the in-place bandwidth every GB/s is read against."""
    x = torch.ones(numel, device=device)
    return Pipeline(lambda: x.mul_(1.0001))


def build_fused_floor(inputs: Inputs) -> Pipeline:
    """``torch._fused_adamw_`` once over one flat buffer: the floor an Adam step can reach."""
    param, grad = inputs.param_flat.clone(), inputs.grad_flat.clone()
    exp_avg, exp_avg_sq = torch.zeros_like(param), torch.zeros_like(param)
    step_t = torch.zeros((), dtype=torch.float32, device=param.device)

    def step():
        step_t.add_(1)
        torch._fused_adamw_([param], [grad], [exp_avg], [exp_avg_sq], [], [step_t], lr=LR, beta1=BETAS[0],
                            beta2=BETAS[1], weight_decay=WEIGHT_DECAY, eps=EPS, amsgrad=False, maximize=False)
    return Pipeline(step)


def _params_with_grads(inputs: Inputs) -> tuple[list, list, Callable[[], object]]:
    """Fresh params whose .grad are views of one grad buffer, and the refill that restores that buffer."""
    params = inputs.new_params()
    grad_flat = inputs.grad_flat.clone()  # own copy: unscale_ and the clip rewrite grads in place
    for p, g in zip(params, inputs.views(grad_flat)):
        p.grad = g
    return params, [p.grad for p in params], lambda: grad_flat.copy_(inputs.grad_flat)


def build_torch_adamw(inputs: Inputs, *, fused: bool, clip: bool = False) -> Pipeline:
    """``torch.optim.AdamW`` (fused or foreach) over two param groups, optionally after clip_grad_norm_."""
    params, _, refill = _params_with_grads(inputs)
    opt = torch.optim.AdamW(inputs.decay_groups(params), lr=LR, betas=BETAS, eps=EPS,
                            **({"fused": True} if fused else {"foreach": True}))

    def step():
        if clip:
            torch.nn.utils.clip_grad_norm_(params, CLIP, foreach=True)
        opt.step()
    return Pipeline(step, refill, opt)


def build_torch_amp(inputs: Inputs, *, variant: str = "fused") -> Pipeline:
    """The idiomatic torch AMP step: ``GradScaler.unscale_`` + ``clip_grad_norm_`` + ``scaler.step(AdamW)``
    + ``scaler.update()``. ``variant``: "fused" | "foreach" | "compiled" (clip + AdamW(foreach).step under
    ``torch.compile``; unscale_ and the skip-on-inf check stay GradScaler's)."""
    params, _, refill = _params_with_grads(inputs)
    kwargs = {"fused": True} if variant == "fused" else {"foreach": True}
    opt = torch.optim.AdamW(inputs.decay_groups(params), lr=LR, betas=BETAS, eps=EPS, **kwargs)
    scaler = torch.amp.GradScaler(inputs.device.type, init_scale=LOSS_SCALE, growth_interval=10**9)
    scaler.scale(torch.ones((), device=inputs.device))  # GradScaler creates its scale tensor lazily, here
    notes = ""
    if variant == "compiled":
        plain_step = opt.step

        def clip_and_step(*args, **kwargs):
            torch.nn.utils.clip_grad_norm_(params, CLIP, foreach=True)
            return plain_step()
        opt.step = torch.compile(clip_and_step)  # scaler.step(opt) calls it unless it found an inf
        notes = "clip_grad_norm_ runs inside scaler.step (skipped with it on inf)"

    def step():
        scaler.unscale_(opt)
        if variant != "compiled":
            torch.nn.utils.clip_grad_norm_(params, CLIP, foreach=True)
        scaler.step(opt)
        scaler.update()
    return Pipeline(step, refill, opt, notes)


def graphstep_config(*, clip_grad: float = CLIP, capture: str = "eager", loss_scale=None,
                     kernel: Optional[str] = "fused", fold: bool = False, param_checks: str = "every_step"):
    """The benchmarks' OptimizerConfig: AdamW with these hyperparameters, fp32; ``kernel=None`` leaves the
    config's default ("auto"); ``fold``: ``fold_grad_norm``; ``param_checks`` the config's."""
    import graphstep as gs

    chosen = {} if kernel is None else {"kernel": kernel}
    return gs.OptimizerConfig(optimizer="adam", lr=LR, weight_decay=WEIGHT_DECAY, adam_beta1=BETAS[0],
                              adam_beta2=BETAS[1], adam_eps=EPS, clip_grad=clip_grad, capture=capture,
                              loss_scale=loss_scale, fold_grad_norm=fold, param_checks=param_checks, **chosen)


class _GradArrives(torch.autograd.Function):
    """The backward stand-in's node: its backward hands ``source`` to the param, whose AccumulateGrad adds
    it into the grad in place (and then runs the param's post-accumulate-grad hooks)."""

    @staticmethod
    def forward(ctx, param: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        ctx.source = source
        return param.new_zeros(())

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return ctx.source, None


def backward_stand_in(opt, params: list, sources: list) -> Callable[[], None]:
    """A backward without the model's compute: ``opt.zero_grad()``, then every param's grad arrives through
    autograd (``grad += source``, in place: exactly ``source``), last param first, as a model's backward
    delivers them. 16 B per param (zero: write; accumulate: read grad and source, write grad); the hooks a
    real backward runs (the folded norm's) run here too."""
    def backward() -> None:
        opt.zero_grad()
        with torch.enable_grad():
            loss = sum(_GradArrives.apply(p, s) for p, s in zip(params, sources))
        loss.backward()
    return backward


def build_graphstep(inputs: Inputs, *, clip_grad: float = CLIP, capture: str = "eager", loss_scale=None,
                    kernel: Optional[str] = "fused", fold: bool = False, timed: str = "step",
                    param_checks: str = "every_step") -> Pipeline:
    """graphstep's step over a fresh model of the shape set; with ``capture="graph"`` the warm-up steps and
    the capture run here, so the first timed call is a replay. ``kernel=None``: the config's default. The
    notes say which kernel ran and the seconds spent compiling while building (probe and first step).

    ``timed``: "step" (the grads refilled untimed before each step: a copy, or with ``fold`` the backward
    stand-in, whose hooks fold the norm), "backward" (the backward stand-in alone), "backward+step", or
    "norm" (the norm stage alone, refilled by a copy), "step-after-copy" (the step, its grads refilled by a
    copy even with ``fold``: no backward, so the step folds the norm itself)."""
    config = graphstep_config(clip_grad=clip_grad, capture=capture, loss_scale=loss_scale, kernel=kernel, fold=fold,
                              param_checks=param_checks)
    engine = bench_engines.shared_engine(inputs, config, backward_stand_in)
    opt, backward = engine.opt, engine.backward
    if timed == "backward":
        return Pipeline(backward, None, opt, engine.notes)
    skipped = opt.result.skipped_steps  # the rows below run the step: a skipped one is no timed update
    if timed == "backward+step":
        def backward_and_step():
            backward()
            opt.step()
        return Pipeline(backward_and_step, None, opt, engine.notes, skipped)
    if timed == "norm":
        norm = next(stage for stage in opt.stages if stage.name == "norm")
        return Pipeline(norm.apply, engine.copy_grads, opt, engine.notes)
    if timed == "step-after-copy":
        return Pipeline(opt.step, engine.copy_grads, opt, engine.notes, skipped)
    return Pipeline(opt.step, engine.refill, opt, engine.notes, skipped)


def build_read_floor(inputs: Inputs) -> Pipeline:
    """``x.sum()`` over a buffer of the grads' numel: the read-only floor a norm pass can reach (4 B/param)."""
    grad = inputs.grad_flat.clone()
    return Pipeline(lambda: grad.sum())


def build_graphstep_norm_pass(inputs: Inputs) -> Pipeline:
    """graphstep's norm stage alone (sum of squares, non-finite check, grad norm): one read of the grads. Of
    the same engine as the unfolded loss-scaled step's row, ``graphstep-scaled`` (shared when built
    together)."""
    return build_graphstep(inputs, loss_scale=LOSS_SCALE, kernel=None, timed="norm")


def build_graphstep_update_stage(inputs: Inputs) -> Pipeline:
    """The engine's update stage alone (the fused kernel over the group views), without the norm pass."""
    built = build_graphstep(inputs, clip_grad=0.0, capture="eager")
    update = next(stage for stage in built.optimizer.stages if stage.name == "update")
    return Pipeline(update.apply, built.refill, built.optimizer)
