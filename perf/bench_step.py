"""The optimizer step, side by side in one process, on GPT-2 small's parameter shapes.

What each row runs over the same ~124M fp32 params in 148 tensors, with the same random fp32 grads:

- memory stream: ``x.mul_(1.0001)`` over one buffer of the same numel: this machine's in-place
  bandwidth (8 bytes per element, read + write), the context for every GB/s below;
- ``torch._fused_adamw_`` once over one flat buffer: the floor an Adam step can reach (DESIGN.md §6);
- ``torch.optim.AdamW(fused=True)`` and ``AdamW(foreach=True)`` with two param groups (decay and
  no-decay, the standard overrides), and ``AdamW(fused=True)`` after ``clip_grad_norm_``;
- graphstep's step: without clipping (``clip_grad=0``, no loss scaling; the norm pass still runs, as
  the non-finite check) and the full step (``clip_grad=1.0``: norm, non-finite check, clip folded into
  the update), eager, and the full step captured (CPU replay backend, or a CUDA graph on a GPU), with
  the default fused kernel and with ``kernel="compiled"``.

Bytes per param: Adam over fp32 must read param, grad, m, v and write param, m, v (28 B); the full step
also reads the grads once for the norm (32 B) — DESIGN.md §6. GB/s is those bytes over the median time:
how close each row comes to the machine's stream bandwidth for the work it has to do.

One pipeline is built at a time and freed before the next (each holds ~2 GB at GPT-2 small).

    python perf/bench_step.py [--quick] [--steps 20] [--warmup 3] [--json out.json] [--only fused-floor,...]
    python perf/bench_step.py --interleave --steps 25 --only fused-floor,graphstep-full,...  # the README's tables
    graphstep bench [same flags]    # from a checkout
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

# perf/ is no package: find shapes.py next to this file, and graphstep in the checkout above it.
_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]
import shapes as shape_sets  # noqa: E402

LR, WEIGHT_DECAY, BETAS, EPS = 3e-4, 0.1, (0.9, 0.95), 1e-8
ADAM_BYTES, NORM_BYTES, STREAM_BYTES = 28, 4, 8
# torch's AMP pipeline: unscale_ reads and writes the grads (8 B), clip_grad_norm_ reads them for the
# norm (4 B) and again to scale them (8 B), then AdamW (28 B): 48 B per param (DESIGN.md §6).
AMP_PIPELINE_BYTES = 8 + 4 + 8 + ADAM_BYTES
LOSS_SCALE = 1024.0


@dataclass
class Row:
    key: str
    label: str
    kind: str  # "stream" | "update" | "full" | "scaled": what the ratio column compares against
    bytes_per_elem: int
    median_ms: float = math.nan
    p10_ms: float = math.nan
    p90_ms: float = math.nan
    gbps: float = math.nan
    vs_graphstep: float = math.nan
    vs_floor: float = math.nan
    error: Optional[str] = None
    times_ms: list = field(default_factory=list)


# ---- timing ----------------------------------------------------------------------------------------------
def time_steps(step: Callable[[], object], device: torch.device, warmup: int, steps: int) -> list[float]:
    """ms per call of ``step``, ``steps`` timed calls after ``warmup`` untimed ones."""
    return time_interleaved({"step": step}, device, warmup, steps)["step"]


def time_interleaved(steps_by_key: dict[str, Callable[[], object]], device: torch.device, warmup: int,
                     rounds: int) -> dict[str, list[float]]:
    """ms per call of each step, timed in ``rounds`` round-robin rounds (one call of every step per round).

    A shared machine's slow phases then fall on every row alike instead of on whichever row ran in
    them: the ratios between rows are what this steadies.
    """
    for step in steps_by_key.values():
        for _ in range(warmup):
            step()
    cuda = device.type == "cuda"  # CUDA events; on the CPU kernels run synchronously: wall time is the step's
    if cuda:
        torch.cuda.synchronize(device)
    marks: dict[str, list] = {key: [] for key in steps_by_key}
    for _ in range(rounds):
        for key, step in steps_by_key.items():
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step()
                end.record()
                marks[key].append((start, end))
            else:
                t0 = time.perf_counter()
                step()
                marks[key].append((time.perf_counter() - t0) * 1e3)
    if cuda:
        torch.cuda.synchronize(device)  # the one sync: after all timed steps
        return {key: [start.elapsed_time(end) for start, end in pairs] for key, pairs in marks.items()}
    return marks


def _percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


# ---- the shared inputs -----------------------------------------------------------------------------------
class Inputs:
    """One flat fp32 source of initial params and one of grads; every pipeline copies from them."""

    def __init__(self, shapes: shape_sets.Shapes, device: torch.device, seed: int):
        self.shapes = shapes
        self.numel = shape_sets.numel(shapes)
        generator = torch.Generator(device=device).manual_seed(seed)
        self.param_flat = torch.randn(self.numel, generator=generator, device=device).mul_(0.02)
        self.grad_flat = torch.randn(self.numel, generator=generator, device=device).mul_(1e-3)
        self.device = device

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        out, start = [], 0
        for _, shape in self.shapes:
            n = math.prod(shape)
            out.append(flat[start:start + n].view(shape))
            start += n
        return out

    def new_params(self) -> list[torch.nn.Parameter]:
        return [torch.nn.Parameter(v.clone()) for v in self.views(self.param_flat)]

    def decay_groups(self, params) -> list[dict]:
        decay = [p for (name, shape), p in zip(self.shapes, params) if not shape_sets.is_no_decay(name, shape)]
        no_decay = [p for (name, shape), p in zip(self.shapes, params) if shape_sets.is_no_decay(name, shape)]
        return [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}]


def module_of(inputs: Inputs, params: list[torch.nn.Parameter]) -> torch.nn.Module:
    """An nn.Module whose named_parameters() carry the shape set's names (``h.0.attn.c_attn.weight``)."""
    root = torch.nn.Module()
    for (name, _), p in zip(inputs.shapes, params):
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


