"""Loss scalers against a plain-Python reference of Megatron-Core's rule (plus graphstep's cap at 2**127),
with random non-finite steps and long clean stretches."""

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import capture
from graphstep.config import OptimizerConfig
from graphstep.step.scaler import MAX_LOSS_SCALE, ConstantLossScaler, DynamicLossScaler, scaler_from_config


class ReferenceScaler:
    """The documented rule, written as plainly as possible (the test oracle)."""

    def __init__(self, scale, min_scale, growth_interval, hysteresis, growth_factor=2.0, backoff_factor=0.5):
        self.scale, self.min_scale = scale, min_scale
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_tracker, self.hysteresis_tracker = 0, hysteresis

    def update(self, found_inf: bool):
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale = min(self.scale * self.growth_factor, MAX_LOSS_SCALE)  # never inf


def state(scaler):
    return (scaler.scale.item(), scaler.growth_tracker.item(), scaler.hysteresis_tracker.item(),
            scaler.inv_scale.item())


def ref_state(ref):
    return (ref.scale, ref.growth_tracker, ref.hysteresis_tracker, 1.0 / ref.scale)


class GradsWithInjectedNonFinites:
    """Grads as the step sees them; some steps get an inf or a NaN at a random place. ``found_inf`` comes
    from torch's own non-finite check (the one the unscale stage uses), as a 0-d fp32 tensor."""

    def __init__(self, seed):
        self.rng = random.Random(seed)
        self.grads = [torch.zeros(7), torch.zeros(3, 5)]
        self.found_inf = torch.zeros(())

    def next(self, inv_scale):
        # Bursts of bad steps drive the scale to its minimum; long clean runs let it grow.
        bad = self.rng.random() < (0.6 if self.rng.random() < 0.3 else 0.1)
        for grad in self.grads:
            grad.normal_(generator=torch.Generator().manual_seed(self.rng.randrange(2**31)))
        if bad:
            grad = self.rng.choice(self.grads).view(-1)
            grad[self.rng.randrange(grad.numel())] = self.rng.choice([math.inf, -math.inf, math.nan])
        self.found_inf.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_(self.grads, self.found_inf, inv_scale)
        return bad


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("hysteresis", [1, 2, 3])
def test_dynamic_scaler_matches_the_rule_over_2000_steps(seed, hysteresis):
    ours = DynamicLossScaler(2.0**16, min_scale=4.0, growth_interval=5, hysteresis=hysteresis, device="cpu")
    ref = ReferenceScaler(2.0**16, 4.0, 5, hysteresis)
    grads = GradsWithInjectedNonFinites(seed * 10 + hysteresis)
    hit_min = grew = backed_off = 0
    for _ in range(2000):
        bad = grads.next(ours.inv_scale)
        assert grads.found_inf.item() == float(bad)
        before = ref.scale
        ours.update(grads.found_inf)
        ref.update(bad)
        assert state(ours) == ref_state(ref)
        hit_min += ref.scale == 4.0
        grew += ref.scale > before
        backed_off += ref.scale < before
    assert hit_min > 0 and grew > 0 and backed_off > 0  # every branch of the rule was exercised


def test_clean_stretches_never_grow_the_scale_to_inf():
    """All-zero grads are clean steps; from a high scale with a short window, uncapped growth
    reached inf after 8 doublings, and inf never backs off (inf * 0.5 = inf): every later step skipped."""
    scaler = DynamicLossScaler(2.0**120, min_scale=1.0, growth_interval=1, hysteresis=2, device="cpu")
    clean = torch.zeros(())
    for _ in range(20):
        scaler.update(clean)
        assert math.isfinite(scaler.scale.item()) and scaler.inv_scale.item() > 0
    assert scaler.scale.item() == MAX_LOSS_SCALE == 2.0**127
    assert scaler.inv_scale.item() == 2.0**-127
    for _ in range(2):  # hysteresis 2: the second non-finite step backs off, from the cap as from anywhere
        scaler.update(torch.ones(()))
    assert scaler.scale.item() == 2.0**126


def test_the_cap_matches_torchs_refusal_to_grow_into_inf():
    """torch's own dynamic scaler keeps the scale when the grown one would not be finite; from 2**127 with a
    factor 2 that is the same value graphstep's cap gives."""
    ours = DynamicLossScaler(2.0**127, min_scale=1.0, growth_interval=1, hysteresis=1, device="cpu")
    torch_scale, torch_tracker = torch.tensor(2.0**127), torch.zeros((), dtype=torch.int32)
    for _ in range(3):
        ours.update(torch.zeros(()))
        torch._amp_update_scale_(torch_scale, torch_tracker, torch.zeros(()), 2.0, 0.5, 1)
    assert ours.scale.item() == torch_scale.item() == 2.0**127


