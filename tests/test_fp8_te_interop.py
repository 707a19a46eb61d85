"""Transformer Engine interop without TE (graphstep.fp8.te_interop): detection never imports TE and says no,
graphstep's own weights go through graphstep's cast, TE's recipes map to graphstep's or are refused by name,
and the TE path fails with what to install. The TE-and-CUDA half is tests/cuda/test_transformer_engine.py."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from graphstep import fp8
from graphstep.fp8 import te_interop
from toy import tiny_transformer

ROOT = Path(__file__).resolve().parents[1]


def test_detection_says_no_for_plain_and_graphstep_weights():
    model = tiny_transformer()
    fp8.convert(model)
    for p in model.parameters():
        assert not te_interop.is_te_fp8(p)
    assert not te_interop.is_te_fp8(torch.zeros(3, dtype=torch.float8_e4m3fn))


def test_graphsteps_weights_dispatch_to_graphsteps_cast():
    model = tiny_transformer()
    fp8.convert(model)
    routes = {te_interop.cast_routine(p) for p in model.parameters() if fp8.is_fp8(p)}
    assert routes == {"graphstep"}
    with pytest.raises(ValueError, match="not an fp8 weight"):
        te_interop.cast_routine(torch.nn.Parameter(torch.zeros(2, 2)))


def test_te_recipes_map_to_graphsteps_or_are_refused_by_name():
    assert te_interop.te_recipe("Float8CurrentScalingQuantizer") == "tensorwise"
    assert te_interop.te_recipe("Float8Quantizer") == "delayed"
    for block_scaled in ("MXFP8Quantizer", "Float8BlockQuantizer", "NVFP4Quantizer"):
        with pytest.raises(ValueError, match=rf"param 'w' was made by TE's {block_scaled}: graphstep requantizes "
                                             "per-tensor fp8 weights only"):
            te_interop.te_recipe(block_scaled, "param 'w'")


def test_requantize_te_refuses_graphstep_weights_and_needs_nothing_for_none():
    model = tiny_transformer()
    fp8.convert(model)
    weight = next(p for p in model.parameters() if fp8.is_fp8(p))
    with pytest.raises(ValueError, match="weight 0 is not a Transformer Engine fp8 weight"):
        te_interop.requantize_te([weight], [None], [None])
    with pytest.raises(ValueError, match="one entry per weight"):
        te_interop.requantize_te([weight], [], [None])
    te_interop.requantize_te([], [], [])  # nothing to cast: TE is not needed


def test_without_te_the_cast_says_what_to_install():
    importable, reason = te_interop.te_importable()
    if importable:
        pytest.skip("transformer-engine imports here: the TE path is tests/cuda/test_transformer_engine.py's")
    assert reason
    with pytest.raises(RuntimeError, match=r"cast_master_weights_to_fp8 is not available .*pip install "
                                           r"'graphstep\[te\]'"):
        te_interop.te_cast()


def test_graphstep_never_imports_transformer_engine():
    script = textwrap.dedent("""
        import sys
        import torch
        import graphstep as gs
        sys.path.insert(0, "tests")
        from toy import loss_fn, tiny_transformer
        model = tiny_transformer()
        gs.fp8.convert(model)
        opt = gs.get_optimizer(gs.OptimizerConfig(fp8_recipe="tensorwise", capture="eager"), model)
        loss_fn(model, 0).backward()
        opt.step()
        assert opt.result.update_successful.item()
        print(sorted(m for m in sys.modules if m.startswith("transformer_engine")))
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