# ---- the pipelines: each returns a step callable; the objects it closes over are freed after timing ------
def build_stream(inputs: Inputs):
    x = inputs.param_flat.clone()
    return lambda: x.mul_(1.0001)


def build_fused_floor(inputs: Inputs):
    param = inputs.param_flat.clone()
    grad = inputs.grad_flat.clone()
    exp_avg, exp_avg_sq = torch.zeros_like(param), torch.zeros_like(param)
    step_t = torch.zeros((), dtype=torch.float32, device=param.device)

    def step():
        step_t.add_(1)
        torch._fused_adamw_([param], [grad], [exp_avg], [exp_avg_sq], [], [step_t], lr=LR, beta1=BETAS[0],
                            beta2=BETAS[1], weight_decay=WEIGHT_DECAY, eps=EPS, amsgrad=False, maximize=False)
    return step


def build_torch_adamw(inputs: Inputs, *, fused: bool, clip: bool = False):
    params = inputs.new_params()
    grad_flat = inputs.grad_flat.clone()  # own copy: clip_grad_norm_ scales grads in place
    for p, g in zip(params, inputs.views(grad_flat)):
        p.grad = g
    kwargs = {"fused": True} if fused else {"foreach": True}
    opt = torch.optim.AdamW(inputs.decay_groups(params), lr=LR, betas=BETAS, eps=EPS, **kwargs)

    def step():
        if clip:
            torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
    return step


def build_torch_amp_pipeline(inputs: Inputs):
    """The idiomatic torch step: GradScaler.unscale_ + clip_grad_norm_ + AdamW(fused).step + update."""
    params = inputs.new_params()
    grad_flat = inputs.grad_flat.clone()
    for p, g in zip(params, inputs.views(grad_flat)):
        p.grad = g
    opt = torch.optim.AdamW(inputs.decay_groups(params), lr=LR, betas=BETAS, eps=EPS, fused=True)
    scaler = torch.amp.GradScaler(inputs.device.type, init_scale=LOSS_SCALE, growth_interval=10**9)
    scaler.scale(torch.ones((), device=inputs.device))  # GradScaler creates its scale tensor lazily here

    def step():
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        scaler.step(opt)
        scaler.update()
        grad_flat.mul_(LOSS_SCALE)  # re-scale for the next step (untimed work would hide it; it is 8 B)
    return step