@st.composite
def scaler_runs(draw):
    """Settings and a found_inf sequence: runs of clean steps (some long) and bursts of non-finite ones."""
    exponent = draw(st.integers(-30, 127))
    mantissa = draw(st.sampled_from([1.0, 1.5, 1.75]))
    initial = min(mantissa * 2.0**exponent, 2.0**127)
    min_scale = initial / 2.0**draw(st.integers(0, 40))
    factors = draw(st.sampled_from([(2.0, 0.5), (4.0, 0.25), (2.0, 0.25)]))
    runs = draw(st.lists(st.tuples(st.booleans(), st.integers(1, 60)), min_size=1, max_size=8))
    flags = [bad for bad, length in runs for _ in range(length)][:250]
    return dict(initial=initial, min_scale=min_scale, growth_interval=draw(st.integers(1, 6)),
                hysteresis=draw(st.integers(1, 4)), factors=factors, flags=flags)


@settings(max_examples=40, deadline=None)
@given(scaler_runs())
def test_sweep_scale_stays_finite_within_bounds_and_follows_the_rule(run):
    growth, backoff = run["factors"]
    ours = DynamicLossScaler(run["initial"], run["min_scale"], run["growth_interval"], run["hysteresis"],
                             device="cpu", growth_factor=growth, backoff_factor=backoff)
    ref = ReferenceScaler(run["initial"], run["min_scale"], run["growth_interval"], run["hysteresis"],
                          growth_factor=growth, backoff_factor=backoff)
    found_inf = torch.zeros(())
    for bad in run["flags"]:
        found_inf.fill_(float(bad))
        ours.update(found_inf)
        ref.update(bad)
        scale = ours.scale.item()
        assert math.isfinite(scale) and run["min_scale"] <= scale <= 2.0**127
        assert 0 < ours.inv_scale.item() < math.inf
        # Powers-of-two factors keep fp32 and the float64 reference exact: demand equality.
        assert state(ours)[:3] == ref_state(ref)[:3]


def test_non_default_factors_and_an_uneven_minimum():
    ours = DynamicLossScaler(100.0, min_scale=3.0, growth_interval=2, hysteresis=2, device="cpu",
                             growth_factor=4.0, backoff_factor=0.25)
    ref = ReferenceScaler(100.0, 3.0, 2, 2, growth_factor=4.0, backoff_factor=0.25)
    rng = random.Random(7)
    for _ in range(500):
        bad = rng.random() < 0.4
        ours.update(torch.tensor(float(bad)))
        ref.update(bad)
        assert state(ours)[:3] == ref_state(ref)[:3]
        assert ours.inv_scale.item() == torch.reciprocal(torch.tensor(ref.scale)).item()


def test_each_further_inf_backs_off_again_and_growth_refills_hysteresis():
    scaler = DynamicLossScaler(64.0, 1.0, growth_interval=2, hysteresis=2, device="cpu")
    seen = []
    for flag in (1, 1, 1, 0, 0, 1):
        scaler.update(torch.tensor(float(flag)))
        seen.append(state(scaler)[:3])
    assert seen == [(64.0, 0, 1), (32.0, 0, 0), (16.0, 0, -1), (16.0, 1, -1), (32.0, 0, 2), (32.0, 0, 1)]


@pytest.mark.parametrize("make", [lambda: DynamicLossScaler(1024.0, 1.0, 2, 2, device="cpu"),
                                  lambda: ConstantLossScaler(8.0, device="cpu")])
def test_update_runs_on_device_without_a_host_sync_and_in_place(make):
    scaler = make()
    tensors = [scaler.scale, scaler.inv_scale] + [getattr(scaler, n) for n in ("growth_tracker",
                                                                               "hysteresis_tracker")
                                                  if hasattr(scaler, n)]
    addresses = [t.data_ptr() for t in tensors]
    found_inf = torch.zeros(())
    for flag in (0.0, 1.0, 1.0, 0.0, 0.0, 0.0):
        found_inf.fill_(flag)
        # capture's own detector of host syncs and data-dependent shapes (it runs the update once)
        assert capture.check(lambda: scaler.update(found_inf)) == []
    assert [t.data_ptr() for t in tensors] == addresses
    assert all(t.dtype == torch.float32 and t.dim() == 0 for t in tensors)
    if isinstance(scaler, DynamicLossScaler):
        assert scaler.scale.item() == 1024.0  # backed off once (512), then grew once


