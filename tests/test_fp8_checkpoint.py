"""fp8 weights in the optimizer's checkpoints (graphstep.fp8.checkpoint): the flat state_dict, the
reshardable sharded_state_dict and DCP save/load carry the fp8 bytes, scale, scale_inv and amax history, so a
resume continues bitwise like the uninterrupted run (both recipes); a checkpoint that does not fit is refused
naming the key, with nothing changed."""

import copy

import pytest
import torch
from test_fp8_engine import fp8_config, fp8_model, fp8_weights, snapshot
from toy import loss_fn, tiny_transformer

import graphstep as gs
from graphstep import fp8
from graphstep.checkpoint import sharded
from graphstep.checkpoint.state_dict import StateDictError


def train(model, opt, steps):
    for step in steps:
        opt.zero_grad()
        loss_fn(model, step).backward()
        opt.step()


def trained(recipe, steps=3, **config):
    model = fp8_model(recipe, model_dtype=torch.bfloat16)
    opt = gs.get_optimizer(fp8_config(recipe, lr=1e-2, bf16=True, **config), model)
    train(model, opt, range(steps))
    return model, opt


def fresh(recipe, **config):
    model = fp8_model(recipe, model_dtype=torch.bfloat16)
    return model, gs.get_optimizer(fp8_config(recipe, lr=1e-2, bf16=True, **config), model)


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


SAVERS = {
    "flat": (lambda opt: copy.deepcopy(opt.state_dict()), lambda opt, sd: opt.load_state_dict(sd)),
    "sharded": (lambda opt: sharded.sharded_state_dict(opt, snapshot=True),
                lambda opt, sd: opt.load_sharded_state_dict(sd)),
}


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
@pytest.mark.parametrize("form", list(SAVERS))
def test_round_trip_restores_every_fp8_byte_and_resumes_bitwise(recipe, form):
    save, load = SAVERS[form]
    model_a, opt_a = trained(recipe)
    saved, at_save = save(opt_a), snapshot(opt_a, model_a)
    train(model_a, opt_a, range(3, 6))
    model_b, opt_b = fresh(recipe)
    assert not same(at_save, snapshot(opt_b, model_b))  # a fresh optimizer differs: the load has work to do
    load(opt_b, saved)
    assert same(at_save, snapshot(opt_b, model_b))  # fp8 bytes, scale, scale_inv, history, main, state
    train(model_b, opt_b, range(3, 6))
    assert same(snapshot(opt_a, model_a), snapshot(opt_b, model_b))


def test_sharded_entries_are_model_named_and_one_byte_per_element():
    model, opt = trained("delayed")
    sd = opt.sharded_state_dict()
    names = [n for n, p in model.named_parameters() if fp8.is_fp8(p)]
    assert names
    for name, p in zip(names, fp8_weights(model)):
        data = sd[f"optimizer.fp8.data.{name}"]
        assert data.dtype == torch.uint8 and data.shape == (p.numel(),)
        assert torch.equal(data, p.detach().reshape(-1).view(torch.uint8))
        assert torch.equal(sd[f"optimizer.fp8.scale.{name}"], p.fp8_meta.scale)
        assert torch.equal(sd[f"optimizer.fp8.scale_inv.{name}"], p.fp8_meta.scale_inv)
        assert torch.equal(sd[f"optimizer.fp8.amax_history.{name}"], p.fp8_meta.amax_history)
    model_plain = tiny_transformer()
    assert not any(k.startswith("optimizer.fp8.") for k in
                   gs.get_optimizer(gs.OptimizerConfig(capture="eager"), model_plain).sharded_state_dict())
    assert "fp8" not in gs.get_optimizer(gs.OptimizerConfig(capture="eager"), tiny_transformer()).state_dict()


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_dcp_save_and_load_resume_bitwise_with_the_model(tmp_path, recipe):
    model_a, opt_a = trained(recipe)
    gs.checkpoint.save(opt_a, str(tmp_path / "ckpt"), model=model_a)
    train(model_a, opt_a, range(3, 6))
    model_b, opt_b = fresh(recipe)
    gs.checkpoint.load(opt_b, str(tmp_path / "ckpt"), model=model_b)
    train(model_b, opt_b, range(3, 6))
    assert same(snapshot(opt_a, model_a), snapshot(opt_b, model_b))


