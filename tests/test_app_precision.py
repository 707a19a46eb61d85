"""The app's --precision choices (graphstep.app.precision): config flags, fp8 conversion of the built-in GPT,
and the param bytes measured from the optimizer's storages."""

import pytest
import torch

import graphstep as gs
from graphstep.app import models
from graphstep.app.demo import DemoSettings, optimizer_config, train
from graphstep.app.precision import PRECISIONS, config_flags, param_bytes, prepare


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: the tiny model runs on one thread


def test_flags_of_every_precision_make_a_valid_config():
    for precision in PRECISIONS:
        gs.OptimizerConfig(**config_flags(precision))
    assert config_flags("fp8") == {"bf16": True, "fp8_recipe": "tensorwise"}
    with pytest.raises(ValueError, match="choose one of fp32, bf16, fp16, fp8"):
        config_flags("fp4")


@pytest.mark.parametrize("qk_clip", [False, True])
def test_fp8_converts_the_hidden_linears_only(qk_clip):
    model = models.GPT(models.tiny(qk_clip=qk_clip))
    converted = prepare(model, "fp8")
    fp8_names = {n for n, p in model.named_parameters() if gs.fp8.is_fp8(p)}
    assert fp8_names == {f"{name}.weight" for name in converted}
    assert all(n.endswith(("attn.proj.weight", "mlp.fc.weight", "mlp.proj.weight", "attn.qkv.weight"))
               for n in fp8_names)
    assert any("qkv" in n for n in fp8_names) != qk_clip  # QK-clip's registered qkv weight is left alone
    assert not any(gs.fp8.is_fp8(p) for p in (model.wte.weight, model.wpe.weight, model.head.weight))
    assert prepare(models.GPT(models.tiny()), "bf16") == []


def test_param_bytes_are_the_optimizers_storages():
    settings = DemoSettings(precision="fp8")
    model = models.GPT(models.tiny())
    prepare(model, "fp8")
    with gs.get_optimizer(optimizer_config(settings, "eager"), model) as opt:
        measured = param_bytes(opt)
        fp8_flats = [f for f in opt.buffers.param_flat if f.dtype == torch.float8_e4m3fn]
        weights = [p for p in model.parameters() if gs.fp8.is_fp8(p)]
    assert fp8_flats and measured.fp8_bytes == sum(f.numel() for f in fp8_flats)  # 1 B per element
    assert measured.fp8_elements == sum(p.numel() for p in weights)
    assert measured.fp8_elements <= measured.fp8_bytes < measured.fp8_elements + 4096
    assert measured.scale_tensors == 3 * len(weights) and measured.scale_bytes == 3 * 4 * len(weights)
    others = sum(p.numel() for p in model.parameters() if not gs.fp8.is_fp8(p))
    assert 2 * others <= measured.other_bytes < 2 * others + 4096  # bf16
    assert measured.all_bf16_bytes == 2 * sum(p.numel() for p in model.parameters())
    assert measured.total < 0.6 * measured.all_bf16_bytes


def test_fp8_demo_run_trains_close_to_bf16_but_not_identically():
    runs = {precision: train(DemoSettings(steps=8, batch_size=4, precision=precision), "eager")
            for precision in ("bf16", "fp8")}
    bf16, fp8 = runs["bf16"].losses, runs["fp8"].losses
    assert fp8[-1] < fp8[0]  # it learns
    assert not torch.equal(bf16, fp8)  # the fp8 weights were used
    assert abs(float(fp8[-1]) - float(bf16[-1])) < 0.02 * float(bf16[-1])
