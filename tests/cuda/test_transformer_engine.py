"""graphstep over Transformer Engine layers (optional extra `te`; needs CUDA): skipped with a reason here."""

import pytest
import torch
from _bitwise import assert_state_equal
from _ports import free_port

try:
    import transformer_engine.pytorch as te
    TE_ERROR = None
except Exception as error:  # ImportError, or an OSError when libcuda is missing
    te, TE_ERROR = None, f"{type(error).__name__}: {error}"

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(te is None, reason=f"transformer-engine is not importable ({TE_ERROR}); "
                                         "install the optional extra: pip install -e '.[te]' on a CUDA machine"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA)"),
]


def test_te_linear_trains_with_the_captured_engine_like_eager():
    import graphstep as gs

    def run(mode):
        torch.manual_seed(0)
        model = torch.nn.Sequential(te.Linear(64, 128), te.Linear(128, 64)).cuda()
        opt = gs.get_optimizer(gs.OptimizerConfig(lr=1e-3, bf16=True, capture=mode, capture_warmup_steps=2), model)
        g = torch.Generator(device="cuda").manual_seed(0)
        for _ in range(10):
            x = torch.randn(32, 64, device="cuda", generator=g, dtype=torch.bfloat16)
            opt.zero_grad()
            model(x).float().square().mean().backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()], opt

    eager, opt_eager = run("eager")
    graph, opt = run("graph")
    assert opt.captured and opt.recaptures == 0
    assert all(torch.equal(a, b) for a, b in zip(eager, graph))
    assert_state_equal(opt_eager, opt)  # main params, state, step: not the params alone


# ---- fp8 weights made under te.fp8_model_init (graphstep.fp8.te_interop) ---------------------------------
def _fp8_linear(recipe):
    with te.fp8_model_init(enabled=True, recipe=recipe):
        return te.Linear(64, 32, params_dtype=torch.bfloat16, device="cuda")


def test_te_fp8_weights_are_recognised_with_their_recipe():
    from transformer_engine.common import recipe as te_recipes

    from graphstep.fp8 import te_interop

    current = _fp8_linear(te_recipes.Float8CurrentScaling()).weight
    delayed = _fp8_linear(te_recipes.DelayedScaling()).weight
    assert te_interop.is_te_fp8(current) and te_interop.is_te_fp8(delayed)
    assert te_interop.recipe_of(current) == "tensorwise" and te_interop.recipe_of(delayed) == "delayed"
    assert te_interop.cast_routine(current) == "transformer_engine"
    assert not te_interop.is_te_fp8(torch.nn.Linear(4, 4).weight)


def test_requantize_te_casts_the_new_main_values_through_te_with_graphsteps_scale_rule():
    from transformer_engine.common import recipe as te_recipes

    import graphstep as gs
    from graphstep.fp8 import te_interop

    weight = _fp8_linear(te_recipes.Float8CurrentScaling()).weight
    main = weight.dequantize().float().reshape(-1) * 1.5  # what an update might leave in the main params
    if not torch.distributed.is_initialized():  # TE's routine all-reduces the amax over the group
        torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                             world_size=1)
    te_interop.requantize_te([weight], [main], [0], None)
    amax = main.abs().max()
    scale = gs.fp8.scale_from_amax(amax, torch.float8_e4m3fn)
    assert torch.allclose(weight._scale_inv.float().reshape(()), torch.reciprocal(scale), rtol=1e-6)
    # TE's cast and graphstep's agree to the fp8 rounding of the same values
    ours = gs.fp8.dequantize(gs.fp8.quantize(main, scale, torch.float8_e4m3fn), torch.reciprocal(scale))
    assert torch.allclose(weight.dequantize().float().reshape(-1), ours, rtol=0, atol=float(amax) / 8)


def test_the_engine_refuses_a_te_fp8_model_with_what_to_do():
    from transformer_engine.common import recipe as te_recipes

    import graphstep as gs

    model = _fp8_linear(te_recipes.Float8CurrentScaling())
    with pytest.raises(ValueError, match=r"Transformer Engine fp8 weight \(recipe 'tensorwise'\).*graphstep.fp8.convert"):
        gs.get_optimizer(gs.OptimizerConfig(bf16=True, capture="eager"), model)
