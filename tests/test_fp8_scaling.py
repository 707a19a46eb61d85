"""The fp8 scaling math against independent oracles, element-exactly.

Oracles: scales in numpy float32 (the same IEEE operations, in the formula's order); fp8 bytes from a
table of all 256 codes of the dtype, nearest value with ties to the even code (round to nearest even),
after the saturating clamp. Nothing here calls torch's fp8 cast to check torch's fp8 cast.
"""

import numpy as np
import pytest
import torch

from graphstep import fp8

DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]
F32_MAX = np.finfo(np.float32).max


def oracle_scale(amax, dtype, margin):
    amax = np.float32(amax)
    if amax == 0 or not np.isfinite(amax):
        return np.float32(1.0)
    with np.errstate(over="ignore", divide="ignore"):
        scale = np.float32(fp8.FP8_MAX[dtype]) / amax / np.float32(2.0 ** margin)
    return np.float32(F32_MAX) if np.isinf(scale) else scale


def _codes(dtype):
    codes = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    values = codes.view(dtype).to(torch.float64).numpy()
    keep = np.isfinite(values) & ~((values == 0) & np.signbit(values))  # one zero, finite codes
    return codes.numpy()[keep], values[keep]


def oracle_bytes(values_f32, scale, dtype):
    """uint8 codes of round-to-nearest-even(clamp(values * scale)), from the code table."""
    limit = fp8.FP8_MAX[dtype]
    scaled = np.clip((np.asarray(values_f32, np.float32) * np.float32(scale)).astype(np.float64), -limit, limit)
    codes, table = _codes(dtype)
    out = []
    for x in scaled:
        dist = np.abs(table - x)
        best = np.flatnonzero(dist == dist.min())
        if len(best) > 1:  # a tie: the even code (mantissa lsb 0)
            best = [b for b in best if codes[b] % 2 == 0]
        code = codes[best[0]]
        if table[best[0]] == 0 and np.signbit(x):
            code = np.uint8(0x80)  # a negative value that rounds to zero keeps its sign: -0
        out.append(code)
    return np.array(out, dtype=np.uint8)


def as_bytes(t):
    return t.view(torch.uint8).numpy()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("margin", [0, 1, 3])
@pytest.mark.parametrize("amax", [0.0, float("inf"), float("nan"), 1e-45, 3.0, 0.7, 1e5, 7e-3])
def test_scale_from_amax_matches_the_formula(dtype, margin, amax):
    scale = fp8.scale_from_amax(torch.tensor(amax, dtype=torch.float32), dtype, margin)
    assert scale.dtype == torch.float32 and scale.dim() == 0
    expected = oracle_scale(amax, dtype, margin)
    assert np.float32(scale.item()).tobytes() == expected.tobytes(), (amax, scale.item(), expected)


def test_special_amaxes_give_one_and_a_tiny_amax_the_largest_finite_scale():
    for bad in (0.0, float("inf"), float("nan")):
        assert fp8.scale_from_amax(torch.tensor(bad), torch.float8_e4m3fn).item() == 1.0
    assert fp8.scale_from_amax(torch.tensor(1e-45), torch.float8_e4m3fn).item() == float(F32_MAX)


