"""The native Adam loops (graphstep/native/update_loops.py, stored_loops.py) against the ``torch.compile``d loops and
passes they stand in for, their casts against torch's, and the start they are for: a build and first step that
import no compiler of torch's and trace nothing."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from graphstep.kernels import compiled, compiled_stored
from graphstep.native import stored_loops, update_loops

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def native():
    library = update_loops.library()
    if library is None and "no C++ compiler" in update_loops.status():
        pytest.skip(update_loops.status())
    assert library is not None, update_loops.status()
    return library


def _groups(seed: int, numels: list[list[int]]) -> list:
    """Adam groups of views of ``numels`` with random values and hyperparameters of their own (fp64, as the CPU
    engine keeps them)."""
    generator = torch.Generator().manual_seed(seed)
    groups = []
    for index, lengths in enumerate(numels):
        params, grads, exp_avgs, exp_avg_sqs = ([torch.randn(n, generator=generator) for n in lengths]
                                                for _ in range(4))
        exp_avg_sqs = [v.abs() * 1e-2 for v in exp_avg_sqs]
        hyper = dict(lr=3e-3 * (index + 1), beta1=0.9 - 0.05 * index, beta2=0.999 - 0.01 * index,
                     weight_decay=0.1 * index, eps=1e-8 * (index + 1))
        hyper = {name: torch.tensor(value, dtype=torch.float64) for name, value in hyper.items()}
        groups.append((params, grads, exp_avgs, exp_avg_sqs, hyper))
    return groups


def _copy(groups: list) -> list:
    return [tuple([t.clone() for t in tensors] for tensors in group[:4]) + (group[4],) for group in groups]


def _values(groups: list) -> list:
    return [t for group in groups for tensors in group[:4] for t in tensors]


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal values, a NaN matching a NaN."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0, float("inf"), float("-inf")),
                                                             b.nan_to_num(0.0, float("inf"), float("-inf")))


def _lists(groups: list) -> list:
    """All groups' params, grads, exp_avgs and exp_avg_sqs: the four lists of one call."""
    return [[t for group in groups for t in group[k]] for k in range(4)]


def _step_both_ways(groups: list, through_compile: list, **scalars) -> None:
    assert compiled.native_adam_covers(*_lists(groups))
    compiled.adam_groups(groups, **scalars)
    with update_loops.off():
        assert not compiled.native_adam_covers(*_lists(through_compile))
        compiled.adam_groups(through_compile, **scalars)


# Each layout and each pair of flags is a compile of its own on the torch.compile side: the grid is kept to what
# changes the arithmetic (the coefficients' math with and without decoupled decay and a grad scale, computed in
# the compiled graph on one side and by eager ops on the other; views of every cut; many groups' rows).
NUMELS = {"one view": [[1]], "rows and tails": [[64, 65, 4099, 3]], "three groups": [[130, 7], [1000], [63, 64]],
          "thirteen groups": [[17 + 3 * g] for g in range(13)]}


@pytest.mark.parametrize("numels", list(NUMELS.values()), ids=list(NUMELS))
def test_the_native_loop_updates_bitwise_as_the_torch_compiled_loop_over_every_layout(native, numels):
    groups = _groups(len(numels) + len(numels[0]), numels)
    through_compile = _copy(groups)
    for step, scale in ((1, 1024.0), (2, 0.37), (1000, 1.0)):
        _step_both_ways(groups, through_compile, step=torch.tensor(float(step)), decoupled=True,
                        grad_scale=torch.tensor(scale), found_inf=torch.zeros(()))
        assert all(_equal(a, b) for a, b in zip(_values(groups), _values(through_compile)))
    assert not torch.equal(groups[0][0][0], _groups(len(numels) + len(numels[0]), numels)[0][0][0])


