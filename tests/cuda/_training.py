"""The CUDA tests' shared run: a tiny MLP trained on the GPU under an LR schedule, with one inf grad."""

import torch

import graphstep as gs

DEVICE = torch.device("cuda", 0) if torch.cuda.is_available() else None
PRECISIONS = {"fp32": {}, "bf16": {"bf16": True}, "fp16": {"fp16": True, "initial_loss_scale": 2.0**10}}


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64)).to(DEVICE)


def train(mode, precision, *, steps, inf_step, **config):
    """``steps`` steps of ``tiny_model`` with ``capture=mode``, the precision's fields and ``config``, under
    an LR schedule, with an inf written into the first param's main grad at ``inf_step``. Returns the
    model, the optimizer and each step's (update_successful, grad_norm, loss_scale), cloned."""
    model = tiny_model()
    opt = gs.get_optimizer(gs.OptimizerConfig(lr=1e-3, clip_grad=0.5, capture=mode, capture_warmup_steps=3,
                                              **PRECISIONS[precision], **config), model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))
    g = torch.Generator(device=DEVICE).manual_seed(0)
    reported = []
    for step in range(steps):
        x = torch.randn(16, 64, device=DEVICE, generator=g)
        opt.zero_grad()
        opt.scale_loss(model(x.to(next(model.parameters()).dtype)).float().square().mean()).backward()
        if step == inf_step:
            next(model.parameters()).main_grad.view(-1)[0] = float("inf")
        result = opt.step()
        reported.append(tuple(t.clone() for t in (result.update_successful, result.grad_norm, result.loss_scale)))
        sched.step()
    opt.finish_param_gather()  # CPU offload's overlapped host update, if any, must be done
    torch.cuda.synchronize()
    return model, opt, reported
