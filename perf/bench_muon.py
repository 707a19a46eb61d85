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

    python perf/bench_muon.py [--layers 12] [--d 256] [--rounds 5] [--warmup 2] [--threads N] [--heavyball]
                              [--json out.json]

Each step is timed twice: wall clock and the process's CPU time (``time.process_time``). With
``--threads 1`` the CPU time is what the step costs whatever else the machine runs (a shared machine
stretches the wall clock, not the CPU time); with more threads the CPU time also counts the threads'
waits, so the wall clock is the number to read. The load average is printed before and after.

``--heavyball``: two more rows, heavyball's ``Muon`` (the matrices) + ``AdamW`` (the rest), compiled as
heavyball compiles them (its default mode), and graphstep with heavyball's Newton–Schulz settings ("quintic"
coefficients, 5 steps, bf16 matmuls, √max(1, rows/cols)); heavyball's first step (its compile) is reported
apart. heavyball consumes the grads (sets ``.grad`` to None, writes into them), so its grads are put back
before each of its steps, outside the timed region.

``--layerwise-ranks 2 4`` adds the layer-wise rows (``layerwise_rows`` at the end of this
file): the same model and grads with ``use_distributed_optimizer=True`` on that many gloo ranks on
127.0.0.1 (one thread each), the step captured. Each rank owns whole Muon matrices (graphstep.plan.layerwise)
and runs Newton–Schulz on those only; the rows give the median step time, the bytes each rank sends per
step (ring formulas: reduce-scatter + all-gather = (n−1)/n × bucket bytes each; DDP's fp32 all-reduce,
2(n−1)/n × 4 B × params, alongside), the layer-wise buckets' padding, and the most-loaded rank's
Newton–Schulz cost over the mean, also for GPT-2 small's shapes (layout only, nothing allocated).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import graphstep as gs  # noqa: E402
from graphstep.app.demo_dist import free_port  # noqa: E402

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


def graphstep_step(layers: int, d: int, grads: list[torch.Tensor], capture: str = "graph",
                   coefficient_type: str = "simple"):
    model = build_model(layers, d)
    config = gs.OptimizerConfig(optimizer="muon", lr=LR, weight_decay=WEIGHT_DECAY, clip_grad=0.0, capture=capture,
                                capture_warmup_steps=1, muon_momentum=MOMENTUM, muon_nesterov=True,
                                muon_coefficient_type=coefficient_type, muon_scale_mode="shape_scaling",
                                muon_fp32_matmul_prec="medium")
    opt = gs.get_optimizer(config, model, config_overrides={})
    set_grads(model, grads)
    muon = sum(len(g["params"]) for g in opt.param_groups if g["optimizer"] == "muon")
    return opt.step, opt, muon


def torch_step(layers: int, d: int, grads: list[torch.Tensor]):
    model = build_model(layers, d)
    set_grads(model, grads)
    matrices, rest = split_model(model)
    muon = torch.optim.Muon(matrices, lr=LR, weight_decay=WEIGHT_DECAY, momentum=MOMENTUM, nesterov=True,
                            ns_steps=5)
    adamw = torch.optim.AdamW(rest, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)

    def step():
        muon.step()
        adamw.step()

    return step, len(matrices)


def split_model(model: torch.nn.Module) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """The params Muon takes (2-D hidden matrices) and the rest, as graphstep routes them."""
    matrices = [p for p in model.parameters()
                if p.ndim == 2 and not getattr(p, "is_embedding_or_output_parameter", False)]
    ids = {id(p) for p in matrices}
    return matrices, [p for p in model.parameters() if id(p) not in ids]


def heavyball_step(layers: int, d: int, grads: list[torch.Tensor]):
    """heavyball's Muon on the matrices and its AdamW on the rest: (step, put_back_grads, matrices, version).

    heavyball's Muon runs Newton–Schulz with the "quintic" coefficients, 5 steps, on a bf16 copy (stochastic
    rounding), scaled by √max(1, rows/cols); its Nesterov form is ``g + ema``. The cost per matrix is the same
    three matmuls per step as graphstep's and torch's; the numbers differ, the work does not."""
    import heavyball

    model = build_model(layers, d)
    params = list(model.parameters())
    matrices, rest = split_model(model)
    muon = heavyball.Muon(matrices, lr=LR, betas=(MOMENTUM, 0.99), weight_decay=WEIGHT_DECAY, nesterov=True)
    adamw = heavyball.AdamW(rest, lr=LR, weight_decay=WEIGHT_DECAY)

    def put_back_grads():
        for p, g in zip(params, grads):
            p.grad = g.clone()

    def step():
        muon.step()
        adamw.step()

    put_back_grads()
    return step, put_back_grads, len(matrices), importlib.metadata.version("heavyball")


