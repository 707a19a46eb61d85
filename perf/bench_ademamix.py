"""graphstep's captured AdEMAMix step against a plain torch for-loop of the paper's Algorithm 1, interleaved.

The model: an MLP of ``--layers`` Linear(width, width) layers with biases. Every row reads the same fixed
grads (set once through a backward, so graphstep's grad hooks see one) and runs the same update: lr 1e-3,
β = (0.9, 0.999, 0.9999), α 5, ε 1e-8, decoupled weight decay 0.1 on every param, no clipping.

Rows, timed round-robin (one step of each per round, so a busy machine's slow phases fall on all alike):

- ``graphstep``: the whole step captured (the CPU replay backend here, a CUDA graph on a GPU), every
  hyperparameter live (α and β3 may follow the paper's warm-ups without a recapture), the eager kernel
  (graphstep/kernels/ademamix.py: about twenty elementwise ops);
- ``graphstep_compiled``: the same, ``kernel="compiled"``: the compiled twin (graphstep/kernels/compiled_ademamix.py,
  one loop), and ``kernel_compiled``, that kernel alone over the same number of params, against ``floor``: its 36
  bytes per param (read param, grad and three states, write param and states) at this machine's streaming
  bandwidth (perf/bench_precision_kernel.py's ``floor_bandwidth``);
- ``graphstep_eager``: the eager-kernel step run eagerly, stage by stage;
- ``torch_loop``: the paper's equations per param tensor with Python floats, in the in-place op forms a
  user writing it for speed picks (the same rule as tests/test_ademamix.py's reference, which graphstep
  equals bitwise; these op forms round differently, so the run checks agreement to 1e-4 instead);
- ``adamw_fused``: torch.optim.AdamW(fused=True), for scale: Adam's update, one state fewer.

    python perf/bench_ademamix.py [--layers 4] [--width 512] [--rounds 5] [--warmup 2] [--threads N] [--json out.json]

The compiled rows agree with the eager ones to their square roots' last bits (see compiled_ademamix.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import graphstep as gs  # noqa: E402
from bench_muon import time_round_robin  # noqa: E402  (perf/ is this script's own folder on sys.path)
from bench_precision_kernel import floor_bandwidth  # noqa: E402
from graphstep.kernels import compiled_ademamix  # noqa: E402

LR, BETAS, BETA3, ALPHA, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 0.9999, 5.0, 1e-8, 0.1


def build_model(layers: int, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def set_fixed_grads(model: torch.nn.Module) -> None:
    # Through backward (d/dp of sum(p * g) = g), so graphstep's grad hooks see a backward.
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(p.shape, generator=gen) * 1e-2 for p in model.parameters()]
    sum((p * g).sum() for p, g in zip(model.parameters(), grads)).backward()


def graphstep_step(layers: int, width: int, capture: str, kernel: str = "auto"):
    model = build_model(layers, width)
    config = gs.OptimizerConfig(optimizer="ademamix", lr=LR, adam_beta1=BETAS[0], adam_beta2=BETAS[1],
                                adam_eps=EPS, ademamix_beta3=BETA3, ademamix_alpha=ALPHA, weight_decay=WEIGHT_DECAY,
                                clip_grad=0.0, capture=capture, capture_warmup_steps=1, kernel=kernel)
    opt = gs.get_optimizer(config, model, config_overrides={})  # no overrides: decay on every param, as below
    set_fixed_grads(model)
    return opt.step, opt, model


def torch_loop_step(layers: int, width: int):
    """The paper's Algorithm 1 per tensor (Python floats), the for-loop a user would write."""
    model = build_model(layers, width)
    set_fixed_grads(model)
    params = list(model.parameters())
    states = [[torch.zeros_like(p) for _ in range(3)] for p in params]
    count = [0]
    beta1, beta2 = BETAS

    @torch.no_grad()
    def step():
        count[0] += 1
        t = count[0]
        for p, (m1, m2, nu) in zip(params, states):
            g = p.grad
            m1.mul_(beta1).add_(g, alpha=1 - beta1)
            m2.mul_(BETA3).add_(g, alpha=1 - BETA3)
            nu.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = (nu / (1 - beta2**t)).sqrt_().add_(EPS)
            update = (m1 / (1 - beta1**t)).add_(m2, alpha=ALPHA).div_(denom).add_(p, alpha=WEIGHT_DECAY)
            p.add_(update, alpha=-LR)

    return step, model


