"""debug_step(closure) names the module that first made a non-finite value, in forward or in backward.

The oracle is the injection: each test plants a NaN (or inf) in one known module of the built-in GPT or
a small stack and checks that exactly that module is named, with the right phase; a clean step, a NaN
made outside the model and a step without a closure must name no module. The hooks must leave the model
as they found it (no hooks left, the same grads and the same step as a plain backward).
"""

from dataclasses import dataclass

import pytest
import torch
from torch import nn

from _engine import make_engine
from graphstep.app import models


def tiny_gpt(seed: int = 0) -> models.GPT:
    config = models.tiny(vocab_size=64, seq_len=16, d_model=32, n_layers=3, n_heads=2, d_ff=64)
    return models.GPT(config, seed=seed)


def gpt_closure(model, opt, step: int = 0):
    inputs, targets = models.SyntheticCorpus(64, seed=0).batch(step, batch_size=4, seq_len=16)

    def closure():
        opt.zero_grad()
        loss = model(inputs, targets)
        loss.backward()
        return loss
    return closure


def gpt_debug_report(model):
    """One ``debug_step`` of a fresh engine over the GPT ``model``, its closure traced."""
    opt = make_engine(model)
    return opt.debug_step(gpt_closure(model, opt))


class LogOfNegative(nn.Module):
    """Makes NaN from finite inputs in forward: log of a negative number."""

    def forward(self, x):
        return torch.log(-(x.abs() + 1.0))


class NaNGradFunction(torch.autograd.Function):
    """Identity in forward; its backward returns NaN for the input."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return torch.full_like(grad, float("nan"))


class NaNInBackward(nn.Module):
    def forward(self, x):
        return NaNGradFunction.apply(x)


class NaNWeightGradFunction(torch.autograd.Function):
    """x * weight, whose backward gives the right input grad but a NaN weight grad."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x * weight

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return grad * weight, torch.full_like(weight, float("nan"))


class NaNWeightGrad(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))

    def forward(self, x):
        return NaNWeightGradFunction.apply(x, self.scale)


def test_a_forward_nan_in_a_middle_module_of_the_gpt_is_named():
    model = tiny_gpt()
    model.blocks[1].mlp.fc = nn.Sequential(model.blocks[1].mlp.fc, LogOfNegative())
    report = gpt_debug_report(model)
    origin = report.nan_origin
    assert not report.update_successful
    assert (origin.stage, origin.tensor) == ("backward", "grad")
    assert (origin.module, origin.module_type, origin.phase) == ("blocks.1.mlp.fc.1", "LogOfNegative", "forward")
    assert origin.traced
    text = str(origin)
    assert "output of module 'blocks.1.mlp.fc.1' (LogOfNegative) in forward" in text
    assert text in report.table()


def test_a_nan_made_by_a_modules_own_code_names_that_module_not_a_submodule():
    class NaNBlock(models.Block):  # the block's own forward makes it; its submodules stay finite
        def forward(self, x):
            return super().forward(x) * torch.sqrt(torch.tensor(-1.0))

    model = tiny_gpt()
    block = NaNBlock(model.config)
    block.load_state_dict(model.blocks[1].state_dict())
    model.blocks[1] = block
    origin = gpt_debug_report(model).nan_origin
    assert (origin.module, origin.module_type, origin.phase) == ("blocks.1", "NaNBlock", "forward")
    assert "made by its own code" in str(origin)


def test_a_backward_nan_is_named_with_phase_backward():
    model = tiny_gpt()
    model.blocks[1].mlp.proj = nn.Sequential(model.blocks[1].mlp.proj, NaNInBackward())
    report = gpt_debug_report(model)
    origin = report.nan_origin
    assert not report.update_successful
    assert (origin.module, origin.module_type, origin.phase) == ("blocks.1.mlp.proj.1", "NaNInBackward", "backward")
    assert "grad of its input of module 'blocks.1.mlp.proj.1' (NaNInBackward) in backward" in str(origin)


def test_a_backward_nan_in_a_params_grad_only_names_its_module_and_param():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), NaNWeightGrad(8), nn.Linear(8, 4))
    opt = make_engine(model)
    x = torch.randn(5, 8)

    def closure():
        opt.zero_grad()
        model(x).square().mean().backward()
    origin = opt.debug_step(closure).nan_origin
    assert (origin.module, origin.phase) == ("2", "backward")
    assert "grad of its param 'scale' of module '2' (NaNWeightGrad)" in str(origin)
    # Its input grad was finite, so the modules before it got finite grads: only '2.scale' is non-finite.
    assert origin.param == "2.scale"


def test_an_inf_overflow_is_named_where_it_overflowed_not_where_it_became_nan():
    torch.manual_seed(0)
    big = nn.Linear(8, 8)
    with torch.no_grad():
        big.weight.fill_(3e38)  # finite weights whose products overflow to inf; LayerNorm then makes NaN
    model = nn.Sequential(nn.Linear(8, 8), big, nn.LayerNorm(8), nn.Linear(8, 4))
    opt = make_engine(model, clip_grad=0.0)
    x = torch.randn(5, 8)

    def closure():
        opt.zero_grad()
        model(x).sum().backward()
    origin = opt.debug_step(closure).nan_origin
    assert (origin.module, origin.module_type, origin.phase) == ("1", "Linear", "forward")


def test_a_nan_in_the_batch_names_no_module_and_a_nan_param_names_its_module():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4))
    opt = make_engine(model)
    x = torch.randn(5, 8)
    x[0, 0] = float("nan")  # the data, not the model

    def closure():
        opt.zero_grad()
        model(x).sum().backward()
    report = opt.debug_step(closure)
    assert report.nan_origin is not None and report.nan_origin.module is None and report.model_source is None

    x[0, 0] = 0.0
    with torch.no_grad():
        model[1].weight[3] = float("inf")  # a param already non-finite before the forward
    source = opt.debug_step(closure).model_source
    assert (source.module, source.what, source.phase) == ("1", "param 'weight'", "forward")


