"""graphstep's captured Muon step against torch.optim.Muon (+ fused AdamW for the rest), interleaved.

The model: ``--layers`` attention-style blocks of four d×d matrices (Q, K, V, O; 12 × 4 = 48 at the
default d = 256) and two LayerNorms each, plus an embedding and an output head. The 2-D hidden matrices
go to Muon, the rest (LayerNorm vectors, embedding, head) to AdamW, in both runs.

Matched settings: Newton–Schulz with the "simple" coefficients, 5 steps, bf16 matmuls (graphstep's
``muon_fp32_matmul_prec="medium"``; torch.optim.Muon always casts to bf16), Nesterov momentum 0.95, the
update scaled by √max(1, rows/cols) (torch's default ``adjust_lr_fn``, graphstep's "shape_scaling"),
decoupled weight decay 0.1, no clipping. The two still round differently (torch casts to bf16 *before*
normalising, EO after), which costs nothing either way.

graphstep runs the whole step captured (the CPU replay backend here, a CUDA graph on a GPU), its
hyperparameters live, Newton–Schulz batched over each shape; torch loops over the matrices. A third row
runs graphstep's step eagerly (same batched math, no capture) to separate the two effects. All read
the same fixed grads; the rows are timed round-robin (one step of each per round), so a busy machine's
slow phases fall on both alike.

    python perf/bench_muon.py [--layers 12] [--d 256] [--rounds 5] [--warmup 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import graphstep as gs  # noqa: E402

LR, WEIGHT_DECAY, MOMENTUM, VOCAB = 0.02, 0.1, 0.95, 512


def build_model(layers: int, d: int, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.LayerNorm(d), *[torch.nn.Linear(d, d, bias=False) for _ in range(4)],
                   torch.nn.LayerNorm(d)]
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, d), *blocks, torch.nn.Linear(d, VOCAB, bias=False))
    model[0].weight.is_embedding_or_output_parameter = True
    model[-1].weight.is_embedding_or_output_parameter = True
    return model


def fixed_grads(model: torch.nn.Module, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=gen) * 1e-2 for p in model.parameters()]


def set_grads(model: torch.nn.Module, grads: list[torch.Tensor]) -> None:
    # Through backward, so graphstep's grad hooks see a backward (grad = d/dp of sum(p * g) = g exactly).
    sum((p * g).sum() for p, g in zip(model.parameters(), grads)).backward()


def graphstep_step(layers: int, d: int, grads: list[torch.Tensor], capture: str = "graph"):
    model = build_model(layers, d)
    config = gs.OptimizerConfig(optimizer="muon", lr=LR, weight_decay=WEIGHT_DECAY, clip_grad=0.0, capture=capture,
                                capture_warmup_steps=1, muon_momentum=MOMENTUM, muon_nesterov=True,
                                muon_coefficient_type="simple", muon_scale_mode="shape_scaling",
                                muon_fp32_matmul_prec="medium")
    opt = gs.get_optimizer(config, model, config_overrides={})
    set_grads(model, grads)
    muon = sum(len(g["params"]) for g in opt.param_groups if g["optimizer"] == "muon")
    return opt.step, opt, muon


def torch_step(layers: int, d: int, grads: list[torch.Tensor]):
    model = build_model(layers, d)
    set_grads(model, grads)
    matrices = [p for p in model.parameters()
                if p.ndim == 2 and not getattr(p, "is_embedding_or_output_parameter", False)]
    ids = {id(p) for p in matrices}
    rest = [p for p in model.parameters() if id(p) not in ids]
    muon = torch.optim.Muon(matrices, lr=LR, weight_decay=WEIGHT_DECAY, momentum=MOMENTUM, nesterov=True,
                            ns_steps=5)
    adamw = torch.optim.AdamW(rest, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)

    def step():
        muon.step()
        adamw.step()

    return step, len(matrices)


def time_round_robin(steps: dict, warmup: int, rounds: int) -> dict[str, list[float]]:
    for step in steps.values():
        for _ in range(warmup):
            step()
    times: dict[str, list[float]] = {key: [] for key in steps}
    for _ in range(rounds):
        for key, step in steps.items():
            start = time.perf_counter()
            step()
            times[key].append((time.perf_counter() - start) * 1e3)
    return times


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    grads = fixed_grads(build_model(args.layers, args.d))
    gs_step, opt, gs_matrices = graphstep_step(args.layers, args.d, grads)
    eager_step, _, _ = graphstep_step(args.layers, args.d, grads, capture="eager")
    th_step, th_matrices = torch_step(args.layers, args.d, grads)
    assert gs_matrices == th_matrices, (gs_matrices, th_matrices)
    times = time_round_robin({"graphstep": gs_step, "graphstep_eager": eager_step, "torch": th_step}, args.warmup,
                             args.rounds)
    assert opt.captured and opt.recaptures == 0
    median = {key: statistics.median(values) for key, values in times.items()}
    result = {"layers": args.layers, "d": args.d, "muon_matrices": gs_matrices, "rounds": args.rounds,
              "threads": torch.get_num_threads(), "backend": opt.capture_backend, "median_ms": median,
              "times_ms": times, "speedup": median["torch"] / median["graphstep"]}
    print(f"Muon step, {gs_matrices} matrices of {args.d}x{args.d} (+ AdamW for the rest), "
          f"{args.rounds} interleaved rounds, {torch.get_num_threads()} threads")
    print(f"  graphstep (captured, {opt.capture_backend}): {median['graphstep']:8.1f} ms")
    print(f"  graphstep (eager, same batched math): {median['graphstep_eager']:8.1f} ms")
    print(f"  torch.optim.Muon + AdamW(fused):      {median['torch']:8.1f} ms")
    print(f"  graphstep speedup: {result['speedup']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
