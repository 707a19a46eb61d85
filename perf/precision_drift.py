"""What storing Adam's moments below fp32 costs in accuracy: the demo's tiny GPT trained 200 steps with each
``exp_avg_dtype`` / ``exp_avg_sq_dtype`` against the same run with fp32 moments.

Reported per setting: the final training loss (mean of the last 20 steps) and the params' drift from the fp32
run relative to how far the fp32 run moved them (DESIGN §8: ``|p - p_fp32| / |p_fp32 - p_0|``, whole model).
One rank, eager steps, fp32 params, Adam lr 1e-3 with clip 1.0 (the demo's defaults).

    python perf/precision_drift.py [--steps 200] [--json perf/results/precision_drift.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import graphstep as gs  # noqa: E402
from graphstep.app import models  # noqa: E402

SETTINGS = {
    "fp32": {},
    "bf16": dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16),
    "fp16": dict(exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16),
    "fp8": dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8),
    "bf16 exp_avg, fp32 exp_avg_sq": dict(exp_avg_dtype=torch.bfloat16),
}


def train(moments: dict, steps: int) -> tuple[list[float], torch.Tensor, torch.Tensor]:
    config = models.tiny()
    model = models.GPT(config, seed=0)
    start = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    opt = gs.get_optimizer(gs.OptimizerConfig(lr=1e-3, clip_grad=1.0, capture="eager", kernel="fused",
                                              use_precision_aware_optimizer=bool(moments), **moments), model)
    corpus = models.SyntheticCorpus(config.vocab_size, seed=0)
    losses = []
    for step in range(steps):
        inputs, targets = corpus.batch(step, 16, config.seq_len)
        opt.zero_grad()
        loss = model(inputs, targets)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    end = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return losses, start, end


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    results = {}
    base_losses, start, base_end = train({}, args.steps)
    motion = float((base_end - start).norm())
    for name, moments in SETTINGS.items():
        losses, _, end = (base_losses, start, base_end) if not moments else train(moments, args.steps)
        results[name] = {"final_loss": sum(losses[-20:]) / 20, "drift": float((end - base_end).norm()) / motion}
        print(f"| {name} | {results[name]['final_loss']:.4f} | {results[name]['drift']:.2e} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"steps": args.steps, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