@pytest.mark.parametrize("initial, p_bad", [(2.0**10, 0.35), (2.0**120, 0.1)])
def test_a_captured_update_replays_the_rule(initial, p_bad):
    """The replay backend re-runs the recorded ops only (no Python): any branch on a value would freeze.
    From 2**120 with few bad steps the captured update spends most of its time at the 2**127 cap."""
    scaler = DynamicLossScaler(initial, min_scale=2.0, growth_interval=3, hysteresis=2, device="cpu")
    ref = ReferenceScaler(initial, 2.0, 3, 2)
    found_inf = torch.zeros(())
    assert capture.check(lambda: scaler.update(found_inf)) == []
    ref.update(False)  # check() ran one (clean) update
    step = capture.graph(lambda: scaler.update(found_inf), warmup=1, backend="replay")
    rng = random.Random(3)
    for _ in range(300):
        bad = rng.random() < p_bad
        found_inf.fill_(float(bad))
        step()
        ref.update(bad)
        assert state(scaler) == ref_state(ref)
    assert step.captured and step.num_replays > 250


def test_state_dict_round_trip_copies_in_place():
    a = DynamicLossScaler(256.0, 1.0, 3, 2, device="cpu")
    for flag in (1.0, 1.0, 0.0):
        a.update(torch.tensor(flag))
    saved = a.state_dict()
    assert saved["scale"].data_ptr() != a.scale.data_ptr()  # cloned: later updates do not change it
    b = DynamicLossScaler(2.0**32, 1.0, 3, 2, device="cpu")
    addresses = [t.data_ptr() for t in (b.scale, b.inv_scale, b.growth_tracker, b.hysteresis_tracker)]
    b.load_state_dict(saved)
    assert [t.data_ptr() for t in (b.scale, b.inv_scale, b.growth_tracker, b.hysteresis_tracker)] == addresses
    assert state(b) == state(a) == (128.0, 1.0, 0.0, 1 / 128)
    for flag in (0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0):  # both continue identically
        a.update(torch.tensor(flag))
        b.update(torch.tensor(flag))
        assert state(b) == state(a)
    assert saved["scale"].item() == 128.0  # the saved copy did not move with them

    constant = ConstantLossScaler(8.0, device="cpu")
    constant.update(torch.tensor(1.0))
    assert (constant.scale.item(), constant.inv_scale.item()) == (8.0, 0.125)
    other = ConstantLossScaler(1.0, device="cpu")
    address = other.scale.data_ptr()
    other.load_state_dict(constant.state_dict())
    assert (other.scale.data_ptr(), other.scale.item(), other.inv_scale.item()) == (address, 8.0, 0.125)


@pytest.mark.parametrize("make", [lambda: ConstantLossScaler(0.001, device="cpu"),
                                  lambda: DynamicLossScaler(1000.0, 1.0, 3, 2, device="cpu")])
def test_inverse_scale_is_the_fp32_reciprocal_before_and_after_a_resume(make):
    # Megatron-Core's inv_scale: the fp32 scale's reciprocal rounded to fp32 (999.99994 for 0.001). Built from
    # the Python float instead (1000.0), a run resumed from its own state_dict unscaled by another number.
    scaler = make()
    expected = scaler.scale.double().reciprocal().float()
    assert torch.equal(scaler.inv_scale, expected)
    scaler.load_state_dict(scaler.state_dict())
    assert torch.equal(scaler.inv_scale, expected)


@pytest.mark.parametrize("make, state_dict, message", [
    (lambda: DynamicLossScaler(8.0, 1.0, 2, 2, device="cpu"), {"scale": torch.tensor(4.0)},
     r"DynamicLossScaler.load_state_dict: missing \['growth_tracker', 'hysteresis_tracker'\]"),
    (lambda: ConstantLossScaler(8.0, device="cpu"), {"scale": torch.tensor(4.0), "x": 1}, r"unknown \['x'\]"),
])
def test_load_state_dict_names_missing_and_unknown_keys(make, state_dict, message):
    with pytest.raises(ValueError, match=message):
        make().load_state_dict(state_dict)


GOOD = {"scale": torch.tensor(64.0), "growth_tracker": torch.tensor(1.0), "hysteresis_tracker": torch.tensor(1.0)}


@pytest.mark.parametrize("key, value, message", [
    ("scale", torch.tensor(math.inf), r"'scale'=inf must lie in \[2\*\*-126, 2\*\*127\]"),
    ("scale", torch.tensor(math.nan), "'scale'=nan"),
    ("scale", 0.0, "'scale'=0.0"),
    ("scale", 2.0**128, "'scale'="),
    ("scale", torch.ones(2), "'scale' must be a number or a one-element real tensor"),
    ("scale", "64", "'scale' must be a number"),
    ("growth_tracker", torch.tensor(1.5), "'growth_tracker'=1.5 must be a whole number"),
    ("growth_tracker", -1, "'growth_tracker'=-1.0 must be >= 0"),
    ("hysteresis_tracker", torch.tensor(math.nan), "'hysteresis_tracker'=nan must be a whole number"),
    ("hysteresis_tracker", True, "'hysteresis_tracker' must be a number"),
])
def test_a_refused_state_dict_names_the_key_and_changes_nothing(key, value, message):
    scaler = DynamicLossScaler(8.0, 1.0, 2, 2, device="cpu")
    scaler.update(torch.ones(()))
    before = state(scaler)
    bad = {**GOOD, key: value}
    with pytest.raises(ValueError, match=message):
        scaler.validate_state_dict(bad)
    with pytest.raises(ValueError, match=message):
        scaler.load_state_dict(bad)
    assert state(scaler) == before
    scaler.validate_state_dict(GOOD)
    scaler.load_state_dict(GOOD)
    assert state(scaler) == (64.0, 1.0, 1.0, 1 / 64)