def _values(seed=0, n=200, spread=3.0):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(n, generator=g) * spread
    v[:4] = torch.tensor([0.0, -0.0, 1e-30, -1e-30])
    return v


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("margin", [0, 2])
def test_quantize_matches_the_round_to_nearest_even_table(dtype, margin):
    v = _values()
    scale = fp8.scale_from_amax(fp8.amax(v), dtype, margin)
    got = fp8.quantize(v, scale, dtype)
    assert got.dtype == dtype
    np.testing.assert_array_equal(as_bytes(got), oracle_bytes(v.numpy(), scale.item(), dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_values_above_fp8_max_saturate_instead_of_becoming_inf(dtype):
    limit = fp8.FP8_MAX[dtype]
    v = torch.tensor([limit * 1.5, -limit * 4, 1e30, -1e30, limit, limit * 1.0001])
    got = fp8.quantize(v, torch.tensor(1.0), dtype)
    assert torch.isfinite(got.float()).all()
    assert got.float().tolist() == [limit, -limit, limit, -limit, limit, limit]
    np.testing.assert_array_equal(as_bytes(got), oracle_bytes(v.numpy(), 1.0, dtype))


def _state(dtype, n, history_len=1):
    return (torch.zeros(n, dtype=dtype), torch.tensor(1.0), torch.tensor(1.0),
            torch.zeros(history_len, dtype=torch.float32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("margin", [0, 1])
def test_current_scaling_step(dtype, margin):
    v = _values(1) * 50
    data, scale, scale_inv, _ = _state(dtype, v.numel())
    a = fp8.amax(v)
    fp8.requantize_current(v, a, data, scale, scale_inv, torch.tensor(0.0), margin)
    expected_scale = oracle_scale(np.abs(v.numpy()).max(), dtype, margin)
    assert np.float32(scale.item()) == expected_scale
    assert np.float32(scale_inv.item()) == np.float32(1.0) / expected_scale
    np.testing.assert_array_equal(as_bytes(data), oracle_bytes(v.numpy(), expected_scale, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [0.0, float("inf"), float("nan")])
def test_current_scaling_with_a_special_amax_casts_with_scale_one(dtype, bad):
    v = _values(2)
    data, scale, scale_inv, _ = _state(dtype, v.numel())
    scale.fill_(7.0)
    fp8.requantize_current(v, torch.tensor(bad), data, scale, scale_inv, torch.tensor(0.0))
    assert scale.item() == 1.0 and scale_inv.item() == 1.0
    np.testing.assert_array_equal(as_bytes(data), oracle_bytes(v.numpy(), 1.0, dtype))


def oracle_delayed(amaxes, dtype, margin, algo, history_len, first_scale=1.0):
    """(scale used for each cast, scale after each step) for a sequence of amaxes."""
    history = [0.0] * history_len
    scale = np.float32(first_scale)
    used = []
    for a in amaxes:
        used.append(scale)
        history = [a] + history[:-1]
        chosen = max(history) if algo == "max" else history[0]
        scale = oracle_scale(chosen, dtype, margin)
    return used, scale, history


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 2])
def test_delayed_scaling_casts_with_the_previous_scale_and_rolls_the_history(dtype, algo, margin):
    history_len = 3
    data, scale, scale_inv, history = _state(dtype, 200, history_len)
    steps = [_values(s, spread=10.0 ** (s - 2)) for s in range(5)]  # amaxes rise, then the max matters
    steps.append(_values(9, spread=0.01))
    amaxes = [np.float32(np.abs(v.numpy()).max()) for v in steps]
    used, final_scale, final_history = oracle_delayed(amaxes, dtype, margin, algo, history_len)
    for v, scale_used in zip(steps, used):
        fp8.requantize_delayed(v, fp8.amax(v), data, scale, scale_inv, history, torch.tensor(0.0), margin, algo)
        assert np.float32(scale_inv.item()) == np.float32(1.0) / scale_used
        np.testing.assert_array_equal(as_bytes(data), oracle_bytes(v.numpy(), scale_used, dtype))
    assert np.float32(scale.item()) == final_scale
    np.testing.assert_array_equal(history.numpy(), np.array(final_history, np.float32))


@pytest.mark.parametrize("dtype", DTYPES)
def test_delayed_scaling_saturates_values_above_the_scaled_range(dtype):
    data, scale, scale_inv, history = _state(dtype, 4)
    scale.fill_(100.0)  # from a history of small amaxes; the new values are far larger
    v = torch.tensor([1e3, -1e4, 0.5, 1e6])
    fp8.requantize_delayed(v, fp8.amax(v), data, scale, scale_inv, history, torch.tensor(0.0))
    limit = fp8.FP8_MAX[dtype]
    assert data.float().tolist()[0] == limit and data.float().tolist()[1] == -limit
    np.testing.assert_array_equal(as_bytes(data), oracle_bytes(v.numpy(), 100.0, dtype))
    assert np.float32(scale.item()) == oracle_scale(1e6, dtype, 0)


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_skipped_step_changes_nothing_bitwise(recipe, dtype):
    data, scale, scale_inv, history = _state(dtype, 200, 4)
    before_values = _values(3)
    fp8.requantize_delayed(before_values, fp8.amax(before_values), data, scale, scale_inv, history,
                           torch.tensor(0.0))
    snapshot = [t.clone() for t in (data, scale, scale_inv, history)]
    new = _values(4) * 1000
    if recipe == "tensorwise":
        fp8.requantize_current(new, fp8.amax(new), data, scale, scale_inv, torch.tensor(1.0))
    else:
        fp8.requantize_delayed(new, fp8.amax(new), data, scale, scale_inv, history, torch.tensor(1.0), 0, "max")
    for old, now in zip(snapshot, (data, scale, scale_inv, history)):
        assert old.reshape(-1).view(torch.uint8).numpy().tobytes() == \
            now.reshape(-1).view(torch.uint8).numpy().tobytes()


def test_fp8_max_and_unknown_dtypes():
    assert fp8.fp8_max(torch.float8_e4m3fn) == 448.0 and fp8.fp8_max(torch.float8_e5m2) == 57344.0
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8.fp8_max(torch.bfloat16)


def test_amax_propagates_nan_and_is_zero_for_empty():
    assert torch.isnan(fp8.amax(torch.tensor([1.0, float("nan")])))
    assert fp8.amax(torch.zeros(0)).item() == 0.0
