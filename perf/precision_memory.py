"""Bytes per param of Adam's optimizer state (main params, ``exp_avg``, ``exp_avg_sq``) for each precision-aware
setting, measured with ``opt.memory_stats()`` (storages counted once, scales and piece bounds included), and the
fp32 scratch the update reads stored kinds through.

Four bias-free 1024 x 1024 Linear layers in bf16, one rank; prints the README's table rows.

    python perf/precision_memory.py [--layers 4] [--d 1024]
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import graphstep as gs  # noqa: E402

AWARE = dict(use_precision_aware_optimizer=True)
ROWS = {
    "fp32 moments, fp32 main params (default)": {},
    "bf16 moments": dict(AWARE, store_param_remainders=False, exp_avg_dtype=torch.bfloat16,
                         exp_avg_sq_dtype=torch.bfloat16),
    "fp16 moments": dict(AWARE, store_param_remainders=False, exp_avg_dtype=torch.float16,
                         exp_avg_sq_dtype=torch.float16),
    "fp8 moments": dict(AWARE, store_param_remainders=False, exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8),
    "remainders (Megatron-Core's default with the flag)": dict(AWARE),
    "remainders, bf16 moments": dict(AWARE, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16),
    "remainders, fp8 moments": dict(AWARE, exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8),
    "fp16 main params, bf16 moments": dict(AWARE, main_params_dtype=torch.float16, exp_avg_dtype=torch.bfloat16,
                                           exp_avg_sq_dtype=torch.bfloat16),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d", type=int, default=1024)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    print("| setting | main params | `exp_avg` | `exp_avg_sq` | optimizer state | fp32 scratch |")
    print("|---|---|---|---|---|---|")
    for name, fields in ROWS.items():
        model = torch.nn.Sequential(*[torch.nn.Linear(args.d, args.d, bias=False) for _ in range(args.layers)])
        model.to(torch.bfloat16)
        numel = sum(p.numel() for p in model.parameters())
        opt = gs.get_optimizer(gs.OptimizerConfig(bf16=True, capture="eager", **fields), model)
        device = opt.memory_stats()["device"]
        kinds = [device["main_params"] / numel, device["exp_avg"] / numel, device["exp_avg_sq"] / numel]
        print(f"| {name} | " + " | ".join(f"{b:.2f}" for b in kinds) +
              f" | {sum(kinds):.2f} | {device.get('state_fp32', 0) / 2**20:.0f} MiB |")


if __name__ == "__main__":
    main()