@pytest.mark.parametrize("decoupled", [True, False], ids=["AdamW", "Adam"])
@pytest.mark.parametrize("scaled", [True, False], ids=["grad scale", "no grad scale"])
def test_the_native_loop_updates_bitwise_as_the_torch_compiled_loop_with_each_flag(native, decoupled, scaled):
    groups = _groups(3, NUMELS["three groups"])
    through_compile = _copy(groups)
    for step in (1, 7):
        _step_both_ways(groups, through_compile, step=torch.tensor(float(step)), decoupled=decoupled,
                        grad_scale=torch.tensor(8.0) if scaled else None, found_inf=torch.zeros(()))
        assert all(_equal(a, b) for a, b in zip(_values(groups), _values(through_compile)))


def test_a_skipped_step_writes_nothing_and_non_finite_values_go_through_as_they_do_compiled(native):
    groups = _groups(5, [[300, 64]])
    groups[0][1][0][::7] = float("inf")  # grads with infs and NaNs: an applied step spreads them as torch does
    groups[0][1][1][::5] = float("nan")
    before = [t.clone() for t in _values(groups)]
    skip = dict(step=torch.tensor(3.0), decoupled=True, grad_scale=torch.tensor(2.0), found_inf=torch.ones(()))
    compiled.adam_groups(groups, **skip)
    assert all(_equal(a, b) for a, b in zip(_values(groups), before))
    through_compile = _copy(groups)
    _step_both_ways(groups, through_compile, **{**skip, "found_inf": torch.zeros(())})
    assert all(_equal(a, b) for a, b in zip(_values(groups), _values(through_compile)))
    assert groups[0][0][1].isnan().any() and not torch.equal(groups[0][0][0], before[0])


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_thread_count_changes_no_bit(native, threads):
    groups, reference = _groups(9, [[100_003]]), _groups(9, [[100_003]])
    scalars = dict(step=torch.tensor(4.0), decoupled=True, grad_scale=torch.tensor(3.0), found_inf=torch.zeros(()))
    was = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        compiled.adam_groups(groups, **scalars)
        torch.set_num_threads(1)
        compiled.adam_groups(reference, **scalars)
    finally:
        torch.set_num_threads(was)
    assert all(torch.equal(a, b) for a, b in zip(_values(groups), _values(reference)))


def test_views_the_native_loop_cannot_take_go_through_torch_compile(native):
    params, grads, exp_avgs, exp_avg_sqs = ([torch.randn(64)] for _ in range(4))
    assert compiled.native_adam_covers(params, grads, exp_avgs, exp_avg_sqs)
    assert not compiled.native_adam_covers(params, [grads[0].bfloat16()], exp_avgs, exp_avg_sqs)  # bf16 grads
    assert not compiled.native_adam_covers(params, grads, exp_avgs, [torch.randn(128)[::2]])  # strided
    assert not compiled.native_adam_covers(params, grads, exp_avgs, [torch.randn(63)])  # lengths differ
    assert not compiled.native_adam_covers(params, grads, exp_avgs, [])  # lists differ
    assert not compiled.native_adam_covers([], [], [], [])
    with pytest.raises(ValueError, match="one contiguous fp32 CPU row"):
        update_loops.adam(params[0], grads[0], exp_avgs[0], exp_avg_sqs[0], torch.zeros(11, dtype=torch.float64))


def _fresh_process(code: str, env: dict) -> dict:
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# A model just over the size at which kernel="auto" runs the compiled kernel (auto.COMPILE_MIN_NUMEL), built and
# stepped in a fresh process: what a user's training script does first.
_BUILD_AND_STEP = """
import json, sys, torch
import graphstep as gs
from graphstep.kernels import auto, compiled
from graphstep.native import update_loops
model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.Linear(4096, 1024), torch.nn.Linear(1024, 4))
assert sum(p.numel() for p in model.parameters()) > auto.COMPILE_MIN_NUMEL
opt = gs.get_optimizer(gs.OptimizerConfig(lr=1e-3, clip_grad=1.0), model)
model(torch.randn(2, 4096)).sum().backward()
opt.step()
print(json.dumps(dict(kernel=opt.kernel_choice.name, reason=opt.kernel_choice.reason,
                      choice_compile_s=opt.kernel_choice.compile_s,
                      compile_s=compiled.compile_seconds(), status=update_loops.status(),
                      inductor_compiled="torch._inductor.compile_fx" in sys.modules)))
"""