def test_a_state_dict_that_is_not_a_dict_is_named():
    for scaler in (DynamicLossScaler(8.0, 1.0, 2, 2, device="cpu"), ConstantLossScaler(8.0, device="cpu")):
        with pytest.raises(ValueError, match="expected a dict with keys"):
            scaler.load_state_dict([("scale", 4.0)])
        assert scaler.scale.item() == 8.0


def test_update_refuses_a_found_inf_of_the_wrong_kind():
    scaler = DynamicLossScaler(8.0, 1.0, 2, 2, device="cpu")
    for bad in (torch.zeros(2), torch.zeros((), dtype=torch.bool), 1.0):
        with pytest.raises(TypeError, match="found_inf must be a one-element float tensor"):
            scaler.update(bad)


def test_choice_follows_megatron_core():
    assert isinstance(scaler_from_config(OptimizerConfig(fp16=True), "cpu"), DynamicLossScaler)
    assert isinstance(scaler_from_config(OptimizerConfig(fp16=True, loss_scale=128.0), "cpu"), ConstantLossScaler)
    assert isinstance(scaler_from_config(OptimizerConfig(bf16=True, loss_scale=4.0), "cpu"), ConstantLossScaler)
    assert scaler_from_config(OptimizerConfig(bf16=True), "cpu") is None
    assert scaler_from_config(OptimizerConfig(), "cpu") is None
    dynamic = scaler_from_config(OptimizerConfig(fp16=True, initial_loss_scale=64.0, loss_scale_window=7,
                                                 hysteresis=3, min_loss_scale=2.0), "cpu")
    assert (state(dynamic), dynamic.growth_interval, dynamic.hysteresis, dynamic.min_scale) == \
        ((64.0, 0.0, 3.0, 1 / 64), 7, 3, 2.0)
    assert dynamic.scale.device == torch.device("cpu")


@pytest.mark.parametrize("kwargs, message", [
    (dict(initial_scale=0.0, min_scale=1.0, growth_interval=1, hysteresis=1), "initial_scale=0.0"),
    (dict(initial_scale=1.0, min_scale=math.inf, growth_interval=1, hysteresis=1), "min_scale=inf"),
    (dict(initial_scale=2.0**128, min_scale=1.0, growth_interval=1, hysteresis=1), r"\[2\*\*-126, 2\*\*127\]"),
    (dict(initial_scale=1.0, min_scale=1.0, growth_interval=0, hysteresis=1), "growth_interval=0"),
    (dict(initial_scale=1.0, min_scale=1.0, growth_interval=2.5, hysteresis=1), "growth_interval=2.5"),
    (dict(initial_scale=1.0, min_scale=1.0, growth_interval=1, hysteresis=0), "hysteresis=0"),
    (dict(initial_scale=1.0, min_scale=1.0, growth_interval=1, hysteresis=1, growth_factor=1.0), "growth_factor"),
    (dict(initial_scale=1.0, min_scale=1.0, growth_interval=1, hysteresis=1, backoff_factor=1.5), "backoff_factor"),
])
def test_bad_scaler_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DynamicLossScaler(device="cpu", **kwargs)


@pytest.mark.parametrize("scale", [0.0, -1.0, math.inf, "8", 2.0**128, 1e-40])
def test_bad_constant_scale_is_named(scale):
    with pytest.raises(ValueError, match="ConstantLossScaler: scale="):
        ConstantLossScaler(scale, device="cpu")


def test_the_dynamic_rule_settings_are_fixed_at_construction():
    # The rule reads a device copy of them made at construction: a later assignment would be ignored.
    scaler = DynamicLossScaler(2.0**16, min_scale=1.0, growth_interval=5, hysteresis=2, device="cpu")
    for name in ("min_scale", "growth_interval", "hysteresis", "growth_factor", "backoff_factor"):
        with pytest.raises(AttributeError, match="fixed at construction"):
            setattr(scaler, name, getattr(scaler, name))
    assert scaler.growth_interval == 5 and scaler.hysteresis == 2