def build_graphstep_update_stage(inputs: Inputs):
    """The engine's update stage alone (the fused kernel over the group views): what issue 2 compares
    with the one-buffer floor. The full step adds the one-read norm pass on top."""
    opt = build_graphstep(inputs, clip_grad=0.0, capture="eager", return_optimizer=True)
    opt.step()  # refresh the hyperparameter tensors once
    update = next(stage for stage in opt.stages if stage.name == "update")
    return update.apply


def build_graphstep(inputs: Inputs, *, clip_grad: float, capture: str, loss_scale=None, kernel: str = "fused",
                    return_optimizer: bool = False):
    import graphstep as gs

    params = inputs.new_params()
    model = module_of(inputs, params)
    config = gs.OptimizerConfig(optimizer="adam", lr=LR, weight_decay=WEIGHT_DECAY, adam_beta1=BETAS[0],
                                adam_beta2=BETAS[1], adam_eps=EPS, clip_grad=clip_grad, capture=capture,
                                loss_scale=loss_scale, kernel=kernel)
    opt = gs.get_optimizer(config, model)
    with torch.no_grad():
        for p, g in zip(params, inputs.views(inputs.grad_flat)):
            p.main_grad.copy_(g)  # a view of the engine's flat grad buffer (is p.grad too, for fp32 params)
    if capture == "graph":
        for _ in range(config.capture_warmup_steps + 1):  # the eager warm-up and the capture itself
            opt.step()
    return opt if return_optimizer else opt.step


PIPELINES = {
    "stream": ("memory stream: x.mul_(1.0001), same numel", "stream", STREAM_BYTES, build_stream),
    "fused-floor": ("torch._fused_adamw_, one flat buffer (floor)", "update", ADAM_BYTES, build_fused_floor),
    "adamw-fused": ("torch AdamW(fused=True)", "update", ADAM_BYTES,
                    lambda i: build_torch_adamw(i, fused=True)),
    "adamw-foreach": ("torch AdamW(foreach=True)", "update", ADAM_BYTES,
                      lambda i: build_torch_adamw(i, fused=False)),
    # clip_grad=0 turns the clip off but not the norm pass: it doubles as the non-finite check, so the
    # engine still reads the grads once more than a bare update (32 B, not 28).
    "graphstep-update": ("graphstep, no clip (eager, clip_grad=0; norm/inf check still run)", "update",
                         ADAM_BYTES + NORM_BYTES,
                         lambda i: build_graphstep(i, clip_grad=0.0, capture="eager")),
    "adamw-fused-clip": ("torch clip_grad_norm_ + AdamW(fused=True)", "full", ADAM_BYTES + NORM_BYTES,
                         lambda i: build_torch_adamw(i, fused=True, clip=True)),
    "graphstep-full": ("graphstep, full step (eager, clip_grad=1.0)", "full", ADAM_BYTES + NORM_BYTES,
                       lambda i: build_graphstep(i, clip_grad=1.0, capture="eager")),
    "graphstep-full-graph": ("graphstep, full step (capture='graph')", "full", ADAM_BYTES + NORM_BYTES,
                             lambda i: build_graphstep(i, clip_grad=1.0, capture="graph")),
    # kernel="compiled": one compiled loop that reads the grads without writing them back (torch's fused
    # kernels write them whenever given a grad scale, i.e. on every clipped or loss-scaled step: 36 B).
    "graphstep-full-compiled": ("graphstep, full step, kernel='compiled' (eager)", "full", ADAM_BYTES + NORM_BYTES,
                                lambda i: build_graphstep(i, clip_grad=1.0, capture="eager", kernel="compiled")),
    "graphstep-full-compiled-graph": ("graphstep, full step, kernel='compiled' (capture='graph')", "full",
                                      ADAM_BYTES + NORM_BYTES,
                                      lambda i: build_graphstep(i, clip_grad=1.0, capture="graph",
                                                                kernel="compiled")),
    "graphstep-update-stage": ("graphstep update stage alone (fused kernel over group views)", "update",
                               ADAM_BYTES, build_graphstep_update_stage),
    "torch-amp": ("torch GradScaler.unscale_ + clip_grad_norm_ + AdamW(fused) + update", "scaled",
                  AMP_PIPELINE_BYTES, build_torch_amp_pipeline),
    "graphstep-scaled": ("graphstep full step with loss scale (unscale + clip folded in)", "scaled",
                         ADAM_BYTES + NORM_BYTES,
                         lambda i: build_graphstep(i, clip_grad=1.0, capture="eager", loss_scale=LOSS_SCALE)),
    "graphstep-scaled-compiled": ("graphstep full step with loss scale, kernel='compiled'", "scaled",
                                  ADAM_BYTES + NORM_BYTES,
                                  lambda i: build_graphstep(i, clip_grad=1.0, capture="eager", loss_scale=LOSS_SCALE,
                                                            kernel="compiled")),
}