def test_a_large_fp32_model_builds_and_steps_without_torch_compile_where_the_native_loop_builds(native, tmp_path):
    for cache in ("empty cache: the library compiles at build", "the cache that process left"):
        seen = _fresh_process(_BUILD_AND_STEP, {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path)})
        assert seen["kernel"] == "compiled" and "native loop" in seen["reason"], cache
        assert seen["status"].startswith("native: ") and seen["compile_s"] == 0.0, cache
        assert not seen["inductor_compiled"], cache  # neither probed nor compiled: inductor's compiler never loaded
        # The library's compile is the build's, reported as a probe's is; found in the cache, none.
        assert (seen["choice_compile_s"] > 0) == cache.startswith("empty"), (cache, seen["choice_compile_s"])
    assert len(list((tmp_path / "graphstep_native").glob("graphstep_update_loops_*.so"))) == 1
    # Turned off, the same step goes through torch.compile: probed at build, compiled on the first step.
    off = _fresh_process(_BUILD_AND_STEP, {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path),
                                           update_loops.DISABLE_VARIABLE: "0"})
    assert off["kernel"] == "compiled" and "torch.compile works" in off["reason"]
    assert off["status"] == f"torch.compile: {update_loops.DISABLE_VARIABLE}=0" and off["compile_s"] > 0


def test_a_library_that_cannot_be_built_leaves_the_update_to_torch_compile(tmp_path):
    seen = _fresh_process(_BUILD_AND_STEP, {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path), "CXX": "false"})
    assert seen["status"].startswith("torch.compile: the native update could not be built (RuntimeError: false ")
    assert seen["kernel"] == "fused" or "torch.compile works" in seen["reason"]  # inductor uses its own compiler
    assert not list((tmp_path / "graphstep_native").glob("*.so"))


# ---- state stored below fp32 (graphstep/kernels/compiled_stored.py): the encodings that need no scale --------

STORED = {"bf16 moments": ("f32", "bf16", "bf16"), "remainders, bf16 moments": ("rem", "bf16", "bf16"),
          "remainders, fp32 moments": ("rem", "f32", "f32"), "fp32 main, mixed moments": ("f32", "f32", "bf16")}


def _stored_part(generator, code: str, shape: tuple) -> tuple:
    values = torch.randn(shape, generator=generator)
    if code == "f32":
        return (values,)
    if code == "bf16":
        return (values.abs().bfloat16(),)
    # rem: a bf16 param's bits and a low half, any 16 bits
    return (values.bfloat16().view(torch.int16), torch.randint(-2**15, 2**15, shape, generator=generator,
                                                                dtype=torch.int16))


def _stored_call(encodings: tuple, grad_dtype: torch.dtype, widths=(64, 1), rows=(37, 5)) -> tuple:
    generator = torch.Generator().manual_seed(7)
    parts = [(tuple(_stored_part(generator, code, (n, width)) for code in encodings),
              torch.randn((n, width), generator=generator).to(grad_dtype)) for width, n in zip(widths, rows)]
    spec = ",".join(encodings) + ":" + ",".join(map(str, widths))
    return parts, spec


def _stored_step(parts, spec, **scalars) -> None:
    written, read = compiled_stored.pack(parts, (None, None, None), None)
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.1, eps=1e-8)
    compiled_stored.adam_stored(written, read, spec, {k: torch.tensor(v, dtype=torch.float64) for k, v in
                                                      hyper.items()}, **scalars)


def _stored_bytes(parts) -> list:
    return [t.view(torch.uint8) for stored, _ in parts for kind in stored for t in kind]


