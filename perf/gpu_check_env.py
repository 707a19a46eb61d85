"""perf/gpu_check.py's environment parts: preflight facts, the CUDA test suite and the profile CLI."""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import gpu_check_torch_api
from capture.devices import is_cuda
from graphstep.native import build as native_checks
from gpu_check_numerics import NO_CUDA, record
from gpu_check_parts import BY_NAME

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "CUDA_VISIBLE_DEVICES", "CUDA_LAUNCH_BLOCKING",
            "TORCH_NCCL_BLOCKING_WAIT", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_GRAPH_REGISTER", "NCCL_DEBUG")


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _mig_mode() -> str:
    """MIG mode of GPU 0 through NVML ("enabled", "disabled", or why it could not be read)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
        return "enabled" if current == pynvml.NVML_DEVICE_MIG_ENABLE else "disabled"
    except Exception as error:  # no NVML, no GPU, or a GPU without MIG support
        return f"unknown ({type(error).__name__}: {str(error)[:80]})"


def _compile_problems(device) -> dict:
    """Every compile the step's first call would do, done now with the options the engine uses: the compiled
    Adam with the step's hyperparameter dtype (kernel="auto"'s probe) and a scalar graph. {what: problem}."""
    from graphstep.kernels import auto, compiled
    from graphstep.state.hyperparams import scalar_dtype
    from graphstep.step import compiled_scalar_math

    problems = {}
    missing = compiled.missing_compile_options(compiled.COMPILE_OPTIONS)
    works, why_not, _ = auto.probe_compiled(device, scalar_dtype(device))
    if missing or not works:
        problems["compiled update"] = f"inductor has no option {', '.join(missing)}" if missing else why_not
    problem = compiled_scalar_math.compile_problem(device)
    if problem is not None:
        problems["scalar graph"] = problem
    return problems


def _triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except Exception as error:  # no Triton (the CPU build) or a broken install
        return f"unavailable ({type(error).__name__})"


def _driver_version() -> str:
    """The NVIDIA driver's version through NVML, else nvidia-smi, else why neither answered."""
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception as error:  # no NVML library or no driver
        why = f"{type(error).__name__}"
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=20).stdout.strip().splitlines()
            if out:
                return out[0]
        except (OSError, subprocess.SubprocessError) as error:
            why += f"; nvidia-smi: {type(error).__name__}"
    return f"unavailable ({why})"


def _optional_packages() -> dict:
    """The optional packages some rows use: their version, or "absent" (those rows then skip, saying so)."""
    found = {}
    for name in ("transformer_engine", "megatron.core", "transformers", "lightning", "safetensors"):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            found[name] = "absent"
            continue
        try:
            from importlib.metadata import version

            found[name] = version(name.split(".")[0].replace("_", "-"))
        except Exception:  # installed without metadata under that name
            found[name] = "present"
    return found


def part_preflight(device, small: bool) -> list[dict]:
    """What this run ran on (versions, the device, MIG, the allocator and NCCL settings in force), whether
    everything the step compiles compiles here, and whether this torch has every private name graphstep uses."""
    facts = {"python": platform.python_version(), "torch": torch.__version__, "cuda_build": torch.version.cuda,
             "triton": _triton_version(), "driver": _driver_version() if is_cuda(device) else "none (no CUDA)",
             "optional": _optional_packages(),
             "git_commit": _git_commit(), "cuda_available": torch.cuda.is_available(),
             "settings": {k: os.environ[k] for k in SETTINGS if k in os.environ}}
    if is_cuda(device):
        props = torch.cuda.get_device_properties(device)
        facts.update(device=f"{props.name} ({props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor})",
                     devices=torch.cuda.device_count(), mig_mode=_mig_mode(),
                     allocator_backend=torch.cuda.get_allocator_backend())
        try:
            facts["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as error:
            facts["nccl"] = f"unavailable ({type(error).__name__})"
        smi = shutil.which("nvidia-smi")
        if smi:
            facts["nvidia_smi"] = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total,mig.mode.current",
                                                  "--format=csv,noheader"], capture_output=True, text=True,
                                                 timeout=20).stdout.strip()
    else:
        facts["device"] = f"cpu ({platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads)"
    problems = _compile_problems(device)
    facts["compile_problems"] = problems
    native_checks.wait(timeout=300)  # built here if need be: the per-param checks' compiled loops, or why not
    facts["native_checks"] = native_checks.status()
    detail = (f"Python {facts['python']}, torch {facts['torch']}, CUDA {facts['cuda_build']}, driver "
              f"{facts['driver']}, NCCL {facts.get('nccl', '—')}, Triton {facts['triton']}, {facts['device']}; "
              f"absent: {', '.join(k for k, v in facts['optional'].items() if v == 'absent') or 'nothing'}; "
              f"per-param checks: {facts['native_checks']}; compiles: "
              + ("; ".join(f"{what}: {why}" for what, why in problems.items()) or "the update and a scalar graph"))
    return [record("preflight", "fail" if problems else "pass", detail, **facts), private_api()]


def private_api() -> dict:
    """Every private torch name graphstep and capture use (perf/gpu_check_torch_api.py), each missing one named;
    a missing optional one is reported with what graphstep does without it."""
    missing, optional = gpu_check_torch_api.problems(), gpu_check_torch_api.optional_missing()
    checked = gpu_check_torch_api.count()
    detail = ("; ".join(f"{name}: {why}" for name, why in missing.items()) if missing
              else f"all {checked - len(optional)} of {checked} private torch names graphstep uses are present in "
                   f"torch {torch.__version__}")
    detail += "".join(f"; optional, absent: {name} ({without})" for name, without in optional.items())
    return record("preflight-torch-private-api", "fail" if missing else "pass", detail, checked=checked,
                  missing=sorted(missing), optional_missing=sorted(optional), names=list(gpu_check_torch_api.NAMES))
