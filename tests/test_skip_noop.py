"""A skipped step is bitwise a no-op in every precision the config accepts (docs/design.md law 5): the model params,
the main params (however stored), the optimizer state (however stored, scales included), fp8 weights and their
scaling state, and the step count, on the first step and on a later one."""

import pytest
import torch

import graphstep as gs
from graphstep import fp8
from toy import loss_fn, tiny_transformer

AWARE = dict(use_precision_aware_optimizer=True)
PRECISIONS = {
    "fp32": {},
    "fp32-fp64-main": dict(main_params_dtype=torch.float64),
    "bf16": dict(bf16=True),
    "fp16": dict(fp16=True),
    "fp16-fp16-main": dict(fp16=True, main_params_dtype=torch.float16, **AWARE),
    "bf16-fp16-main": dict(bf16=True, main_params_dtype=torch.float16, **AWARE),
    "bf16-remainders": dict(bf16=True, store_param_remainders=True, **AWARE),
    "bf16-moments": dict(bf16=True, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16, **AWARE),
    "fp16-moments": dict(bf16=True, exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16, **AWARE),
    "fp8-moments": dict(bf16=True, exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8, **AWARE),
    "fp16-all-below-fp32": dict(fp16=True, main_params_dtype=torch.float16, exp_avg_dtype=torch.float16,
                                exp_avg_sq_dtype=torch.uint8, **AWARE),
}
FP8_RECIPES = {"fp8-tensorwise": {}, "fp8-delayed": dict(amax_history_len=3, amax_compute_algo="max")}
SKIP_AT = (0, 3)  # the first step, and one after three applied steps


def model_for(precision):
    dtype = torch.float16 if precision.get("fp16") else torch.bfloat16 if precision.get("bf16") else torch.float32
    model = tiny_transformer(dtype=dtype)
    with torch.no_grad():  # weights whose per-param fp16 / fp8 encodings do not round-trip to the params' values
        for p in model.parameters():
            p.mul_(3.7)
    return model


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8).clone()


def snapshot(opt, model) -> dict:
    """Every byte a step owns, by name."""
    out = {f"param {name}": raw(p) for name, p in model.named_parameters()}
    buffers = opt.buffers
    out.update({f"main_shard[{b}]": raw(t) for b, t in enumerate(buffers.main_shard)})
    out.update({f"{name}[{b}]": raw(t) for name, tensors in buffers.state.items() for b, t in enumerate(tensors)})
    for kind, per_buffer in buffers.stored.items():
        for b, stored in enumerate(per_buffer):
            if stored is not None:
                out[f"stored {kind}[{b}]"] = raw(stored.data)
                if stored.scales is not None:
                    out[f"stored {kind}[{b}] scales"] = raw(stored.scales)
    for name, p in model.named_parameters():
        if fp8.is_fp8(p):
            meta = p.fp8_meta
            out.update({f"{name} fp8 scale": raw(meta.scale), f"{name} fp8 scale_inv": raw(meta.scale_inv),
                        f"{name} amax_history": raw(meta.amax_history)})
    out["step count"] = raw(opt.tensors.step)
    return out


def run_with_a_skip(model, config, skip_at):
    opt = gs.get_optimizer(config, model)
    for step in range(skip_at + 1):
        opt.zero_grad()
        loss = loss_fn(model, step)
        if step == skip_at:
            before = snapshot(opt, model)
            loss = loss * float("inf")  # inf grads: the step must be skipped
        opt.scale_loss(loss).backward()
        result = opt.step()
    assert not bool(result.update_successful), "the step with inf grads was not skipped"
    after = snapshot(opt, model)
    changed = {name: int((before[name] != after[name]).sum()) for name in before if not torch.equal(before[name],
                                                                                                    after[name])}
    assert not changed, f"a skipped step at step {skip_at} changed bytes of: {changed}"


@pytest.mark.parametrize("skip_at", SKIP_AT, ids=lambda s: f"skip-at-{s}")
@pytest.mark.parametrize("precision", list(PRECISIONS), ids=str)
def test_a_skipped_step_changes_no_byte(precision, skip_at):
    fields = PRECISIONS[precision]
    config = gs.OptimizerConfig(capture="eager", lr=1e-2, weight_decay=0.1, **fields)
    run_with_a_skip(model_for(fields), config, skip_at)


@pytest.mark.parametrize("skip_at", SKIP_AT, ids=lambda s: f"skip-at-{s}")
@pytest.mark.parametrize("recipe", list(FP8_RECIPES), ids=str)
def test_a_skipped_step_changes_no_byte_of_fp8_weights(recipe, skip_at):
    model = tiny_transformer()
    fp8.convert(model, recipe=recipe.removeprefix("fp8-"), **FP8_RECIPES[recipe])
    extra = dict(fp8_amax_history_len=3, fp8_amax_compute_algo="max") if recipe == "fp8-delayed" else {}
    config = gs.OptimizerConfig(capture="eager", lr=1e-2, clip_grad=0.0, fp8_recipe=recipe.removeprefix("fp8-"),
                                **extra)
    run_with_a_skip(model, config, skip_at)


FAMILY_PRECISIONS = [(optimizer, precision) for optimizer in ("sgd", "lion", "ademamix", "muon")
                     for precision in ("fp32", "bf16", "fp16")
                     if not (precision == "fp16" and optimizer in ("lion", "muon"))]  # refused by the config


@pytest.mark.parametrize("optimizer,precision", FAMILY_PRECISIONS, ids=str)
def test_a_skipped_first_step_of_every_family_changes_no_byte(optimizer, precision):
    fields = PRECISIONS[precision]
    config = gs.OptimizerConfig(optimizer=optimizer, capture="eager", lr=1e-2, weight_decay=0.1, **fields)
    run_with_a_skip(model_for(fields), config, 0)