@pytest.mark.parametrize("encodings", list(STORED.values()), ids=list(STORED))
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["fp32 grads", "bf16 grads"])
def test_the_native_stored_loop_stores_the_bytes_the_compiled_passes_store(native, encodings, grad_dtype):
    parts, spec = _stored_call(encodings, grad_dtype)
    through_compile = [(tuple(tuple(t.clone() for t in kind) for kind in stored), grad) for stored, grad in parts]
    before = [t.clone() for t in _stored_bytes(parts)]
    for step, found_inf, decoupled in ((1, 0.0, True), (2, 1.0, True), (3, 0.0, False)):
        scalars = dict(step=torch.tensor(float(step)), decoupled=decoupled, grad_scale=torch.tensor(4.0),
                       found_inf=torch.tensor(found_inf))
        assert all(stored_loops.stored_covers(encodings, stored, grad) for stored, grad in parts)
        _stored_step(parts, spec, **scalars)
        with update_loops.off():
            _stored_step(through_compile, spec, **scalars)
        for ours, theirs in zip(_stored_bytes(parts), _stored_bytes(through_compile)):
            assert torch.equal(ours, theirs), f"step {step}"
    assert not all(torch.equal(a, b) for a, b in zip(_stored_bytes(parts), before))


def test_the_native_stored_loop_stores_nan_and_overflow_as_the_compiled_passes_do(native):
    # Inf and overflow land in the same bytes as the compiled passes'. A NaN moment is a NaN in both, but its bytes
    # are no one value even in torch: its vectorized cast stores 0xFFFF (as the native loop does), its scalar one
    # (ATEN_CPU_CAPABILITY=default) and inductor's pass 0x7FC0.
    parts, spec = _stored_call(("rem", "bf16", "bf16"), torch.float32)
    parts[0][1][0, :5] = torch.tensor([float("nan"), float("inf"), -float("inf"), 3e38, -3e38])
    through_compile = [(tuple(tuple(t.clone() for t in kind) for kind in stored), grad) for stored, grad in parts]
    scalars = dict(step=torch.tensor(1.0), decoupled=True, grad_scale=None, found_inf=torch.tensor(0.0))
    _stored_step(parts, spec, **scalars)
    with update_loops.off():
        _stored_step(through_compile, spec, **scalars)
    (main, low), (exp_avg,), (exp_avg_sq,) = parts[0][0]
    assert exp_avg[0, :5].float().isnan().any() and exp_avg_sq[0, 1:5].float().isinf().all()
    (their_main, their_low), (their_exp_avg,), (their_exp_avg_sq,) = through_compile[0][0]
    assert torch.equal(main, their_main) and torch.equal(low, their_low)
    for ours, theirs in ((exp_avg, their_exp_avg), (exp_avg_sq, their_exp_avg_sq)):
        assert _equal(ours.float(), theirs.float())
        numbers = ~ours.float().isnan()
        assert torch.equal(ours[numbers].view(torch.int16), theirs[numbers].view(torch.int16))


def test_encodings_the_native_loop_does_not_take_go_through_torch_compile(native):
    parts, _ = _stored_call(("f32", "bf16", "bf16"), torch.float32)
    stored, grad = parts[0]
    assert stored_loops.stored_covers(("f32", "bf16", "bf16"), stored, grad)
    assert not stored_loops.stored_covers(("f32", "f16", "bf16"), stored, grad)  # a scaled kind
    assert not stored_loops.stored_covers(("f32", "bf16", "bf16"), stored, grad.half())  # fp16 grads
    assert not stored_loops.stored_covers(("rem", "bf16", "bf16"), stored, grad)  # tensors not of their code
    assert not stored_loops.stored_covers(("f32", "bf16", "bf16"), stored, grad[:, :32])  # lengths differ


# ---- scaled kinds (fp16 / fp8 moments, fp16 main params): two passes, per-piece scales ------------------------

# Each case compiles the reference's two passes once (a few seconds each): three cases cover every scaled
# encoding, remainders and both grad dtypes; tests/test_compiled_stored.py runs the rest against the eager path.
SCALED = {"fp16 moments": (("f32", "f16", "f16"), torch.float32),
          "remainders, fp8 and fp16 moments, bf16 grads": (("rem", "f8", "f16"), torch.bfloat16),
          "fp16 main, fp8 and fp16 moments": (("f16", "f8", "f16"), torch.float32)}


