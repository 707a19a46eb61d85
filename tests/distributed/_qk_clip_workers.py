"""What the spawned ranks of test_qk_clip_distributed.py run (module-level, so "spawn" can import them)."""

from __future__ import annotations

import torch

import graphstep as gs
from graphstep.step.qk_clip import HeadLayout

# Hidden 24: in the one bucket [out, v, k, q] (backward order) the 2-rank shard boundary falls inside a row of
# W_k, so the flat-shard path (element -> row index) is exercised, not just whole weights.
HIDDEN, SEQ, HEADS, GROUPS, HEAD_DIM = 24, 6, 8, 2, 4
THRESHOLD = 10.0
STEPS = 4


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layout = HeadLayout(HEADS, GROUPS, HEAD_DIM)
        self.q = torch.nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.k = torch.nn.Linear(HIDDEN, GROUPS * HEAD_DIM, bias=False)
        self.v = torch.nn.Linear(HIDDEN, GROUPS * HEAD_DIM, bias=False)
        self.out = torch.nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)
        gs.qk_clip.register(self, layout=self.layout, q=self.q.weight, k=self.k.weight)
        with torch.no_grad():  # logits of ~10-50: groups cross τ on some steps and ranks, not on others
            self.q.weight.mul_(torch.linspace(2.0, 12.0, HEADS).repeat_interleave(HEAD_DIM)[:, None])

    def forward(self, x):
        b = x.shape[0]
        q = self.q(x).view(b, SEQ, HEADS, HEAD_DIM).transpose(1, 2)
        k, v = (m(x).view(b, SEQ, GROUPS, HEAD_DIM).transpose(1, 2).repeat_interleave(HEADS // GROUPS, dim=1)
                for m in (self.k, self.v))
        scores = q @ k.mT * HEAD_DIM ** -0.5
        gs.qk_clip.record(self, scores)
        y = scores.softmax(-1) @ v
        return self.out(y.transpose(1, 2).reshape(b, SEQ, -1))


def micro_batch(step: int, index: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + index)
    return torch.randn(2, SEQ, HIDDEN, generator=gen)


def train(rank: int, world_size: int, micro_batches: int = 1, optimizer: str = "adam") -> dict:
    """lr 0 (the update is the identity, so only the clip moves W_q / W_k). Rank r runs micro-batch r of
    each step; a single process runs ``micro_batches`` of them. With ``optimizer="muon"`` every weight is
    a Muon matrix, sharded layer-wise over the ranks (each owns whole matrices)."""
    model = Attention()
    config = gs.OptimizerConfig(optimizer=optimizer, lr=0.0, weight_decay=0.0, qk_clip=True,
                                qk_clip_threshold=THRESHOLD,
                                capture="graph" if world_size > 1 else "eager", capture_warmup_steps=1,
                                use_distributed_optimizer=world_size > 1, distributed_timeout_s=20.0)
    opt = gs.get_optimizer(config, model)
    local_maxima = []
    for step in range(STEPS):
        opt.zero_grad()
        for index in range(rank, rank + micro_batches):
            model(micro_batch(step, index)).pow(2).mean().backward()
        local_maxima.append(model.qk_clip_max_logits.clone())
        opt.step()
    return {"params": [p.detach().clone() for p in model.parameters()], "maxima": local_maxima,
            "captured": opt.captured}


def muon_layerwise(rank: int, world_size: int) -> dict:
    return train(rank, world_size, optimizer="muon")
