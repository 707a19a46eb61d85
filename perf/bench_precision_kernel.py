"""Adam over state stored below fp32: the compiled kernel (graphstep/kernels/compiled_stored.py) against its byte
floor, the eager fp32-window chain it replaces, and the fp32 step, interleaved.

Each setting runs one Linear(width, width) (plus bias: odd pieces, padding) through Adam with the setting's
stored kinds. Rows, timed round-robin with medians:

- ``kernel``: the compiled stored-state kernel alone (the call the update stage makes), and for ``fp32`` the
  compiled Adam on fp32 (graphstep/kernels/compiled.py);
- ``step``: the whole graphstep step, captured (the CPU replay backend here), ``kernel="compiled"``;
- ``step_eager_windows``: the same step with the kernel's group sent through the eager fp32 windows (today's
  chain: decode each chunk into fp32 scratch, the compiled Adam, encode back);
- ``floor``: this machine's streaming bandwidth, the best of a copy (8 B per element) and an add into a third
  buffer (12 B), over buffers far larger than the caches.

Bytes per param: ``one_pass`` is what the step must read and write once (param or its halves, grad, moments,
then param and moments); ``two_pass`` adds what the scale's reduction forces a second read of (grad and
moments, and the param for fp16 main params or coupled weight decay), where a kind is scaled: the new amax must
be known before the first value is encoded, and recomputing is cheaper than storing fp32 values in between.
``kernel / floor`` is the kernel's time over ``one_pass`` bytes at the floor bandwidth.

    python perf/bench_precision_kernel.py [--width 2048] [--rounds 7] [--warmup 2] [--threads N] [--json out.json]
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
from graphstep.kernels import compiled  # noqa: E402
from graphstep.step.stages import stored_kernel  # noqa: E402
from bench_muon import time_round_robin  # noqa: E402  (perf/ is this script's own folder on sys.path)

# setting -> (config fields, bf16 params, one-pass bytes per param, two-pass bytes per param); grads are fp32
# (bf16 params accumulate into fp32 main grads).
SETTINGS = {
    "fp32": (dict(use_precision_aware_optimizer=False), False, 28, 28),
    "bf16-moments": (dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16), False, 20, 20),
    "fp16-moments": (dict(exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16), False, 20, 28),
    "fp8-moments": (dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8), False, 16, 22),
    "remainders+bf16-moments": (dict(bf16=True, store_param_remainders=True, exp_avg_dtype=torch.bfloat16,
                                     exp_avg_sq_dtype=torch.bfloat16), True, 20, 20),
    "remainders+fp8-moments": (dict(bf16=True, store_param_remainders=True, exp_avg_dtype=torch.uint8,
                                    exp_avg_sq_dtype=torch.uint8), True, 16, 22),
}


def build(setting: str, width: int, capture: str, windows: bool):
    """(model, optimizer, the stored-state kernels the update built or None) for ``setting``."""
    fields, bf16, _, _ = SETTINGS[setting]
    torch.manual_seed(0)
    model = torch.nn.Linear(width, width)
    model = model.to(torch.bfloat16) if bf16 else model
    built = []
    original = stored_kernel.build

    def recording(*args, **kwargs):
        built.append(None if windows else original(*args, **kwargs))
        return built[-1]

    stored_kernel.build = recording
    try:
        config = dict(lr=1e-3, weight_decay=0.01, clip_grad=0.0, kernel="compiled", capture=capture,
                      capture_warmup_steps=1, use_precision_aware_optimizer=True)
        opt = gs.get_optimizer(gs.OptimizerConfig(**{**config, **fields}), model)
    finally:
        stored_kernel.build = original
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(p.shape, generator=gen) * 1e-2 for p in model.parameters()]
    sum((p * g.to(p.dtype)).sum() for p, g in zip(model.parameters(), grads)).backward()
    return model, opt, next((b for b in built if b is not None), None)


def kernel_call(setting: str, width: int):
    """The update kernel alone, over the step's own buffers (fp32: the compiled Adam over flat fp32 tensors)."""
    hyper = {name: torch.tensor(value, dtype=torch.float64)
             for name, value in dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8).items()}
    step, found_inf = torch.ones(()), torch.zeros(())
    if setting == "fp32":
        n = width * width + width
        p, g, m, v = (torch.randn(n) * 1e-2 for _ in range(4))
        v.abs_()
        return lambda: compiled.adam([p], [g], [m], [v], step=step, decoupled=True, grad_scale=None,
                                     found_inf=found_inf, **hyper)
    _, _, kernels = build(setting, width, "eager", windows=False)
    return lambda: kernels.adam_groups([(None, None, None, None, hyper)], step=step, decoupled=True, grad_scale=None,
                                       found_inf=found_inf)


def floor_bandwidth(numel: int, rounds: int) -> float:
    """Bytes per second of this machine's best streaming pass: a copy, or an add into a third buffer."""
    a, b, c = torch.randn(numel), torch.randn(numel), torch.empty(numel)
    times = time_round_robin({"copy": lambda: c.copy_(a), "add": lambda: torch.add(a, b, out=c)}, 2, rounds)
    return max(8 * numel / (statistics.median(times["copy"]) / 1e3),
               12 * numel / (statistics.median(times["add"]) / 1e3))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--settings", nargs="*", default=list(SETTINGS))
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    numel = args.width * args.width + args.width
    bandwidth = floor_bandwidth(4 * numel, args.rounds)
    rows = {}
    for setting in args.settings:
        _, opt, _ = build(setting, args.width, "graph", windows=False)
        steps = {"kernel": kernel_call(setting, args.width), "step": opt.step}
        if setting != "fp32":
            steps["step_eager_windows"] = build(setting, args.width, "graph", windows=True)[1].step
        times = {key: statistics.median(values) for key, values in
                 time_round_robin(steps, args.warmup, args.rounds).items()}
        _, _, one_pass, two_pass = SETTINGS[setting]
        floor_ms = one_pass * numel / bandwidth * 1e3
        rows[setting] = {"median_ms": times, "one_pass_bytes": one_pass, "two_pass_bytes": two_pass,
                         "floor_ms": floor_ms, "kernel_over_floor": times["kernel"] / floor_ms,
                         "kernel_ns_per_param": times["kernel"] * 1e6 / numel}
    fp32 = rows.get("fp32")
    print(f"Adam over stored state, {numel:,} params (Linear({args.width}, {args.width})), {args.rounds} interleaved "
          f"rounds, {torch.get_num_threads()} threads; floor bandwidth {bandwidth / 1e9:.1f} GB/s")
    print(f"{'setting':26} {'B/param':>9} {'kernel ms':>10} {'floor ms':>9} {'/floor':>7} {'step ms':>8} "
          f"{'eager-windows ms':>17} {'vs fp32 kernel':>15}")
    for setting, row in rows.items():
        t = row["median_ms"]
        windows = f"{t['step_eager_windows']:17.2f}" if "step_eager_windows" in t else f"{'-':>17}"
        versus = f"{t['kernel'] / fp32['median_ms']['kernel']:15.2f}" if fp32 else f"{'-':>15}"
        print(f"{setting:26} {row['one_pass_bytes']:>4}/{row['two_pass_bytes']:<4} {t['kernel']:10.2f} "
              f"{row['floor_ms']:9.2f} {row['kernel_over_floor']:7.2f} {t['step']:8.2f} {windows} {versus}")
    result = {"params": numel, "threads": torch.get_num_threads(), "floor_gb_s": bandwidth / 1e9, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