def _scaled_part(generator, code: str, shape: tuple) -> tuple:
    if code == "f16":
        return (torch.randn(shape, generator=generator).abs().half() * 100,)
    if code == "f8":  # every byte, the NaN bytes (read as infinities) among them
        return (torch.randint(0, 256, shape, generator=generator, dtype=torch.int64).to(torch.uint8),)
    return _stored_part(generator, code, shape)


def _scaled_call(encodings: tuple, grad_dtype: torch.dtype, widths=(64, 1), rows=(37, 5)):
    """Parts over pieces as the layout cuts them: a row's elements left of its split are one piece's, those right
    of it the next one's; the (n, 1) tail's all the last piece's."""
    generator = torch.Generator().manual_seed(11)
    parts, index = [], []
    for width, n in zip(widths, rows):
        parts.append((tuple(_scaled_part(generator, code, (n, width)) for code in encodings),
                      torch.randn((n, width), generator=generator).to(grad_dtype)))
        if width > 1:
            first = torch.arange(n, dtype=torch.int64) // 8
            split = torch.randint(0, width + 1, (n,), generator=generator).to(torch.float32)
        else:
            first, split = torch.full((n,), (rows[0] - 1) // 8 + 1, dtype=torch.int64), torch.ones(n)
        index.append((first, first + 1, split))
    pieces = (rows[0] - 1) // 8 + 3
    scales = tuple(torch.rand(pieces, generator=generator) + 0.01 if code in compiled_stored.RANGES else None
                   for code in encodings)
    spec = ",".join(encodings) + ":" + ",".join(map(str, widths))
    return parts, index, scales, spec


def _scaled_step(call, **scalars) -> None:
    parts, index, scales, spec = call
    written, read = compiled_stored.pack(parts, scales, index)
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.1, eps=1e-8)
    compiled_stored.adam_stored(written, read, spec, {k: torch.tensor(v, dtype=torch.float64) for k, v in
                                                      hyper.items()}, **scalars)


def _cloned(call):
    parts, index, scales, spec = call
    return ([(tuple(tuple(t.clone() for t in kind) for kind in stored), grad) for stored, grad in parts], index,
            tuple(None if s is None else s.clone() for s in scales), spec)


def _scaled_bytes(call) -> list:
    parts, _, scales, _ = call
    return _stored_bytes(parts) + [s.view(torch.uint8) for s in scales if s is not None]


@pytest.mark.parametrize("case", list(SCALED))
def test_the_native_scaled_passes_store_the_bytes_and_scales_the_compiled_passes_store(native, monkeypatch, case):
    ours = _scaled_call(*SCALED[case])
    theirs = _cloned(ours)
    before = [t.clone() for t in _scaled_bytes(ours)]
    passes = []
    run = stored_loops.adam_scaled
    monkeypatch.setattr(stored_loops, "adam_scaled", lambda *args: (passes.append(args[0]), run(*args)))
    for step, found_inf in ((1, 0.0), (2, 1.0), (3, 0.0)):  # a skipped step between two that apply
        scalars = dict(step=torch.tensor(float(step)), decoupled=True, grad_scale=torch.tensor(4.0),
                       found_inf=torch.tensor(found_inf))
        _scaled_step(ours, **scalars)
        with update_loops.off():
            _scaled_step(theirs, **scalars)
        for a, b in zip(_scaled_bytes(ours), _scaled_bytes(theirs)):
            assert torch.equal(a, b), f"step {step}"
    assert passes == [1, 1, 2, 2] * 3  # per step: each pass over both parts, natively
    assert not all(torch.equal(a, b) for a, b in zip(_scaled_bytes(ours), before))


