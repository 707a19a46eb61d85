"""A config written for Megatron-Core's ``OptimizerConfig`` builds a graphstep ``OptimizerConfig``.

The field lists below are read from Megatron-Core's source: ``megatron/core/optimizer/optimizer_config.py`` of
NVIDIA/Megatron-LM at commit 0075637cdbb05f45fe6f7a96e008d64237698907 (the newest read) and of the
megatron-core 0.16.1 wheel, each field with its default there.
"""

import dataclasses

import pytest
import torch

import graphstep as gs
from graphstep.config import OptimizerConfig
from graphstep.config.megatron import NO_EFFECT, held_value

NEWEST = {
    "lr": None, "min_lr": None, "decoupled_lr": None, "decoupled_min_lr": None, "weight_decay": 0.01,
    "apply_wd_to_qk_layernorm": False, "fp8_recipe": None, "fp16": False, "bf16": False,
    "reuse_grad_buf_for_mxfp8_param_ag": False, "params_dtype": torch.float32, "use_precision_aware_optimizer": False,
    "store_param_remainders": True, "main_grads_dtype": torch.float32, "main_params_dtype": torch.float32,
    "exp_avg_dtype": torch.float32, "exp_avg_sq_dtype": torch.float32, "optimizer": "adam", "loss_scale": None,
    "initial_loss_scale": 2**32, "min_loss_scale": 1.0, "loss_scale_window": 1000, "hysteresis": 2,
    "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_eps": 1e-08, "decoupled_weight_decay": True, "sgd_momentum": 0.9,
    "muon_momentum": 0.95, "muon_split_qkv": True, "muon_nesterov": False, "muon_scale_mode": "spectral",
    "muon_fp32_matmul_prec": "medium", "muon_coefficient_type": "quintic", "muon_num_ns_steps": 5,
    "muon_tp_mode": "blockwise", "muon_extra_scale_factor": 1.0, "soap_shampoo_beta": 0.95,
    "soap_precondition_frequency": 1, "soap_use_kl_shampoo": True, "adaptive_muon_moment2_method": "adamuon",
    "adaptive_muon_beta2": 0.95, "adaptive_muon_eps": 1e-8, "muon_scalar_optimizer": "adam", "lion_beta1": 0.95,
    "lion_beta2": 0.98, "use_distributed_optimizer": False, "use_layer_wise_distributed_optimizer": False,
    "overlap_param_gather": False, "overlap_param_gather_with_optimizer_step": False, "optimizer_cpu_offload": False,
    "optimizer_offload_fraction": 0.0, "use_torch_optimizer_for_cpu_offload": False,
    "overlap_cpu_optimizer_d2h_h2d": False, "pin_cpu_grads": True, "pin_cpu_params": True,
    "offload_optimizer_states": False, "clip_grad": 1.0, "log_num_zeros_in_grad": False,
    "barrier_with_L1_time": False, "timers": None, "config_logger_dir": "", "optimizer_cuda_graph": False,
}
# 0.16.1 has no soap/adaptive-Muon/layer-wise/offload-states/coefficient-type/CUDA-graph fields and spells
# muon_nesterov "muon_use_nesterov".
V0_16_1_ONLY = {"muon_use_nesterov": False}
V0_16_1_MISSING = {"muon_nesterov", "muon_coefficient_type", "soap_shampoo_beta", "soap_precondition_frequency",
                   "soap_use_kl_shampoo", "adaptive_muon_moment2_method", "adaptive_muon_beta2", "adaptive_muon_eps",
                   "muon_scalar_optimizer", "lion_beta1", "lion_beta2", "use_layer_wise_distributed_optimizer",
                   "offload_optimizer_states", "optimizer_cuda_graph"}
# Where graphstep's default differs on purpose (README, "Differences from Megatron-Core").
OWN_DEFAULTS = {"lr": 1e-3, "params_dtype": None}


def _megatron_dict(version: str) -> dict:
    if version == "newest":
        return dict(NEWEST)
    fields = {k: v for k, v in NEWEST.items() if k not in V0_16_1_MISSING}
    return {**fields, **V0_16_1_ONLY}


@pytest.mark.parametrize("version", ["newest", "0.16.1"])
def test_every_megatron_field_is_accepted_by_name(version):
    fields = _megatron_dict(version)
    fields["lr"] = 3e-4  # Megatron-Core's None is filled in by its training scripts
    config = OptimizerConfig(**fields)
    for name, value in fields.items():
        if name in NO_EFFECT:  # accepted, and held nowhere
            assert not hasattr(config, name), name
        elif name == "params_dtype":
            assert config.params_dtype == value and config.model_dtype == torch.float32
        else:
            assert held_value(config, name) == value, name


def test_megatron_defaults_are_graphsteps_but_where_documented():
    ours = OptimizerConfig()
    for name, value in NEWEST.items():
        if name in NO_EFFECT:
            assert NO_EFFECT[name].default == value, name  # the reference lists Megatron-Core's default
        else:
            assert held_value(ours, name) == OWN_DEFAULTS.get(name, value), name


