"""The claims that depend on the CPU's vector width hold under each width torch can be told to use.

Two things change with the width (``ATEN_CPU_CAPABILITY``: ``default`` none, ``avx2`` 8 floats, ``avx512`` 16):
torch's fused CPU kernels round a tensor's last ``numel % width`` elements in a scalar loop, and inductor
generates the compiled kernel's C++ for the width. The few tests that make bitwise claims against torch's
kernels, and the compiled kernel's checks, run here again in a fresh process under ``default`` and ``avx2``
(the native width is the suite's own run).
"""

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _parity import assert_bitwise, ulps_apart
from graphstep.kernels import auto, compiled

CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parent.parent
X86 = platform.machine().lower() in ("x86_64", "amd64")

# Bitwise claims against torch's fused kernels, and the compiled kernel against the reference and torch.
WIDTH_SENSITIVE = [
    "tests/test_vector_widths.py::test_this_process_runs_the_vector_width_it_was_told",
    "tests/test_kernels.py::test_adam_matches_reference",
    "tests/test_kernels.py::test_sgd_matches_reference",
    "tests/test_kernels.py::test_auto_runs_the_compiled_kernel_where_torch_compile_works",
    "tests/test_fsdp2_local.py::test_grads_the_user_set_to_none_are_taken_back_and_steps_stay_bitwise_torchs",
    "tests/test_engine.py::test_adam_with_l2_decay_is_bitwise_equal_to_torch_fused_adam",
    "tests/test_engine.py::test_compiled_kernel_drifts_from_torch_fused_adam_no_more_than_torchs_own_for_loop",
]


def test_this_process_runs_the_vector_width_it_was_told():
    told = os.environ.get("ATEN_CPU_CAPABILITY")
    if told:
        assert torch.backends.cpu.get_cpu_capability().lower() == told.lower()
        assert compiled.cpu_vector_isa().bit_width() == {"default": 0, "avx2": 256}.get(told.lower(), 512)


@pytest.mark.parametrize("capability", ["default", "avx2"])
def test_width_sensitive_claims_hold_under_another_vector_width(capability):
    if capability == "avx2" and not X86:
        pytest.skip("ATEN_CPU_CAPABILITY=avx2 exists on x86 only")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *WIDTH_SENSITIVE],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"ATEN_CPU_CAPABILITY={capability}:\n{done.stdout[-6000:]}\n{done.stderr[-2000:]}"


def test_compiled_kernel_is_right_under_another_vector_width_than_the_one_that_filled_inductors_cache(
        monkeypatch):
    # inductor reads ATEN_CPU_CAPABILITY at each compile; its on-disk cache keyed an entry by the graph and
    # the options only, so code tiled for 16 floats came back to a process compiling for 8 (half of every
    # row left unupdated) or for none (C++ that does not compile).
    native = compiled.cpu_vector_isa().bit_width()
    other = "default" if native == 256 else "avx2"
    if other == "avx2" and not (X86 and any(isa.bit_width() == 256 for isa in _valid_isas())):
        pytest.skip("this CPU has no AVX2")
    assert auto._compare_with_reference(CPU, torch.float64) is None  # fills the cache for the native width
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", other)
    compiled._compiled.cache_clear()  # fresh compiled functions: the next call goes to inductor's cache
    try:
        assert compiled.cpu_vector_isa().bit_width() != native
        assert auto._compare_with_reference(CPU, torch.float64) is None
    finally:
        compiled._compiled.cache_clear()


def test_compiled_kernel_matches_the_reference_whatever_torchs_fp32_precision_flags():
    # The flags a Muon step or a user's set_float32_matmul_precision leaves behind ("none" -> "ieee" on the
    # way back to "highest", "medium" letting oneDNN use bf16) do not reach the elementwise update.
    from graphstep.kernels.newton_schulz import _precision_backends
    previous = torch.get_float32_matmul_precision()
    saved = [(backend, backend.fp32_precision) for backend in _precision_backends()]
    try:
        for precision in ("medium", "highest"):  # "highest" after "medium" leaves the flags at "ieee"
            torch.set_float32_matmul_precision(precision)
            compiled._compiled.cache_clear()  # compiled afresh under these flags
            assert auto._compare_with_reference(CPU, torch.float64) is None, (
                precision, [backend.fp32_precision for backend, _ in saved])
    finally:
        torch.set_float32_matmul_precision(previous)
        for backend, flag in saved:
            backend.fp32_precision = flag
        compiled._compiled.cache_clear()


def _valid_isas():
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list
    return valid_vec_isa_list()


def test_a_probe_remembered_for_one_vector_width_is_not_taken_for_another(monkeypatch):
    native_key = auto._machine_key(CPU, torch.float64)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2" if compiled.cpu_vector_isa().bit_width() == 0 else "default")
    assert auto._machine_key(CPU, torch.float64) != native_key


def test_a_failed_parity_names_the_tensor_the_step_and_the_distance_in_ulps():
    ours = torch.tensor([1.0, 2.0, -3.0, 0.0])
    theirs = ours.clone()
    theirs[1] = torch.nextafter(theirs[1], torch.tensor(3.0))
    theirs[2] = torch.nextafter(torch.nextafter(theirs[2], torch.tensor(0.0)), torch.tensor(0.0))
    with pytest.raises(AssertionError) as raised:
        assert_bitwise([("0.weight", ours), ("0.bias", ours.clone())], [theirs, ours], step=3)
    message = str(raised.value)
    assert "at step 3" in message and "0.weight: 2 of 4 elements differ, at most 2 ulps apart" in message
    assert "0.bias" not in message
    assert ulps_apart(torch.tensor([0.0]), torch.tensor([-0.0])).item() == 0
    assert ulps_apart(torch.tensor([-1e-45]), torch.tensor([1e-45])).item() == 2
    assert_bitwise([("w", ours)], [ours.clone()], step=0)
