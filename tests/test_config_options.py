"""Each family's options live in its module (``MuonOptions`` in graphstep/families/muon.py), held by the config
field named after the family; Megatron-Core's flat names (``muon_momentum``) still build the same config
through one adapter (graphstep/config/megatron.py), in the constructor and in ``replace``."""

import dataclasses

import pytest
import torch

import graphstep as gs
from graphstep.config import AdamOptions, AdEMAMixOptions, LionOptions, MuonOptions, OptimizerConfig, SGDOptions
from graphstep.config.megatron import family_options, flat_names
from graphstep.families import FAMILIES

# A valid value other than the default for every flat name; a new option must be added here.
OTHER_VALUES = {
    "adam_beta1": 0.8, "adam_beta2": 0.99, "adam_eps": 1e-6, "sgd_momentum": 0.5, "sgd_nesterov": True,
    "lion_beta1": 0.9, "lion_beta2": 0.99, "muon_momentum": 0.9, "muon_nesterov": True, "muon_num_ns_steps": 10,
    "muon_coefficient_type": "simple", "muon_scale_mode": "shape_scaling", "muon_extra_scale_factor": 0.2,
    "muon_fp32_matmul_prec": "highest", "muon_split_qkv": False, "muon_scalar_optimizer": "lion",
    "muon_tp_mode": "duplicated", "ademamix_beta3": 0.999, "ademamix_alpha": 3.0,
}
FLAT = flat_names(OptimizerConfig)


def test_every_family_holds_its_options_in_its_module():
    options = family_options(OptimizerConfig)
    assert set(options) == set(FAMILIES)
    for name, cls in options.items():
        assert cls.__module__ == f"graphstep.families.{name}", cls
        assert dataclasses.fields(cls) and cls.__dataclass_params__.frozen
    assert set(OTHER_VALUES) == set(FLAT)


@pytest.mark.parametrize("flat", sorted(OTHER_VALUES))
def test_a_flat_name_sets_its_familys_option(flat):
    field, option = FLAT[flat]
    value = OTHER_VALUES[flat]
    extra = {"sgd_momentum": 0.5} if flat == "sgd_nesterov" else {}
    options = {option: value, **{FLAT[name][1]: other for name, other in extra.items()}}
    nested = {field: family_options(OptimizerConfig)[field](**options)}
    by_flat = OptimizerConfig(**{flat: value, **extra})
    assert getattr(getattr(by_flat, field), option) == value
    assert by_flat == OptimizerConfig(**nested)
    assert OptimizerConfig(**extra).replace(**{flat: value}) == by_flat
    assert dataclasses.replace(OptimizerConfig(**extra), **{flat: value}) == by_flat


def test_the_nested_form_reads_as_documented():
    config = OptimizerConfig(optimizer="muon", muon=MuonOptions(momentum=0.9, nesterov=True))
    assert config.muon.momentum == 0.9 and config.muon.nesterov and config.muon.num_ns_steps == 5
    assert config == OptimizerConfig(optimizer="muon", muon_momentum=0.9, muon_nesterov=True)
    assert OptimizerConfig().adam == AdamOptions() and OptimizerConfig().sgd == SGDOptions()
    assert OptimizerConfig().lion == LionOptions() and OptimizerConfig().ademamix == AdEMAMixOptions()


def test_a_flat_name_changes_one_option_and_keeps_the_others():
    config = OptimizerConfig(optimizer="muon", muon=MuonOptions(momentum=0.9, num_ns_steps=10))
    changed = config.replace(muon_nesterov=True)
    assert changed.muon == MuonOptions(momentum=0.9, num_ns_steps=10, nesterov=True)
    beside = OptimizerConfig(muon=MuonOptions(momentum=0.9), muon_tp_mode="duplicated")
    assert beside.muon == MuonOptions(momentum=0.9, tp_mode="duplicated")


def test_code_reads_the_options_not_flat_aliases():
    assert not hasattr(OptimizerConfig(), "muon_momentum") and not hasattr(OptimizerConfig(), "adam_eps")


