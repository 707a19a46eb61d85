"""CPU offload under loss-scaled grads: the host part divides them as the device part does, so offloading
changes no bit of the run, under torch's GradScaler without clipping (the host part used to take the grads
unscaled: SGD diverged) and at a loss scale whose clip factor overflows fp32 (the host part divided by inf)."""

import warnings

import pytest
import torch

import graphstep as gs
from toy import backward_and_step, grad_scaler


def run(offload: bool, *, amp_scale=None, loss_scale=None, clip=0.0, optimizer="sgd"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    extra = dict(optimizer_cpu_offload=True, optimizer_offload_fraction=0.5) if offload else {}
    config = gs.OptimizerConfig(optimizer=optimizer, lr=1e-2, clip_grad=clip, loss_scale=loss_scale,
                                capture="eager", **extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # offload on a CPU-only machine says what it does
        opt = gs.get_optimizer(config, model, config_overrides={})
    amp = grad_scaler(amp_scale)
    for step in range(4):
        inputs = torch.randn(3, 16, generator=torch.Generator().manual_seed(step))
        backward_and_step(opt, model(inputs).square().mean(), amp)
        opt.zero_grad()
    return model


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("scaling", [dict(amp_scale=2.0**10), dict(amp_scale=2.0**10, clip=0.01),
                                     dict(loss_scale=2.0**127, clip=0.01), dict(loss_scale=2.0**10)],
                         ids=["grad-scaler", "grad-scaler-clipped", "scale-2^127-clipped", "scale-2^10"])
def test_offloading_changes_no_bit_under_loss_scaled_grads(optimizer, scaling):
    offloaded, resident = run(True, optimizer=optimizer, **scaling), run(False, optimizer=optimizer, **scaling)
    for (name, a), b in zip(offloaded.named_parameters(), resident.parameters()):
        assert torch.equal(a, b), f"{name}: offloaded differs by up to {(a - b).abs().max().item():.3g}"
