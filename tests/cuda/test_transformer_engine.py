"""graphstep over Transformer Engine layers (optional extra `te`; needs CUDA): skipped with a reason here."""

import pytest
import torch
from _bitwise import assert_state_equal

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