def run_pipeline(key: str, inputs: Inputs, warmup: int, steps: int) -> Row:
    label, kind, nbytes, build = PIPELINES[key]
    row = Row(key, label, kind, nbytes)
    try:
        step = build(inputs)
        times = time_steps(step, inputs.device, warmup, steps)
    except Exception as error:  # a broken row must not lose the others
        row.error = f"{type(error).__name__}: {error}"
        return row
    finally:
        step = None
        _free(inputs.device)
    return _summarize(row, times, inputs.numel)


def run_interleaved(keys: list[str], inputs: Inputs, warmup: int, rounds: int) -> list[Row]:
    """Every row of ``keys`` built at once and timed round-robin (see ``time_interleaved``)."""
    rows = {key: Row(key, *PIPELINES[key][:3]) for key in keys}
    steps = {}
    for key in keys:
        try:
            steps[key] = PIPELINES[key][3](inputs)
        except Exception as error:
            rows[key].error = f"{type(error).__name__}: {error}"
    try:
        times = time_interleaved(steps, inputs.device, warmup, rounds)
    finally:
        steps = None
        _free(inputs.device)
    return [_summarize(rows[key], times[key], inputs.numel) if key in times else rows[key] for key in keys]


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _summarize(row: Row, times: list[float], numel: int) -> Row:
    ordered = sorted(times)
    row.times_ms = times
    row.median_ms = statistics.median(times)
    row.p10_ms, row.p90_ms = _percentile(ordered, 0.1), _percentile(ordered, 0.9)
    row.gbps = row.bytes_per_elem * numel / (row.median_ms * 1e-3) / 1e9
    return row


def add_ratios(rows: list[Row]) -> None:
    by_key = {r.key: r for r in rows}
    floor = by_key.get("fused-floor")
    engine = {"update": by_key.get("graphstep-update"), "full": by_key.get("graphstep-full"),
              "scaled": by_key.get("graphstep-scaled")}
    for r in rows:
        if r.kind == "stream":
            continue
        if floor is not None:
            r.vs_floor = r.median_ms / floor.median_ms
        if engine.get(r.kind) is not None:
            r.vs_graphstep = r.median_ms / engine[r.kind].median_ms