def test_a_clean_step_has_no_origin_and_equals_a_plain_step():
    traced, plain = tiny_gpt(), tiny_gpt()
    traced_opt, plain_opt = make_engine(traced), make_engine(plain)
    for step in range(3):
        report = traced_opt.debug_step(gpt_closure(traced, traced_opt, step))
        assert report.nan_origin is None and report.update_successful
        plain_opt.step(gpt_closure(plain, plain_opt, step))
    for (name, a), b in zip(traced.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_hooks_are_gone_after_the_closure_even_when_it_raises():
    model = tiny_gpt()
    opt = make_engine(model)
    hooks_before = [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]
    opt.debug_step(gpt_closure(model, opt))

    def failing():
        model(torch.zeros(2, 4, dtype=torch.long))
        raise KeyError("the user's closure failed")
    with pytest.raises(KeyError):
        opt.debug_step(failing)
    for module, before in zip(model.modules(), hooks_before):
        assert (len(module._forward_hooks), len(module._forward_pre_hooks)) == before == (0, 0)
    for name, p in model.named_parameters():
        assert not p._backward_hooks, name


@dataclass
class Carried:
    hidden: torch.Tensor
    note: str


class ReturnsADict(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return {"hidden": self.linear(x), "count": 3, "nothing": None}


class TakesTheDictReturnsADataclass(nn.Module):
    def __init__(self, poison: bool):
        super().__init__()
        self.linear, self.poison = nn.Linear(8, 8), poison

    def forward(self, carried: dict):
        hidden = self.linear(carried["hidden"])
        return Carried(hidden * float("inf") if self.poison else hidden, note="text")


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.relu, self.linear = nn.ReLU(inplace=True), nn.Linear(8, 4)  # in place: full backward hooks break

    def forward(self, carried: Carried):
        return self.linear(self.relu(carried.hidden))


def structured_model(poison: bool) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(ReturnsADict(), TakesTheDictReturnsADataclass(poison), Head())


def test_modules_taking_and_returning_non_tensors_and_in_place_ops_keep_their_grads():
    x = torch.randn(5, 8)
    traced, plain = structured_model(poison=False), structured_model(poison=False)
    opt = make_engine(traced)

    def closure():
        opt.zero_grad()
        traced(x).square().mean().backward()
    grads = {}
    for name, p in traced.named_parameters():  # the grads the hooks' backward produced, before the step
        p.register_post_accumulate_grad_hook(lambda p, name=name: grads.__setitem__(name, p.grad.clone()))
    assert opt.debug_step(closure).nan_origin is None
    plain(x).square().mean().backward()
    for name, p in plain.named_parameters():  # torch's own backward is the oracle
        assert torch.equal(grads[name], p.grad), name


def test_a_nan_inside_a_dataclass_output_is_found():
    model = structured_model(poison=True)
    opt = make_engine(model)
    x = torch.randn(5, 8)

    def closure():
        opt.zero_grad()
        model(x).square().mean().backward()
    origin = opt.debug_step(closure).nan_origin
    assert (origin.module, origin.module_type, origin.phase) == ("1", "TakesTheDictReturnsADataclass", "forward")


def test_several_chunks_name_modules_with_the_chunk_index():
    torch.manual_seed(0)
    first, second = nn.Sequential(nn.Linear(8, 8)), nn.Sequential(nn.Linear(8, 8), LogOfNegative(), nn.Linear(8, 2))
    opt = make_engine([first, second])
    x = torch.randn(5, 8)

    def closure():
        opt.zero_grad()
        second(first(x)).sum().backward()
    report = opt.debug_step(closure)
    assert (report.nan_origin.module, report.nan_origin.phase) == ("1.1", "forward")
    assert report.model_source.module == "1.1"


def test_a_nan_that_never_reaches_the_grads_is_reported_beside_a_clean_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), LogOfNegative())  # log's grad, 1/x, stays finite: the loss is NaN
    opt = make_engine(model)
    x = torch.randn(5, 8)

    def closure():
        opt.zero_grad()
        loss = model(x).sum()
        loss.backward()
        assert loss.isnan()
    report = opt.debug_step(closure)
    assert report.nan_origin is None and report.update_successful
    assert (report.model_source.module, report.model_source.phase) == ("1", "forward")
    assert "did not reach the step's grads: output of module '1' (LogOfNegative) in forward" in report.table()


def test_a_nan_made_outside_the_modules_names_no_module():
    torch.manual_seed(0)
    # nn.Identity returns its input as it got it: the grad reaching it is not one it made.
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Identity())
    opt = make_engine(model)
    x = torch.randn(5, 8)

    def closure():  # sqrt(0)'s derivative is inf: the loss, outside every module, makes the NaN grads
        opt.zero_grad()
        (model(x) * 0.0).sqrt().sum().backward()
    report = opt.debug_step(closure)
    origin = report.nan_origin
    assert origin is not None and origin.module is None and origin.traced and report.model_source is None
    assert "no module of the model made" in str(origin)


def test_without_a_closure_the_report_says_how_to_find_the_module():
    model = tiny_gpt()
    model.blocks[1].mlp.fc = nn.Sequential(model.blocks[1].mlp.fc, LogOfNegative())
    opt = make_engine(model)
    gpt_closure(model, opt)()
    origin = opt.debug_step().nan_origin
    assert origin.module is None and not origin.traced
    assert "opt.debug_step(closure)" in str(origin)
