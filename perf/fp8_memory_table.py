"""Bytes per param that the optimizer allocates for fp32 / bf16 / fp8 weights, measured, not computed.

Builds the engine (Adam, one rank) over the same model at each precision and sums the storages of its
static buffers by kind: the model params (``param_flat``), the grads (``grad_flat``: ``.grad`` or, for
half and fp8 weights, the ``main_grad`` backward accumulates into), the fp32 main params (``main_shard``;
counted only where it is not the param buffer itself, as with fp32 params on one rank) and the Adam state
(``exp_avg``, ``exp_avg_sq``), plus the fp8 scales (``scale``, ``scale_inv``, amax history). Every storage
is counted once (``untyped_storage().nbytes()``, keyed by its address) and divided by the param count.
The model is ``--layers`` bias-free d x d Linear layers, so every weight is converted to fp8 and the flat
buffers' alignment padding is negligible. Transients (a bf16 ``.grad`` that autograd makes before it is
added into an fp32 ``main_grad``, activations) are not static buffers and are not counted.

    python perf/fp8_memory_table.py [--layers 8] [--d 1024]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's graphstep
import graphstep as gs  # noqa: E402

ROWS = {
    "fp32 weights": dict(),
    "bf16 weights, fp32 grads (default)": dict(bf16=True),
    "bf16 weights, bf16 grads": dict(bf16=True, main_grads_dtype=torch.bfloat16),
    "fp8 weights, fp32 grads": dict(bf16=True, fp8_recipe="tensorwise"),
    "fp8 weights, bf16 grads": dict(bf16=True, main_grads_dtype=torch.bfloat16, fp8_recipe="tensorwise"),
    "fp8 weights (delayed, history 16)": dict(bf16=True, main_grads_dtype=torch.bfloat16, fp8_recipe="delayed",
                                              fp8_amax_history_len=16, fp8_amax_compute_algo="max"),
}


def measure(layers: int, d: int, flags: dict) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(d, d, bias=False) for _ in range(layers)])
    if flags.get("fp8_recipe"):
        history = {"amax_history_len": flags["fp8_amax_history_len"],
                   "amax_compute_algo": flags["fp8_amax_compute_algo"]} if flags["fp8_recipe"] == "delayed" else {}
        gs.fp8.convert(model, recipe=flags["fp8_recipe"], **history)
    opt = gs.get_optimizer(gs.OptimizerConfig(capture="eager", **flags), model)
    seen: set[int] = set()

    def nbytes(tensors) -> int:
        total = 0
        for t in tensors:
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    b = opt.buffers
    kinds = {"weights": nbytes(b.param_flat), "grads": nbytes(b.grad_flat), "fp32 main params": nbytes(b.main_shard),
             "Adam state": nbytes(t for ts in b.state.values() for t in ts)}
    metas = [p.fp8_meta for p in b.params if gs.fp8.is_fp8(p)]
    kinds["fp8 scales"] = nbytes(t for m in metas for t in (m.scale, m.scale_inv, m.amax_history))
    numel = sum(p.numel() for p in b.params)
    opt.close()
    return {kind: value / numel for kind, value in kinds.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d", type=int, default=1024)
    args = parser.parse_args(argv)
    header = ["", "weights", "grads", "fp32 main params", "Adam state", "fp8 scales", "total"]
    print(f"bytes per param, measured on {args.layers} Linear({args.d}, {args.d}) weights "
          f"({args.layers * args.d * args.d / 1e6:.1f}M params), Adam, one rank")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|")
    for name, flags in ROWS.items():
        row = measure(args.layers, args.d, flags)
        cells = [f"{row[k]:.2f}" if k != "fp8 scales" else (f"{row[k]:.6f}" if row[k] else "-")
                 for k in header[1:-1]]
        print(f"| {name} | " + " | ".join(cells) + f" | {sum(row.values()):.2f} |")


if __name__ == "__main__":
    main()
