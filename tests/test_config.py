"""OptimizerConfig validation: every bad value is refused with a message naming the field."""

import dataclasses
import math
import re
import typing

import pytest
import torch

from graphstep.config import OptimizerConfig

BAD = [
    (dict(fp16=True, bf16=True), "bf16"),
    (dict(lr=-1e-3), "lr"),
    (dict(lr=float("nan")), "lr"),
    (dict(min_lr=1.0, lr=0.1), "min_lr"),
    (dict(weight_decay=-0.1), "weight_decay"),
    (dict(adam_beta1=1.0), "adam_beta1"),
    (dict(adam_beta2=-0.1), "adam_beta2"),
    (dict(adam_eps=0.0), "adam_eps"),
    (dict(optimizer="lamb"), "optimizer"),
    (dict(sgd_momentum=1.5), "sgd_momentum"),
    (dict(sgd_nesterov=True, sgd_momentum=0.0), "sgd_nesterov"),
    (dict(params_dtype=torch.float16), "params_dtype"),
    (dict(params_dtype=torch.bfloat16, fp16=True), "params_dtype"),
    (dict(params_dtype=torch.int32), "params_dtype"),
    (dict(main_params_dtype=torch.bfloat16), "main_params_dtype"),
    (dict(loss_scale=0.0), "loss_scale"),
    (dict(loss_scale=2.0**128), "loss_scale"),
    (dict(initial_loss_scale=2.0**128), "initial_loss_scale"),
    (dict(initial_loss_scale=float("nan")), "initial_loss_scale"),
    (dict(min_loss_scale=1e-39), "min_loss_scale"),
    (dict(min_loss_scale=8.0, initial_loss_scale=4.0), "min_loss_scale"),
    (dict(loss_scale_window=0), "loss_scale_window"),
    (dict(hysteresis=1.5), "hysteresis"),
    (dict(clip_grad=-1.0), "clip_grad"),
    (dict(grad_norm_skip_threshold=0.0), "grad_norm_skip_threshold"),
    (dict(capture="cuda"), "capture"),
    (dict(capture_warmup_steps=-1), "capture_warmup_steps"),
    (dict(capture_invalidation="ignore"), "capture_invalidation"),
    (dict(kernel="triton"), "kernel"),
    (dict(kernel="compiled", capture="graph", capture_warmup_steps=0), "capture_warmup_steps"),
    (dict(bucket_size=0), "bucket_size"),
    (dict(overlap_grad_reduce=True), "overlap_grad_reduce"),
    (dict(distributed_timeout_s=0), "distributed_timeout_s"),
]


@pytest.mark.parametrize("kwargs, field", BAD, ids=[f for _, f in BAD])
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"OptimizerConfig\.{field}="):
        OptimizerConfig(**kwargs)


def test_defaults_follow_megatron_core():
    c = OptimizerConfig()
    assert (c.optimizer, c.weight_decay, c.adam.beta1, c.adam.beta2, c.adam.eps) == ("adam", 0.01, 0.9, 0.999, 1e-8)
    assert (c.initial_loss_scale, c.min_loss_scale, c.loss_scale_window, c.hysteresis) == (2.0**32, 1.0, 1000, 2)
    assert c.clip_grad == 1.0 and math.isinf(c.grad_norm_skip_threshold)


def test_frozen_and_replace_validates():
    c = OptimizerConfig()
    with pytest.raises(Exception):
        c.lr = 1.0
    assert c.replace(lr=0.5).lr == 0.5
    with pytest.raises(ValueError, match="lr"):
        c.replace(lr=-1.0)


def test_derived_choices():
    assert OptimizerConfig(bf16=True).model_dtype == torch.bfloat16
    assert OptimizerConfig(fp16=True).model_dtype == torch.float16
    assert OptimizerConfig().model_dtype is None
    assert OptimizerConfig(fp16=True).dynamic_loss_scale
    assert not OptimizerConfig(fp16=True, loss_scale=1024.0).dynamic_loss_scale
    assert not OptimizerConfig(bf16=True).dynamic_loss_scale


def test_every_field_has_a_docstring():
    import ast
    import inspect

    import graphstep.config as module

    tree = ast.parse(inspect.getsource(module))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "OptimizerConfig")
    documented = set()
    for a, b in zip(cls.body, cls.body[1:]):
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
            documented.add(a.target.id)
    fields = {f.name for f in __import__("dataclasses").fields(OptimizerConfig)}
    assert fields == documented


# Issue 11.6: before the type check, truthiness decided, so fp16="False" turned fp16 on.
WRONG_TYPES = [
    (dict(fp16="False"), "fp16", "must be a bool"),
    (dict(bf16=1), "bf16", "must be a bool"),
    (dict(use_distributed_optimizer="no"), "use_distributed_optimizer", "must be a bool"),
    (dict(overlap_grad_reduce="yes"), "overlap_grad_reduce", "must be a bool"),
    (dict(log_num_zeros_in_grad=0), "log_num_zeros_in_grad", "must be a bool"),
    (dict(decoupled_weight_decay="True"), "decoupled_weight_decay", "must be a bool"),
    (dict(bucket_size=True), "bucket_size", "must be an int or None, got bool"),
    (dict(bucket_size=1e6), "bucket_size", "must be an int or None, got float"),
    (dict(loss_scale_window=True), "loss_scale_window", "must be an int, got bool"),
    (dict(lr="3e-4"), "lr", "must be a number"),
    (dict(clip_grad=True), "clip_grad", "must be a number"),
    (dict(min_lr=False), "min_lr", "must be a number (int or float) or None"),
    (dict(params_dtype="bfloat16"), "params_dtype", "must be a torch.dtype or None"),
    (dict(optimizer=None), "optimizer", "must be a str"),
]


@pytest.mark.parametrize("kwargs, field, message", WRONG_TYPES, ids=[f for _, f, _ in WRONG_TYPES])
def test_wrong_types_are_refused_naming_the_field(kwargs, field, message):
    with pytest.raises(ValueError, match=rf"OptimizerConfig\.{field}=.*" + re.escape(message)):
        OptimizerConfig(**kwargs)


def test_every_field_refuses_a_value_of_no_accepted_type():
    """Generic over the dataclass: a new field is covered the day it is added."""
    hints = typing.get_type_hints(OptimizerConfig)
    for field in dataclasses.fields(OptimizerConfig):
        for wrong in (object(), [1], b"x"):
            with pytest.raises(ValueError, match=rf"OptimizerConfig\.{field.name}=.*must be"):
                OptimizerConfig(**{field.name: wrong})
        if typing.get_origin(hints[field.name]) is not typing.Union:  # not Optional: None is wrong too
            with pytest.raises(ValueError, match=rf"OptimizerConfig\.{field.name}=None"):
                OptimizerConfig(**{field.name: None})


def test_numbers_of_the_right_kind_still_pass():
    c = OptimizerConfig(lr=1, min_lr=0, weight_decay=0, bucket_size=4096, loss_scale=2.0**127, fp16=True,
                        params_dtype=torch.float16, initial_loss_scale=2**20)
    assert (c.lr, c.bucket_size, c.loss_scale, c.initial_loss_scale) == (1, 4096, 2.0**127, 2**20)
