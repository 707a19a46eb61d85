"""A small transformer-style model and a deterministic data stream for the engine tests."""

import torch

VOCAB, SEQ, WIDTH = 64, 8, 32
GLOBAL_BATCH = 8  # the distributed tests' global batch, split evenly over the ranks


def tiny_transformer(seed: int = 0, dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Embedding(VOCAB, WIDTH),
        torch.nn.TransformerEncoderLayer(WIDTH, 4, 2 * WIDTH, dropout=0.0, batch_first=True),
        torch.nn.LayerNorm(WIDTH),
        torch.nn.Linear(WIDTH, VOCAB),
    )
    model[0].weight.is_embedding_or_output_parameter = True
    model[3].weight.is_embedding_or_output_parameter = True
    return model.to(dtype)


def batch(step: int, batch_size: int = 4):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(model, step: int, batch_size: int = 4):
    inputs, targets = batch(step, batch_size)
    logits = model(inputs)
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def local_loss(model, step: int, rank: int, world_size: int, global_batch: int = GLOBAL_BATCH):
    """Mean loss over this rank's slice of the global batch (rank-major, equal slices)."""
    inputs, targets = batch(step, global_batch)
    per_rank = global_batch // world_size
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    logits = model(inputs[rows])
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), targets[rows].reshape(-1))


def decay_groups(model, weight_decay: float):
    """torch.optim param groups equal to graphstep's standard overrides: no decay on biases and 1-D."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if name.endswith(".bias") or p.ndim == 1 else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def relative_drift(params, reference, start):
    """‖a − b‖ / ‖b − p₀‖ over all params: drift relative to how far the params moved (docs/design.md §8)."""
    num = sum(((a.detach().double() - b.detach().double()) ** 2).sum() for a, b in zip(params, reference))
    den = sum(((b.detach().double() - s.double()) ** 2).sum() for b, s in zip(reference, start))
    return (num / den).sqrt().item()


def relative_error(params, reference):
    num = sum(((a.detach().double() - b.detach().double()) ** 2).sum() for a, b in zip(params, reference))
    den = sum((b.detach().double() ** 2).sum() for b in reference)
    return (num / den).sqrt().item()


def grad_scaler(init_scale=None):
    """torch's GradScaler on the CPU at a fixed ``init_scale`` (it never grows within a test), or None."""
    return None if init_scale is None else torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=10**6)


def backward_and_step(opt, loss, amp=None):
    """``loss``'s backward and ``opt``'s step: through torch's GradScaler ``amp`` when given (returns None), else
    through graphstep's own loss scale (returns the StepResult)."""
    if amp is not None:
        amp.scale(loss).backward()
        amp.step(opt)
        amp.update()
        return None
    opt.scale_loss(loss).backward()
    return opt.step()