def test_the_native_scaled_passes_store_nan_inf_and_overflow_as_the_compiled_passes_do(native):
    ours = _scaled_call(*SCALED["fp16 main, fp8 and fp16 moments"])  # its compiled passes built above: reused
    ours[0][0][1][0, :6] = torch.tensor([float("nan"), float("inf"), -float("inf"), 3e38, -3e38, 1e-30])
    theirs = _cloned(ours)
    scalars = dict(step=torch.tensor(1.0), decoupled=True, grad_scale=torch.tensor(4.0), found_inf=torch.tensor(0.0))
    was = torch.get_num_threads()
    try:
        torch.set_num_threads(3)  # an odd count: rows split unevenly, each thread's maxima merged
        _scaled_step(ours, **scalars)
        with update_loops.off():
            _scaled_step(theirs, **scalars)
    finally:
        torch.set_num_threads(was)
    (main,), (exp_avg,), (exp_avg_sq,) = ours[0][0][0]
    (their_main,), (their_exp_avg,), (their_exp_avg_sq,) = theirs[0][0][0]
    assert main[0, :6].float().isnan().any() and exp_avg_sq[0, :6].float().isinf().any()
    assert torch.equal(exp_avg, their_exp_avg)  # fp8: a NaN's byte is one value (0x7F with its sign)
    for a, b in ((main, their_main), (exp_avg_sq, their_exp_avg_sq)):  # fp16: NaN-ness, then every other byte
        assert _equal(a.float(), b.float())
        numbers = ~a.float().isnan()
        assert torch.equal(a[numbers].view(torch.int16), b[numbers].view(torch.int16))
    for a, b in zip(ours[2], theirs[2]):
        assert a is None or torch.equal(a, b)


def _every_exponent() -> torch.Tensor:
    """float32 values of every exponent and sign, each with mantissas at both ends and around every rounding
    point of a 10-bit (fp16) and a 3-bit (fp8) mantissa: the specials and every rounding edge among them."""
    exponents = torch.arange(256, dtype=torch.int64) << 23
    ends = torch.arange(512, dtype=torch.int64)
    halves = torch.cat([torch.arange(0, 1 << 23, 1 << shift, dtype=torch.int64) + (1 << (shift - 1)) + offset
                        for shift in (13, 20) for offset in (-1, 0, 1)])
    mantissas = torch.cat([ends, (1 << 23) - 1 - ends, halves])
    bits = (exponents.unsqueeze(1) | mantissas.unsqueeze(0)).reshape(-1)
    bits = torch.cat([bits, bits | (1 << 31)])
    return (bits - ((bits >> 31) << 32)).to(torch.int32).view(torch.float32).contiguous()


def _native_cast(name: str, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(values.numel(), dtype=dtype)
    getattr(update_loops.stored_library(), name)(values.data_ptr(), out.data_ptr(), values.numel())
    return out


def test_the_fp8_cast_is_torchs_over_every_exponent(native):
    values = _every_exponent()
    ours = _native_cast("graphstep_to_e4m3", values, torch.uint8)
    theirs = values.to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(ours, theirs), values[ours != theirs][:8]


def test_the_fp16_casts_are_torchs_over_every_exponent_and_every_half(native):
    values = _every_exponent()
    ours = _native_cast("graphstep_to_f16", values, torch.int16)
    theirs = values.half().view(torch.int16)
    numbers = ~values.isnan()  # a NaN's bytes are no one value in torch either: NaN-ness below
    assert torch.equal(ours[numbers], theirs[numbers]), values[numbers][ours[numbers] != theirs[numbers]][:8]
    assert ours.view(torch.float16)[~numbers].isnan().all()
    halves = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16)
    assert _equal(_native_cast("graphstep_from_f16", halves, torch.float32), halves.view(torch.float16).float())


def test_a_piece_index_outside_the_scales_is_refused_before_the_loop_reads_it(native):
    parts, index, scales, _ = _scaled_call(*SCALED["fp16 moments"])
    (stored, grad), (first, second, split) = parts[0], index[0]
    out = tuple(None if s is None else torch.zeros_like(s) for s in scales)
    c = torch.ones(11)
    with pytest.raises(ValueError, match="outside the 7 pieces"):
        stored_loops.adam_scaled(1, ("f32", "f16", "f16"), stored, grad, (first, second + 7, split), scales, out,
                                 compiled_stored._fp8_values(torch.device("cpu")), (0.0, 1.0, 1.0), c)