def test_a_megatron_bf16_config_trains_a_fp32_built_model_in_bf16():
    # Megatron-Core's params_dtype is the dtype weights are initialised in (fp32 by default); with bf16=True its
    # model is trained in bf16. graphstep reads the pair the same way.
    config = OptimizerConfig(bf16=True, params_dtype=torch.float32, lr=1e-3)
    assert config.model_dtype == torch.bfloat16
    model = torch.nn.Linear(8, 8)
    with pytest.warns(UserWarning, match="casts the model's params"):
        opt = gs.get_optimizer(config, model)
    assert model.weight.dtype == torch.bfloat16
    opt.close()


def test_the_0_16_1_nesterov_spelling_sets_the_canonical_field_and_replace_keeps_it():
    config = OptimizerConfig(optimizer="muon", muon_use_nesterov=True)
    assert config.muon.nesterov is True and not hasattr(config, "muon_use_nesterov")
    assert config == OptimizerConfig(optimizer="muon", muon_nesterov=True)
    assert config.replace(lr=0.5).muon.nesterov is True
    assert config.replace(muon_nesterov=False).muon.nesterov is False
    assert config.replace(muon_use_nesterov=False).muon.nesterov is False
    with pytest.raises(ValueError, match=r"OptimizerConfig\.muon_use_nesterov=True: contradicts muon_nesterov=False"):
        OptimizerConfig(muon_use_nesterov=True, muon_nesterov=False)


def test_a_float_loss_scale_window_as_megatron_parses_it_is_the_integer():
    assert OptimizerConfig(loss_scale_window=1000.0).loss_scale_window == 1000
    assert type(OptimizerConfig(loss_scale_window=1000.0).loss_scale_window) is int
    with pytest.raises(ValueError, match=r"OptimizerConfig\.loss_scale_window="):
        OptimizerConfig(loss_scale_window=1000.5)


def test_megatron_switches_map_onto_graphsteps_own():
    assert OptimizerConfig(optimizer_cuda_graph=True).capture == "graph"
    assert OptimizerConfig(optimizer_cuda_graph=False).capture == "auto"
    layer_wise = OptimizerConfig(optimizer="muon", use_layer_wise_distributed_optimizer=True)
    assert layer_wise.use_distributed_optimizer


REFUSED = [
    (dict(reuse_grad_buf_for_mxfp8_param_ag=True), "reuse_grad_buf_for_mxfp8_param_ag", "mxfp8"),
    (dict(overlap_param_gather_with_optimizer_step=True), "overlap_param_gather_with_optimizer_step", "not offered"),
    (dict(offload_optimizer_states=True), "offload_optimizer_states", "not offered"),
    (dict(use_layer_wise_distributed_optimizer=True), "use_layer_wise_distributed_optimizer", "muon"),
    (dict(optimizer_cuda_graph=True, capture="eager"), "optimizer_cuda_graph", "capture='eager'"),
    (dict(exp_avg_dtype=torch.bfloat16), "exp_avg_dtype", "use_precision_aware_optimizer"),
    (dict(exp_avg_sq_dtype=torch.float16), "exp_avg_sq_dtype", "use_precision_aware_optimizer"),
    (dict(exp_avg_dtype=torch.int8, use_precision_aware_optimizer=True), "exp_avg_dtype", "fp8"),
    (dict(use_precision_aware_optimizer=True, exp_avg_dtype=torch.bfloat16, optimizer_cpu_offload=True),
     "exp_avg_dtype", "optimizer_cpu_offload"),
    (dict(main_params_dtype=torch.bfloat16, use_precision_aware_optimizer=True), "main_params_dtype", "float16"),
    (dict(use_precision_aware_optimizer=True, optimizer="sgd"), "use_precision_aware_optimizer", "'adam'"),
    (dict(muon_use_nesterov="yes"), "muon_use_nesterov", "bool"),
    (dict(timers=3), "timers", "callable"),
]


@pytest.mark.parametrize("kwargs, field, why", REFUSED, ids=[f for _, f, _ in REFUSED])
def test_what_is_not_offered_is_refused_naming_the_field(kwargs, field, why):
    with pytest.raises(ValueError, match=rf"OptimizerConfig\.{field}=.*{why}"):
        OptimizerConfig(**kwargs)


def test_logging_fields_are_accepted_and_change_nothing():
    model = torch.nn.Linear(4, 4)
    config = OptimizerConfig(barrier_with_L1_time=True, timers=lambda *a: None, config_logger_dir="/nonexistent",
                             use_torch_optimizer_for_cpu_offload=True, soap_shampoo_beta=0.5, capture="eager")
    opt = gs.get_optimizer(config, model)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    opt.close()


def test_megatron_core_own_config_converts_when_installed():
    """Against the installed megatron-core, when there is one (an optional oracle; the lists above hold the
    same facts for machines without it)."""
    megatron_config = pytest.importorskip("megatron.core.optimizer.optimizer_config")
    theirs = megatron_config.OptimizerConfig(lr=1e-4, bf16=True, use_distributed_optimizer=True)
    fields = {f.name: getattr(theirs, f.name) for f in dataclasses.fields(theirs)}
    ours = OptimizerConfig(**fields)
    assert ours.lr == 1e-4 and ours.bf16 and ours.model_dtype == torch.bfloat16 and ours.use_distributed_optimizer
