"""fold_grad_norm on a GPU (skipped without an NVIDIA GPU): the hooks fold on the backward's stream, the
CUDA graph's norm stage reads only the folded vectors; captured equals eager bitwise, and the folded norm
matches the unfolded one to fp64 rounding of the per-row sums."""

import math

import pytest
import torch

import graphstep as gs

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA)")]

DEVICE = torch.device("cuda", 0) if torch.cuda.is_available() else None
INF_STEP = 7


def run(mode: str, fold: bool, precision: dict, steps: int = 16, micro_batches: int = 2):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64)).to(DEVICE)
    opt = gs.get_optimizer(gs.OptimizerConfig(lr=1e-3, clip_grad=0.5, capture=mode, capture_warmup_steps=3,
                                              kernel="fused", fold_grad_norm=fold, **precision), model)
    g = torch.Generator(device=DEVICE).manual_seed(0)
    norms, ok = [], []
    for step in range(steps):
        opt.zero_grad()
        for micro in range(micro_batches):
            x = torch.randn(16, 64, device=DEVICE, generator=g)
            loss = model(x.to(next(model.parameters()).dtype)).float().square().mean() / micro_batches
            if step == INF_STEP and micro == 0:
                loss = loss * math.inf  # through backward: the fold sees it
            if micro < micro_batches - 1:
                with opt.no_sync():
                    opt.scale_loss(loss).backward()
            else:
                opt.scale_loss(loss).backward()
        result = opt.step()
        norms.append(result.grad_norm.clone())
        ok.append(result.update_successful.clone())
    torch.cuda.synchronize()
    return [p.detach().clone() for p in model.parameters()], norms, ok, opt


@pytest.mark.parametrize("precision", [{}, {"bf16": True}], ids=["fp32", "bf16"])
def test_captured_folded_step_equals_eager_bitwise(precision):
    params_e, norms_e, ok_e, _ = run("eager", True, precision)
    params_g, norms_g, ok_g, opt_g = run("graph", True, precision)
    assert opt_g.captured and opt_g.recaptures == 0
    assert all(torch.equal(a, b) for a, b in zip(params_e, params_g))
    assert all(torch.equal(a, b) for a, b in zip(ok_e, ok_g)) and not ok_g[INF_STEP].item()
    assert all(torch.equal(a, b) or (a.isnan().item() and b.isnan().item()) for a, b in zip(norms_e, norms_g))
    assert opt_g.fold_counts["before_step"] == 0


def test_folded_norm_matches_the_unfolded_norm_on_the_first_step():
    _, folded, _, _ = run("graph", True, {}, steps=1)
    _, plain, _, _ = run("graph", False, {}, steps=1)
    assert folded[0].item() == pytest.approx(plain[0].item(), rel=1e-6)
