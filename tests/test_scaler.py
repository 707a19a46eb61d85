"""Loss scalers against a plain-Python reference of Megatron-Core's rule, with random non-finite steps."""

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphstep.config import OptimizerConfig
from graphstep.scaler import ConstantLossScaler, DynamicLossScaler, scaler_from_config


class ReferenceScaler:
    """The documented rule, written as plainly as possible (the test oracle)."""

    def __init__(self, scale, min_scale, growth_interval, hysteresis):
        self.scale, self.min_scale = scale, min_scale
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self.growth_tracker, self.hysteresis_tracker = 0, hysteresis

    def update(self, found_inf: bool):
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * 0.5, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale = self.scale * 2.0


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("hysteresis", [1, 2, 3])
def test_dynamic_scaler_matches_the_rule_over_2000_steps(seed, hysteresis):
    rng = random.Random(seed)
    ours = DynamicLossScaler(2.0**16, min_scale=4.0, growth_interval=5, hysteresis=hysteresis, device="cpu")
    ref = ReferenceScaler(2.0**16, 4.0, 5, hysteresis)
    found_inf = torch.zeros(())
    hit_min = grew = 0
    for _ in range(2000):
        # Bursts of bad steps drive the scale down to the minimum; long clean runs make it grow.
        bad = rng.random() < (0.6 if rng.random() < 0.3 else 0.1)
        found_inf.fill_(float(bad))
        before = ref.scale
        ours.update(found_inf)
        ref.update(bad)
        assert ours.scale.item() == ref.scale
        assert ours.growth_tracker.item() == ref.growth_tracker
        assert ours.hysteresis_tracker.item() == ref.hysteresis_tracker
        assert ours.inv_scale.item() == 1.0 / ref.scale
        hit_min += ref.scale == 4.0
        grew += ref.scale > before
    assert hit_min > 0 and grew > 0  # both ends of the rule were exercised


def test_update_runs_on_device_without_a_host_sync_and_in_place():
    class NoSync(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default or torch.Tag.data_dependent_output in func.tags \
                    or torch.Tag.dynamic_output_shape in func.tags:
                raise AssertionError(f"host sync: {func}")
            return func(*args, **(kwargs or {}))

    scaler = DynamicLossScaler(1024.0, 1.0, 2, 2, device="cpu")
    addresses = [t.data_ptr() for t in (scaler.scale, scaler.inv_scale, scaler.growth_tracker,
                                        scaler.hysteresis_tracker)]
    with NoSync():
        for flag in (0.0, 1.0, 1.0, 0.0, 0.0, 0.0):
            scaler.update(torch.tensor(flag))
    assert [t.data_ptr() for t in (scaler.scale, scaler.inv_scale, scaler.growth_tracker,
                                   scaler.hysteresis_tracker)] == addresses
    assert scaler.scale.item() == 1024.0  # backed off once (512), then grew once


def test_state_dict_round_trip_copies_in_place():
    a = DynamicLossScaler(256.0, 1.0, 3, 2, device="cpu")
    for flag in (1.0, 1.0, 0.0):
        a.update(torch.tensor(flag))
    b = DynamicLossScaler(2.0**32, 1.0, 3, 2, device="cpu")
    address = b.scale.data_ptr()
    b.load_state_dict(a.state_dict())
    assert b.scale.data_ptr() == address
    assert (b.scale.item(), b.growth_tracker.item(), b.hysteresis_tracker.item(), b.inv_scale.item()) == \
        (a.scale.item(), a.growth_tracker.item(), a.hysteresis_tracker.item(), a.inv_scale.item())
    c = ConstantLossScaler(8.0, device="cpu")
    c.update(torch.tensor(1.0))
    assert c.scale.item() == 8.0 and c.inv_scale.item() == 0.125


def test_choice_follows_megatron_core():
    assert isinstance(scaler_from_config(OptimizerConfig(fp16=True), "cpu"), DynamicLossScaler)
    assert isinstance(scaler_from_config(OptimizerConfig(fp16=True, loss_scale=128.0), "cpu"), ConstantLossScaler)
    assert isinstance(scaler_from_config(OptimizerConfig(bf16=True, loss_scale=4.0), "cpu"), ConstantLossScaler)
    assert scaler_from_config(OptimizerConfig(bf16=True), "cpu") is None
    assert scaler_from_config(OptimizerConfig(), "cpu") is None
    dynamic = scaler_from_config(OptimizerConfig(fp16=True, initial_loss_scale=64.0, loss_scale_window=7,
                                                 hysteresis=3, min_loss_scale=2.0), "cpu")
    assert (dynamic.scale.item(), dynamic.growth_interval, dynamic.hysteresis, dynamic.min_scale) == (64.0, 7, 3, 2.0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(initial_scale=0.0, min_scale=1.0, growth_interval=1, hysteresis=1), "both > 0"),
    (dict(initial_scale=1.0, min_scale=1.0, growth_interval=0, hysteresis=1), "growth_interval=0"),
    (dict(initial_scale=1.0, min_scale=1.0, growth_interval=1, hysteresis=1, backoff_factor=1.5), "backoff_factor"),
])
def test_bad_scaler_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DynamicLossScaler(device="cpu", **kwargs)
