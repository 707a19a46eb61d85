"""The full optimizer step with fp8 weights (requantized inside the step) against the same model with bf16
weights, side by side, interleaved.

Both runs: a GPT-style stack of ``--layers`` blocks (fused QKV d×3d, attention output d×d, MLP d×4d and
4d×d Linear weights, their biases, two LayerNorms) plus token/position embeddings and an output head;
Adam over fp32 main params, bf16 grads (``main_grads_dtype=bfloat16``), global-norm clip 1.0, the step
captured (``capture="graph"``: the CPU replay backend here, a CUDA graph on a GPU). The fp8 run converts
the hidden Linear weights with ``graphstep.fp8.convert`` (``--recipe tensorwise`` by default, e4m3):
its step adds the requantize stage (amax of the new main values, the scale, the saturating cast into the
fp8 bytes) where the bf16 run copies the main params back into bf16 params. Embeddings, head, biases and
LayerNorms are bf16 in both.

The grads are fixed random values written into the grad buffers before every step (untimed: the fused
update rewrites them); both steps are timed round-robin, one of each per round
(``graphstep.app.bench_core.time_interleaved``), so a shared machine's slow phases fall on both alike.
Prints each run's median ms/step and the ratio fp8 / bf16.

    python perf/bench_fp8.py [--layers 4] [--d 512] [--vocab 8192] [--rounds 15] [--recipe tensorwise]
    python perf/bench_fp8.py --gpt2-small        # 12 layers, d 768, vocab 50257 (124M params)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's graphstep
import graphstep as gs  # noqa: E402
from graphstep.app.bench_core import time_interleaved  # noqa: E402

GRAD_STD = 1e-3


class Block(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.attn_proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc, self.mlp_proj = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)


def build_model(layers: int, d: int, vocab: int, context: int, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Module()
    model.wte, model.wpe = torch.nn.Embedding(vocab, d), torch.nn.Embedding(context, d)
    model.blocks = torch.nn.ModuleList(Block(d) for _ in range(layers))
    model.ln_f, model.head = torch.nn.LayerNorm(d), torch.nn.Linear(d, vocab, bias=False)
    for p in (model.wte.weight, model.wpe.weight, model.head.weight):
        p.is_embedding_or_output_parameter = True  # convert's default filter leaves these bf16
    return model


def build_step(args, fp8: bool):
    """(step, refill, opt): one optimizer over a fresh model, with or without fp8 weights."""
    model = build_model(args.layers, args.d, args.vocab, args.context)
    extra = {}
    if fp8:
        history = {"amax_history_len": 16, "amax_compute_algo": "max"} if args.recipe == "delayed" else {}
        gs.fp8.convert(model, recipe=args.recipe, **history)
        extra = {"fp8_recipe": args.recipe, **{f"fp8_{k}": v for k, v in history.items()}}
    config = gs.OptimizerConfig(lr=1e-4, weight_decay=0.1, bf16=True, main_grads_dtype=torch.bfloat16,
                                clip_grad=1.0, capture=args.capture, capture_warmup_steps=1, **extra)
    opt = gs.get_optimizer(config, model)
    generator = torch.Generator().manual_seed(1)
    sources = [torch.randn(g.shape, generator=generator).mul_(GRAD_STD).to(g.dtype) for g in opt.buffers.grad_flat]

    def refill() -> None:
        for target, source in zip(opt.buffers.grad_flat, sources):
            target.copy_(source)

    return opt.step, refill, opt


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--gpt2-small", action="store_true", help="GPT-2 small's shapes (12 x 768, vocab 50257)")
    parser.add_argument("--recipe", choices=("tensorwise", "delayed"), default="tensorwise")
    parser.add_argument("--capture", choices=("graph", "eager"), default="graph")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.gpt2_small:
        args.layers, args.d, args.vocab, args.context = 12, 768, 50257, 1024
    warnings.filterwarnings("ignore", message=r"graphstep: step\(\) ran before any backward")

    bf16_step, bf16_refill, bf16_opt = build_step(args, fp8=False)
    fp8_step, fp8_refill, fp8_opt = build_step(args, fp8=True)
    device = bf16_opt.buffers.grad_flat[0].device
    times = time_interleaved({"bf16": bf16_step, "fp8": fp8_step}, device, args.warmup, args.rounds,
                             before={"bf16": bf16_refill, "fp8": fp8_refill})
    numel = sum(p.numel() for p in bf16_opt.buffers.params)
    fp8_numel = sum(p.numel() for p in fp8_opt.buffers.params if gs.fp8.is_fp8(p))
    median = {key: statistics.median(values) for key, values in times.items()}
    result = {"layers": args.layers, "d": args.d, "vocab": args.vocab, "params": numel, "fp8_params": fp8_numel,
              "recipe": args.recipe, "capture": args.capture, "backend": fp8_opt.capture_backend,
              "threads": torch.get_num_threads(), "rounds": args.rounds, "median_ms": median, "times_ms": times,
              "ratio_fp8_over_bf16": median["fp8"] / median["bf16"]}
    print(f"full step (Adam, fp32 main params, bf16 grads, clip 1.0, capture={args.capture} -> "
          f"{fp8_opt.capture_backend}): {numel / 1e6:.1f}M params, {fp8_numel / 1e6:.1f}M of them fp8 "
          f"({args.recipe}); {args.rounds} interleaved rounds, {torch.get_num_threads()} threads")
    print(f"  bf16 weights: {median['bf16']:8.1f} ms/step (median)")
    print(f"  fp8 weights:  {median['fp8']:8.1f} ms/step (median)")
    print(f"  ratio fp8 / bf16: {result['ratio_fp8_over_bf16']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    bf16_opt.close()
    fp8_opt.close()
    return result


if __name__ == "__main__":
    main()