@pytest.mark.parametrize("kwargs, message", [
    (dict(muon_momentum=1.5), r"OptimizerConfig\.muon_momentum=1\.5 \(MuonOptions\.momentum\): must lie in"),
    (dict(muon=MuonOptions(momentum=1.5)), r"OptimizerConfig\.muon_momentum=1\.5 \(MuonOptions\.momentum\)"),
    (dict(adam=AdamOptions(eps=1e-46)), r"OptimizerConfig\.adam_eps=1e-46 \(AdamOptions\.eps\): must be at least"),
    (dict(lion=LionOptions(beta2="0.9")), r"OptimizerConfig\.lion_beta2='0\.9' \(LionOptions\.beta2\): must be a"),
    (dict(sgd=SGDOptions(momentum=0.0, nesterov=True)), r"OptimizerConfig\.sgd_nesterov=True \(SGDOptions\.nesterov\)"),
    (dict(muon=MuonOptions(num_ns_steps=7)), r"OptimizerConfig\.muon_num_ns_steps=7 .*multiple of 5"),
    (dict(muon=MuonOptions(scalar_optimizer="sgd")), r"OptimizerConfig\.muon_scalar_optimizer='sgd'.*'adam', 'lion'"),
    (dict(ademamix=AdEMAMixOptions(alpha=-1.0)), r"OptimizerConfig\.ademamix_alpha=-1\.0 \(AdEMAMixOptions\.alpha\)"),
    (dict(muon={"momentum": 0.9}), r"OptimizerConfig\.muon=\{'momentum': 0\.9\}: must be a MuonOptions, got dict"),
    (dict(muon=0.9, muon_momentum=0.9), r"OptimizerConfig\.muon=0\.9: must be a MuonOptions, got float"),
])
def test_a_bad_option_is_refused_naming_both_spellings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OptimizerConfig(**kwargs)


def test_misspelled_options_get_the_closest_names():
    with pytest.raises(TypeError, match=r"MuonOptions has no field 'momentun': did you mean 'momentum'\?"):
        MuonOptions(momentun=0.9)
    with pytest.raises(TypeError, match=r"OptimizerConfig has no field 'muon_momentun': did you mean 'muon_momentum'"):
        OptimizerConfig(muon_momentun=0.9)
    with pytest.raises(TypeError, match=r"'muon_tp_mod': did you mean 'muon_tp_mode'"):
        OptimizerConfig().replace(muon_tp_mod="duplicated")
    with pytest.raises(TypeError, match=r"'timer': did you mean 'timers'"):  # a name accepted without effect
        OptimizerConfig(timer=None)


def test_options_are_frozen_values():
    options = MuonOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.momentum = 0.5
    assert hash(OptimizerConfig(muon=options)) == hash(OptimizerConfig())


def test_a_megatron_override_may_repeat_a_flat_name_equal_to_the_config():
    # Megatron-Core's consistency check compares override keys that are config fields with the config.
    config = OptimizerConfig(adam_beta1=0.8)
    key = gs.ParamKey(name="*")
    assert gs.check_config_overrides_consistency(config, {key: {"adam_beta1": 0.8, "max_lr": 1e-3}})
    assert gs.check_config_overrides_consistency(config, {key: {"overlap_param_gather_with_optimizer_step": False}})
    with pytest.raises(ValueError, match=r"adam_beta1=0\.9 differs from the config's 0\.8"):
        gs.check_config_overrides_consistency(config, {key: {"adam_beta1": 0.9}})


def test_the_nested_form_trains_as_the_flat_form():
    def trained(config):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
        with gs.get_optimizer(config.replace(capture="eager"), model) as opt:
            for step in range(3):
                model(torch.randn(4, 16, generator=torch.Generator().manual_seed(step))).square().sum().backward()
                opt.step()
                opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    flat = OptimizerConfig(optimizer="muon", lr=1e-2, muon_momentum=0.8, muon_nesterov=True, lion_beta1=0.9,
                           muon_scalar_optimizer="lion")
    nested = OptimizerConfig(optimizer="muon", lr=1e-2, muon=MuonOptions(momentum=0.8, nesterov=True,
                                                                          scalar_optimizer="lion"),
                             lion=LionOptions(beta1=0.9))
    assert all(torch.equal(a, b) for a, b in zip(trained(flat), trained(nested)))
