"""What the optimizer's build needs to know about fp8 weights: checks against the config, main values."""

from __future__ import annotations

from typing import Sequence

import torch

from .params import is_fp8


def check_against_config(config, named: Sequence[tuple[str, torch.nn.Parameter]]) -> None:
    """Refuse a model whose fp8 weights the config does not describe (or a recipe without fp8 weights).

    The step requantizes with ``config.fp8_*``; each weight's scaling state was made by ``fp8.convert``
    with its own arguments. They must agree, or the step would, say, roll a history of the wrong length.
    """
    _refuse_te_fp8(named)
    converted = [(name, p) for name, p in named if is_fp8(p)]
    if converted and config.fp8_recipe is None:
        raise ValueError(f"param '{converted[0][0]}' is an fp8 weight (graphstep.fp8.convert) but "
                         "OptimizerConfig.fp8_recipe is None: set fp8_recipe to the recipe you converted with")
    if not converted and config.fp8_recipe is not None:
        raise ValueError(f"OptimizerConfig.fp8_recipe={config.fp8_recipe!r} but the model has no fp8 weights: "
                         "run graphstep.fp8.convert(model, ...) before get_optimizer, or leave fp8_recipe None")
    for name, p in converted:
        meta = p.fp8_meta
        pairs = (("fp8_recipe", config.fp8_recipe, "recipe", meta.recipe),
                 ("fp8_margin", config.fp8_margin, "margin", meta.margin),
                 ("fp8_amax_history_len", config.fp8_amax_history_len, "amax_history_len",
                  meta.amax_history.numel()),
                 ("fp8_amax_compute_algo", config.fp8_amax_compute_algo, "amax_compute_algo",
                  meta.amax_compute_algo))
        for field, wanted, argument, got in pairs:
            if wanted != got:
                raise ValueError(f"param '{name}': converted with {argument}={got!r} but OptimizerConfig."
                                 f"{field}={wanted!r}; convert and configure with the same values")
        for tensor in (meta.scale, meta.scale_inv, meta.amax_history):
            if tensor.device != p.device:
                raise ValueError(f"param '{name}' is on {p.device} but its fp8 scales are on {tensor.device}: "
                                 "run graphstep.fp8.convert after moving the model to its device")


def _refuse_te_fp8(named: Sequence[tuple[str, torch.nn.Parameter]]) -> None:
    """A Transformer Engine fp8 weight (``te.fp8_model_init``) is recognised, its recipe checked, and refused
    with what to do: the engine makes every param a view of its flat buffers, and TE's ``Float8Tensor`` keeps
    its bytes in its own ``_data`` (binding it would take TE's ``replace_raw_data``; not built yet)."""
    from .te_interop import is_te_fp8, recipe_of

    for name, p in named:
        if is_te_fp8(p):
            recipe = recipe_of(p, name)  # an unsupported (block-scaled) recipe is named first
            raise ValueError(f"param '{name}' is a Transformer Engine fp8 weight (recipe {recipe!r}): the "
                             "optimizer cannot hold TE's Float8Tensor in its flat buffers yet. Build the model "
                             "without te.fp8_model_init (TE then casts bf16 weights to fp8 in its forward) and "
                             "use graphstep.fp8.convert for fp8 weights, or requantize TE weights from your own "
                             "step with graphstep.fp8.te_interop.requantize_te")


def main_values(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """What seeds the fp32 main params for ``param`` given its stored ``value``: fp8 bytes dequantized."""
    if is_fp8(param):
        return (value.to(torch.float32) * param.fp8_meta.scale_inv)
    return value
