"""Parameter-shape sets shared by the benchmarks (``graphstep bench``, perf/): (name, shape) lists, no tensors.

``gpt2_small()`` is GPT-2 small as HF's GPT2LMHeadModel lays it out (Conv1D weights are (in, out)),
with the head tied to ``wte``: 124,439,808 params in 148 tensors.
"""

from __future__ import annotations

import math

Shapes = list[tuple[str, tuple[int, ...]]]


def gpt2(n_layer: int = 12, d_model: int = 768, vocab: int = 50257, n_ctx: int = 1024) -> Shapes:
    """GPT-2's parameter shapes for the given size."""
    shapes: Shapes = [("wte", (vocab, d_model)), ("wpe", (n_ctx, d_model))]
    for i in range(n_layer):
        h = f"h.{i}."
        shapes += [
            (h + "ln_1.weight", (d_model,)), (h + "ln_1.bias", (d_model,)),
            (h + "attn.c_attn.weight", (d_model, 3 * d_model)), (h + "attn.c_attn.bias", (3 * d_model,)),
            (h + "attn.c_proj.weight", (d_model, d_model)), (h + "attn.c_proj.bias", (d_model,)),
            (h + "ln_2.weight", (d_model,)), (h + "ln_2.bias", (d_model,)),
            (h + "mlp.c_fc.weight", (d_model, 4 * d_model)), (h + "mlp.c_fc.bias", (4 * d_model,)),
            (h + "mlp.c_proj.weight", (4 * d_model, d_model)), (h + "mlp.c_proj.bias", (d_model,)),
        ]
    shapes += [("ln_f.weight", (d_model,)), ("ln_f.bias", (d_model,))]
    return shapes


def gpt2_small() -> Shapes:
    """GPT-2 small: ~124M params in 148 tensors."""
    return gpt2()


def gpt2_quick() -> Shapes:
    """A GPT-2-shaped set of ~10M params in 52 tensors (seconds, for smoke runs)."""
    return gpt2(n_layer=4, d_model=384, vocab=8192, n_ctx=512)




def many_tensors(count: int, numel: int, cols: int = 64) -> Shapes:
    """``count`` 2-D weights of ~``numel`` elements each (2-D, so all take weight decay: one param group)."""
    rows = max(1, numel // cols)
    return [(f"w{i}.weight", (rows, cols)) for i in range(count)]


def flat_tensor(numel: int, cols: int = 4096) -> Shapes:
    """One contiguous 2-D weight of ``numel`` elements (rounded down to a multiple of ``cols``)."""
    return [("flat.weight", (max(1, numel // cols), cols))]


def numel(shapes: Shapes) -> int:
    return sum(math.prod(shape) for _, shape in shapes)


def is_no_decay(name: str, shape: tuple[int, ...]) -> bool:
    """The standard rule (graphstep's default overrides, Megatron-Core's): no decay on biases and 1-D."""
    return name.endswith(".bias") or len(shape) == 1


def tensors_1k() -> Shapes:
    """1,000 weights of 65,536 elements (65.5M): params just large enough for the folded norm's hooks."""
    return many_tensors(1000, 65_536)


def tensors_10k() -> Shapes:
    """10,000 weights of 4,096 elements (41.0M): many small params."""
    return many_tensors(10_000, 4096)


SETS = {"gpt2-small": gpt2_small, "gpt2-quick": gpt2_quick, "tensors-1k": tensors_1k, "tensors-10k": tensors_10k}