def compiled_kernel_call(numel: int):
    """The compiled AdEMAMix alone over one flat view of ``numel`` params."""
    gen = torch.Generator().manual_seed(2)
    p, g, m1, m2, nu = (torch.randn(numel, generator=gen) * 1e-2 for _ in range(5))
    nu.abs_()
    hyper = {name: torch.tensor(value, dtype=torch.float64) for name, value in
             dict(lr=LR, beta1=BETAS[0], beta2=BETAS[1], beta3=BETA3, alpha=ALPHA, weight_decay=WEIGHT_DECAY,
                  eps=EPS).items()}
    step, found_inf = torch.ones(()), torch.zeros(())
    return lambda: compiled_ademamix.ademamix([p], [g], [m1], [m2], [nu], step=step, grad_scale=None,
                                              found_inf=found_inf, **hyper)


def adamw_fused_step(layers: int, width: int):
    model = build_model(layers, width)
    set_fixed_grads(model)
    return torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                             fused=True).step


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    captured, opt, model = graphstep_step(args.layers, args.width, "graph")
    compiled_step, compiled_opt, _ = graphstep_step(args.layers, args.width, "graph", kernel="compiled")
    eager, _, _ = graphstep_step(args.layers, args.width, "eager")
    loop, loop_model = torch_loop_step(args.layers, args.width)
    numel = sum(p.numel() for p in build_model(args.layers, args.width).parameters())
    steps = {"graphstep": captured, "graphstep_compiled": compiled_step,
             "kernel_compiled": compiled_kernel_call(numel), "graphstep_eager": eager, "torch_loop": loop,
             "adamw_fused": adamw_fused_step(args.layers, args.width)}
    times = time_round_robin(steps, args.warmup, args.rounds)
    assert opt.captured and opt.recaptures == 0 and compiled_opt.captured and compiled_opt.recaptures == 0
    floor_ms = 36 * numel / floor_bandwidth(max(numel, 1 << 24), args.rounds) * 1e3
    # Like with like: the same number of steps on the same grads lands on the same params.
    for a, b in zip(model.parameters(), loop_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    median = {key: statistics.median(values) for key, values in times.items()}
    result = {"layers": args.layers, "width": args.width, "params": numel, "rounds": args.rounds,
              "threads": torch.get_num_threads(), "backend": opt.capture_backend, "median_ms": median,
              "times_ms": times, "torch_loop_over_graphstep": median["torch_loop"] / median["graphstep"],
              "graphstep_over_adamw_fused": median["graphstep"] / median["adamw_fused"],
              "torch_loop_over_graphstep_compiled": median["torch_loop"] / median["graphstep_compiled"],
              "floor_ms": floor_ms, "kernel_compiled_over_floor": median["kernel_compiled"] / floor_ms}
    print(f"AdEMAMix step, MLP {args.layers} x Linear({args.width}, {args.width}) = {numel:,} params, "
          f"{args.rounds} interleaved rounds, {torch.get_num_threads()} threads")
    print(f"  graphstep (captured, {opt.capture_backend}): {median['graphstep']:8.2f} ms")
    print(f"  graphstep compiled (captured):    {median['graphstep_compiled']:8.2f} ms")
    print(f"  compiled kernel alone:            {median['kernel_compiled']:8.2f} ms  (floor, 36 B/param: "
          f"{floor_ms:.2f} ms; {result['kernel_compiled_over_floor']:.2f}x)")
    print(f"  graphstep (eager):                {median['graphstep_eager']:8.2f} ms")
    print(f"  torch for-loop (paper):           {median['torch_loop']:8.2f} ms")
    print(f"  torch AdamW(fused), for scale:    {median['adamw_fused']:8.2f} ms")
    print(f"  torch for-loop / graphstep compiled: {result['torch_loop_over_graphstep_compiled']:.2f}x")
    print(f"  torch for-loop / graphstep captured: {result['torch_loop_over_graphstep']:.2f}x; "
          f"graphstep captured / AdamW(fused): {result['graphstep_over_adamw_fused']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