def _fmt(value: float, spec: str) -> str:
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def markdown(rows: list[Row], meta: dict) -> str:
    lines = [
        f"{meta['shapes']}: {meta['numel'] / 1e6:.1f}M fp32 params in {meta['tensors']} tensors, "
        f"{meta['device']}, {meta['threads']} threads, torch {meta['torch']}; "
        f"{meta['steps']} timed steps after {meta['warmup']} warm-ups"
        + (", every row timed in the same round-robin rounds." if meta.get("interleave")
           else f", fastest of {meta['repeat']} runs per row." if meta["repeat"] > 1 else "."),
        "",
        "| step | ms/step (median) | p10 | p90 | × graphstep | × fused floor | bytes/param | GB/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r.error:
            lines.append(f"| {r.label} | failed: {r.error} | | | | | | |")
            continue
        lines.append(f"| {r.label} | {r.median_ms:.1f} | {r.p10_ms:.1f} | {r.p90_ms:.1f} | "
                     f"{_fmt(r.vs_graphstep, '.2f')} | {_fmt(r.vs_floor, '.2f')} | {r.bytes_per_elem} | "
                     f"{r.gbps:.1f} |")
    lines += ["", "× graphstep: time over graphstep's eager row of the same kind (no clip, or full step); "
              "× fused floor: over the one-buffer `_fused_adamw_`. GB/s: bytes/param × params / median time "
              "(28 = Adam's read p,g,m,v + write p,m,v; 32 = plus the norm's grad read; DESIGN.md §6)."]
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench_step", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", choices=sorted(shape_sets.SETS), default="gpt2-small",
                        help="parameter-shape set (perf/shapes.py); default gpt2-small")
    parser.add_argument("--quick", action="store_true", help="the small gpt2-quick set, 10 steps")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per row (default 20, quick 10)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before timing (default 3)")
    parser.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda, cuda:1 ...")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--only", default=None,
                        help="comma-separated row keys to run, of: " + ", ".join(PIPELINES))
    parser.add_argument("--repeat", type=int, default=1,
                        help="run every row this many times, round-robin, and keep each row's fastest run "
                             "(its lowest median): steadier on a shared, noisy machine (default 1)")
    parser.add_argument("--interleave", action="store_true",
                        help="build every row at once and time them round-robin, one step of each per round "
                             "(--steps rounds): the steadiest ratios on a shared machine; needs memory for "
                             "all rows at once (~2 GB each at GPT-2 small), so pick rows with --only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.quick:
        args.shapes = "gpt2-quick"
    if args.steps is None:
        args.steps = 10 if args.quick else 20
    if args.steps < 1 or args.warmup < 0 or args.repeat < 1:
        parser.error("--steps and --repeat must be >= 1, --warmup >= 0")
    if args.interleave and args.repeat > 1:
        parser.error("--interleave times every row in the same rounds: raise --steps instead of --repeat")
    keys = list(PIPELINES) if args.only is None else [k.strip() for k in args.only.split(",") if k.strip()]
    unknown = [k for k in keys if k not in PIPELINES]
    if unknown:
        parser.error(f"--only: unknown row(s) {', '.join(unknown)}; choose from {', '.join(PIPELINES)}")
    args.keys = keys
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    shapes = shape_sets.SETS[args.shapes]()
    inputs = Inputs(shapes, device, args.seed)
    meta = {"shapes": args.shapes, "numel": inputs.numel, "tensors": len(shapes),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or platform.machine()})",
            "threads": torch.get_num_threads(), "torch": torch.__version__, "steps": args.steps,
            "warmup": args.warmup, "repeat": args.repeat}
    meta["interleave"] = args.interleave
    best: dict[str, Row] = {}
    if args.interleave:
        print(f"running {', '.join(args.keys)} interleaved ...", file=sys.stderr, flush=True)
        best = {row.key: row for row in run_interleaved(args.keys, inputs, args.warmup, args.steps)}
    for repeat in range(0 if args.interleave else args.repeat):
        for key in args.keys:
            print(f"running {key} ({repeat + 1}/{args.repeat}) ...", file=sys.stderr, flush=True)
            row = run_pipeline(key, inputs, args.warmup, args.steps)
            kept = best.get(key)
            if kept is None or kept.error or (not row.error and row.median_ms < kept.median_ms):
                best[key] = row
    rows = [best[key] for key in args.keys]
    add_ratios(rows)
    print(markdown(rows, meta))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