def test_captured_step_replays_after_a_load_without_recapture():
    model_a, opt_a = trained("delayed", capture="graph", capture_warmup_steps=1)
    saved = copy.deepcopy(opt_a.state_dict())
    train(model_a, opt_a, range(3, 6))
    train(model_a, opt_a, range(6, 8))
    model_b, opt_b = trained("delayed", capture="graph", capture_warmup_steps=1)
    train(model_b, opt_b, range(3, 5))  # captured and replaying, on other values
    opt_b.load_state_dict(saved)
    train(model_b, opt_b, range(3, 6))
    train(model_b, opt_b, range(6, 8))
    assert opt_b.captured and opt_b.recaptures == 0
    assert same(snapshot(opt_a, model_a), snapshot(opt_b, model_b))


def _refused(opt, model, load, sd, match):
    before = snapshot(opt, model)
    with pytest.raises(StateDictError, match=match):
        load(opt, sd)
    assert same(before, snapshot(opt, model))  # nothing changed


def test_flat_checkpoints_that_do_not_fit_are_refused_naming_the_key():
    model, opt = trained("delayed")
    good = copy.deepcopy(opt.state_dict())
    load = SAVERS["flat"][1]
    missing = {k: v for k, v in good.items() if k != "fp8"}
    _refused(opt, model, load, missing, r"\['fp8'\] is missing: this model has fp8 weights")
    bad = copy.deepcopy(good)
    bad["fp8"]["scale"][0] = torch.tensor(float("nan"))
    _refused(opt, model, load, bad, r"\['scale'\] of '.*' holds NaN or inf")
    bad = copy.deepcopy(good)
    bad["fp8"]["scale_inv"][1] = torch.tensor(-1.0)
    _refused(opt, model, load, bad, r"\['scale_inv'\] of '.*' is not positive")
    bad = copy.deepcopy(good)
    bad["fp8"]["amax_history"][0] = bad["fp8"]["amax_history"][0][:1]
    _refused(opt, model, load, bad, r"\['amax_history'\] of .* expected torch.float32 \(3,\)")
    bad = copy.deepcopy(good)
    bad["fp8"]["params"] = list(reversed(bad["fp8"]["params"]))
    _refused(opt, model, load, bad, r"\['params'\] names other fp8 weights")
    plain_model = tiny_transformer()
    plain = gs.get_optimizer(gs.OptimizerConfig(capture="eager"), plain_model)
    with pytest.raises(StateDictError, match=r"holds fp8 state but this model has no fp8 weights"):
        plain.load_state_dict({**plain.state_dict(), "fp8": good["fp8"]})


def test_sharded_checkpoints_that_do_not_fit_are_refused_naming_the_key():
    model, opt = trained("tensorwise")
    good = sharded.sharded_state_dict(opt, snapshot=True)
    load = SAVERS["sharded"][1]
    name = next(n for n, p in model.named_parameters() if fp8.is_fp8(p))
    key = f"optimizer.fp8.amax_history.{name}"
    _refused(opt, model, load, {k: v for k, v in good.items() if k != key}, rf"\['{key}'\] is missing")
    bad = dict(good)
    bad[f"optimizer.fp8.data.{name}"] = good[f"optimizer.fp8.data.{name}"][:-1]
    _refused(opt, model, load, bad, r"expected torch.uint8")
    _refused(opt, model, load, {**good, "optimizer.fp8.scale.not.a.weight": torch.ones(())},
             r"'optimizer.fp8.scale.not.a.weight'\] is fp8 state of a weight this model does not hold in fp8")
