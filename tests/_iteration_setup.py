"""The tiny GPT with dropout, its micro-batches and the optimizer the iteration tests train (shared by the
single-process tests, the distributed workers and the iteration benchmark)."""

import contextlib

import torch
import torch.nn.functional as F

import graphstep as gs
from graphstep.app import models

GPT_CONFIG = models.tiny(vocab_size=32, seq_len=8, d_model=16, n_layers=1, n_heads=2, d_ff=32)
DROPOUT = 0.1
FP16 = {"fp16": True, "initial_loss_scale": 2.0 ** 12, "loss_scale_window": 5}


def gpt_with_dropout(seed: int = 0) -> torch.nn.Module:
    """The built-in GPT with dropout after every block (a forward hook: on in train(), off in eval())."""
    model = models.GPT(GPT_CONFIG, seed=seed)
    for block in model.blocks:
        block.register_forward_hook(lambda module, args, out: F.dropout(out, DROPOUT, module.training))
    return model


def optimizer(model, capture="eager", **config):
    config = {"optimizer": "adam", "lr": 2e-3, "weight_decay": 0.05, "clip_grad": 0.5, "kernel": "fused",
              "capture": capture, "capture_warmup_steps": 2, **config}
    return gs.get_optimizer(gs.OptimizerConfig(**config), model)


def micro_batches(step: int, k: int = 4, batch_size: int = 2, seq_len: int = 8, poison: float = 1.0,
                  corpus=models.SyntheticCorpus(GPT_CONFIG.vocab_size, seed=0)):
    """k micro-batches (inputs, targets, factor): the loss is multiplied by ``factor`` (inf or NaN poisons it)."""
    inputs, targets = corpus.batch(step, k * batch_size, seq_len)
    factor = torch.tensor(poison)
    return [(inputs[i::k], targets[i::k], factor) for i in range(k)]


def loss_fn(model, batch):
    inputs, targets, factor = batch
    return model(inputs, targets) * factor


def user_loop(model, opt, loss_fn=loss_fn):
    """The loop a user writes with opt.step(): zero, micro-batches under no_sync but the last, step. Returns a
    function of the micro-batches giving (mean loss, grad norm, update flag, loss scale, skipped steps)."""
    def run(mbs):
        opt.zero_grad()
        total = torch.zeros(())
        for i, mb in enumerate(mbs):
            with no_sync(model, opt) if i < len(mbs) - 1 else contextlib.nullcontext():
                loss = loss_fn(model, mb)
                total += loss.detach()
                opt.scale_loss(loss / len(mbs)).backward()
        r = opt.step()
        return total / len(mbs), r.grad_norm, r.update_successful, r.loss_scale, r.skipped_steps
    return run


@contextlib.contextmanager
def no_sync(model, opt):
    """Grad accumulation's switches: the optimizer's, and DDP's or FSDP2's."""
    with opt.no_sync(), model.no_sync() if hasattr(model, "no_sync") else contextlib.nullcontext():
        if hasattr(model, "set_requires_gradient_sync"):
            model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            if hasattr(model, "set_requires_gradient_sync"):
                model.set_requires_gradient_sync(True)


def bits(t):
    """A tensor's bit pattern (NaN equals NaN, -0.0 differs from 0.0): what a bitwise comparison compares."""
    t = t.detach().reshape(-1)
    return t.view(torch.uint8) if t.dtype == torch.bool else t.view({2: torch.int16, 4: torch.int32,
                                                                      8: torch.int64}[t.element_size()])