def time_interleaved(steps: dict, warmup: int, rounds: int, prepare: dict | None = None) -> dict[str, dict]:
    """Round-robin timing (one step of each per round) of wall clock and process CPU time, in ms.

    ``prepare[key]`` (optional) runs before each step of ``key``, outside the timed region."""
    prepare = prepare or {}
    for key, step in steps.items():
        for _ in range(warmup):
            prepare.get(key, lambda: None)()
            step()
    times: dict[str, dict] = {key: {"wall": [], "cpu": []} for key in steps}
    for _ in range(rounds):
        for key, step in steps.items():
            prepare.get(key, lambda: None)()
            cpu, wall = time.process_time(), time.perf_counter()
            step()
            times[key]["wall"].append((time.perf_counter() - wall) * 1e3)
            times[key]["cpu"].append((time.process_time() - cpu) * 1e3)
    return times


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


LABELS = {
    "graphstep": "graphstep, captured ({backend}), torch's NS settings",
    "graphstep_eager": "graphstep, eager, same batched math",
    "torch": "torch.optim.Muon + AdamW(fused)",
    "graphstep_quintic": "graphstep, captured, heavyball's NS settings",
    "heavyball": "heavyball {version} Muon + AdamW (compiled)",
}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    parser.add_argument("--heavyball", action="store_true",
                        help="add heavyball's Muon + AdamW and graphstep with its settings (compiles for minutes)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--layerwise-ranks", type=int, nargs="*", default=[],
                        help="also run layer-wise Muon on these gloo world sizes (e.g. 2 4)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()

    grads = fixed_grads(build_model(args.layers, args.d))
    gs_step, opt, gs_matrices = graphstep_step(args.layers, args.d, grads)
    eager_step, _, _ = graphstep_step(args.layers, args.d, grads, capture="eager")
    th_step, th_matrices = torch_step(args.layers, args.d, grads)
    assert gs_matrices == th_matrices, (gs_matrices, th_matrices)
    steps = {"graphstep": gs_step, "graphstep_eager": eager_step, "torch": th_step}
    prepare, extra = {}, {}
    if args.heavyball:
        steps["graphstep_quintic"], _, _ = graphstep_step(args.layers, args.d, grads, coefficient_type="quintic")
        hb_step, hb_prepare, hb_matrices, version = heavyball_step(args.layers, args.d, grads)
        assert hb_matrices == gs_matrices, (hb_matrices, gs_matrices)
        start = time.perf_counter()
        hb_step()  # compiles
        extra["heavyball"] = {"version": version, "first_step_s": time.perf_counter() - start}
        steps["heavyball"], prepare["heavyball"] = hb_step, hb_prepare
    times = time_interleaved(steps, args.warmup, args.rounds, prepare)
    assert opt.captured and opt.recaptures == 0
    load_after = os.getloadavg()
    median = {key: statistics.median(value["wall"]) for key, value in times.items()}
    median_cpu = {key: statistics.median(value["cpu"]) for key, value in times.items()}
    result = {"layers": args.layers, "d": args.d, "muon_matrices": gs_matrices, "rounds": args.rounds,
              "threads": torch.get_num_threads(), "backend": opt.capture_backend, "median_ms": median,
              "median_cpu_ms": median_cpu, "times_ms": times, "speedup": median["torch"] / median["graphstep"],
              "speedup_cpu": median_cpu["torch"] / median_cpu["graphstep"], "loadavg_before": load_before,
              "loadavg_after": load_after, **extra}
    if args.heavyball:
        result["speedup_vs_heavyball"] = median["heavyball"] / median["graphstep_quintic"]
        result["speedup_vs_heavyball_cpu"] = median_cpu["heavyball"] / median_cpu["graphstep_quintic"]
    print(f"Muon step, {gs_matrices} matrices of {args.d}x{args.d} (+ AdamW for the rest), {args.rounds} "
          f"interleaved rounds, {torch.get_num_threads()} threads, load average {load_before[0]:.1f} before, "
          f"{load_after[0]:.1f} after")
    print("| step | median wall ms | median CPU ms |")
    print("|---|---:|---:|")
    for key in steps:
        label = LABELS[key].format(backend=opt.capture_backend, version=extra.get("heavyball", {}).get("version"))
        print(f"| {label} | {median[key]:.1f} | {median_cpu[key]:.1f} |")
    print(f"graphstep speedup over torch: {result['speedup']:.2f}x wall, {result['speedup_cpu']:.2f}x CPU time")
    if args.heavyball:
        print(f"graphstep (heavyball's settings) speedup over heavyball: {result['speedup_vs_heavyball']:.2f}x wall, "
              f"{result['speedup_vs_heavyball_cpu']:.2f}x CPU time; heavyball's first step (compile) "
              f"{extra['heavyball']['first_step_s']:.1f} s")
    if args.layerwise_ranks:
        result["layerwise"] = layerwise_rows(args.layerwise_ranks, args.layers, args.d, args.rounds, args.warmup)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


# ---- layer-wise Muon over gloo ranks ---------------------------------------------------

def _layerwise_worker(rank: int, world: int, port: int, outdir: str, layers: int, d: int, rounds: int,
                      warmup: int) -> None:
    import torch.distributed as dist

    from graphstep.plan import layerwise

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    model = build_model(layers, d)
    config = gs.OptimizerConfig(optimizer="muon", lr=LR, weight_decay=WEIGHT_DECAY, clip_grad=0.0, capture="graph",
                                capture_warmup_steps=1, muon_momentum=MOMENTUM, muon_nesterov=True,
                                muon_coefficient_type="simple", muon_scale_mode="shape_scaling",
                                muon_fp32_matmul_prec="medium", use_distributed_optimizer=True,
                                distributed_timeout_s=120.0)
    opt = gs.get_optimizer(config, model, config_overrides={})
    set_grads(model, fixed_grads(model))
    times = []
    for i in range(warmup + rounds):
        dist.barrier()
        start = time.perf_counter()
        opt.step()
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    sent = 0.0
    for bucket in opt.layout.buckets:
        size = (opt.buffers.grad_flat[bucket.buffer].element_size()
                + opt.buffers.param_flat[bucket.buffer].element_size())
        sent += (world - 1) / world * bucket.numel * size  # reduce-scatter + all-gather, ring
    balance = layerwise.balance(opt.layout)
    params = sum(p.numel() for p in model.parameters())
    row = {"ranks": world, "step_ms": statistics.median(times), "captured": opt.captured,
           "sent_mb": sent / 1e6, "ddp_allreduce_mb": 2 * (world - 1) / world * params * 4 / 1e6,
           "padding": balance.padding_fraction, "ns_max_over_mean": balance.max_over_mean,
           "ns_loads": balance.loads}
    if rank == 0:
        with open(os.path.join(outdir, "row.pkl"), "wb") as f:
            pickle.dump(row, f)
    dist.barrier()
    dist.destroy_process_group()


def gpt2_small_balance(world: int):
    """GPT-2 small's layer-wise balance at ``world`` ranks: Muon on the hidden matrices, Adam elsewhere."""
    from graphstep.app.bench_shapes import gpt2_small
    from graphstep.plan import layerwise
    from graphstep.plan.layout import ParamSpec, plan_layout

    specs = [ParamSpec(name, shape, torch.float32, torch.float32, int(muon), muon)
             for name, shape in gpt2_small() for muon in [len(shape) == 2 and name not in ("wte", "wpe")]]
    return layerwise.balance(plan_layout(specs, world))


def layerwise_rows(worlds, layers: int, d: int, rounds: int, warmup: int) -> list[dict]:
    """One row per world size: captured layer-wise Muon step on gloo ranks (see the module docstring)."""
    import torch.multiprocessing as mp

    rows = []
    print(f"\nLayer-wise Muon (distributed optimizer, captured), {layers * 4} matrices of {d}x{d}, gloo, "
          "1 thread/rank")
    print("| ranks | step ms | comm MB/step/rank | DDP all-reduce MB | padding | NS max/mean "
          "| GPT-2 small NS max/mean, padding |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    for world in worlds:
        port = free_port()
        with tempfile.TemporaryDirectory() as outdir:
            mp.start_processes(_layerwise_worker, args=(world, port, outdir, layers, d, rounds, warmup), nprocs=world,
                               start_method="spawn")
            with open(os.path.join(outdir, "row.pkl"), "rb") as f:
                row = pickle.load(f)
        gpt2 = gpt2_small_balance(world)
        row["gpt2_small"] = {"ns_max_over_mean": gpt2.max_over_mean, "padding": gpt2.padding_fraction}
        rows.append(row)
        print(f"| {world} | {row['step_ms']:.1f} | {row['sent_mb']:.2f} | {row['ddp_allreduce_mb']:.2f} | "
              f"{100 * row['padding']:.2f}% | {row['ns_max_over_mean']:.3f} | "
              f"{gpt2.max_over_mean:.3f}, {100 * gpt2.padding_fraction:.2f}% |")
    return rows


if __name__ == "__main__":
    main()
