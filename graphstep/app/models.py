"""The built-in model and data: a small GPT-style decoder and a synthetic corpus it can learn.

Used by ``graphstep demo`` and the examples; nothing in the engine depends on it. No downloads: the corpus is
a fixed random Markov chain generated from a seed, so the loss falls from ``ln(vocab_size)`` towards the
chain's entropy rate. The model follows nanoGPT's layout with an untied output head (every param a separate
tensor); embedding and output weights carry ``is_embedding_or_output_parameter = True`` for ``decoupled_lr``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

import graphstep as gs


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    """Number of token ids; the corpus uses the same vocabulary."""

    seq_len: int = 64
    """Longest sequence the position embedding covers."""

    d_model: int = 128
    """Width of the residual stream."""

    n_layers: int = 4
    """Number of transformer blocks."""

    n_heads: int = 4
    """Attention heads per block; must divide ``d_model``."""

    d_ff: int = 512
    """Hidden width of each block's MLP."""

    qk_clip: bool = False
    """Attention ready for QK-clip (``graphstep.qk_clip``): the fused QKV weight in Megatron's grouped layout
    (rows [q_h; k_h; v_h] per head, no bias, so a clipped max logit is exactly the threshold), registered
    at construction, and each head's max attention logit recorded in every training forward."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "d_ff"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name}={value!r}: must be a positive int")
        if self.d_model % self.n_heads:
            raise ValueError(f"GPTConfig: n_heads={self.n_heads} must divide d_model={self.d_model}")

    def replace(self, **changes) -> "GPTConfig":
        return dataclasses.replace(self, **changes)


# ---- presets (plain functions, like torchtitan's) -------------------------------------------------------
def tiny(**changes) -> GPTConfig:
    """~0.9M params: trains a few hundred steps on two CPU cores in well under a minute."""
    return GPTConfig(vocab_size=256, seq_len=64, d_model=128, n_layers=4, n_heads=4, d_ff=512).replace(**changes)


def small(**changes) -> GPTConfig:
    """~5M params: a heavier CPU run (several times tiny's step time)."""
    return GPTConfig(vocab_size=512, seq_len=128, d_model=256, n_layers=6, n_heads=8, d_ff=1024).replace(**changes)


PRESETS = {"tiny": tiny, "small": small}


def preset(name: str, **changes) -> GPTConfig:
    """The preset called ``name`` ("tiny" or "small")."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}: choose one of {', '.join(PRESETS)}")
    return PRESETS[name](**changes)


# ---- the model -------------------------------------------------------------------------------------------
class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.qk_clip = config.qk_clip
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=not config.qk_clip)
        self.proj = nn.Linear(config.d_model, config.d_model)
        if config.qk_clip:
            head_dim = config.d_model // config.n_heads
            layout = gs.HeadLayout(config.n_heads, config.n_heads, head_dim, fused_qkv=True)
            gs.qk_clip.register(self, layout=layout, qkv=self.qkv.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qk_clip:
            return self._forward_recording_logits(x)
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=-1)
        # (batch, seq, width) -> (batch, heads, seq, head_dim)
        q, k, v = (t.view(batch, seq, self.n_heads, width // self.n_heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, width))

    def _forward_recording_logits(self, x: torch.Tensor) -> torch.Tensor:
        # The scores are materialised (SDPA does not return them) so QK-clip sees each head's max logit.
        batch, seq, width = x.shape
        head_dim = width // self.n_heads
        q, k, v = self.qkv(x).view(batch, seq, self.n_heads, 3, head_dim).unbind(3)  # grouped layout
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * head_dim ** -0.5
        future = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
        gs.qk_clip.record(self, scores)  # (batch, heads, seq, seq): heads on dim 1
        y = scores.softmax(dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(batch, seq, width))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.d_model, config.d_ff)
        self.proj = nn.Linear(config.d_ff, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer. ``model(inputs)`` gives logits; ``model(inputs, targets)`` the mean
    cross-entropy (computed in fp32 whatever the param dtype)."""

    def __init__(self, config: GPTConfig, seed: int = 0):
        super().__init__()
        self.config = config
        # The layers' default init draws from the global RNG; it is overwritten below, so keep the
        # global stream as the caller left it.
        with torch.random.fork_rng(devices=[]):
            self.wte = nn.Embedding(config.vocab_size, config.d_model)
            self.wpe = nn.Embedding(config.seq_len, config.d_model)
            self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
            self.ln_f = nn.LayerNorm(config.d_model)
            self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        for p in (self.wte.weight, self.wpe.weight, self.head.weight):
            p.is_embedding_or_output_parameter = True
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """GPT-2's init from a private generator: the same seed gives the same weights, and the global RNG
        is left alone. Weights N(0, 0.02), residual projections N(0, 0.02 / sqrt(2 n_layers)), biases 0,
        LayerNorm (1, 0)."""
        generator = torch.Generator().manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, p in self.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
            elif ".ln_" in name or name.startswith("ln_"):
                p.fill_(1.0)
            else:
                std = residual_std if name.endswith("proj.weight") else 0.02
                # Drawn on the CPU in fp32, then copied: identical weights on every device and dtype.
                p.copy_(torch.randn(p.shape, generator=generator) * std)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, inputs: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        seq = inputs.shape[1]
        if seq > self.config.seq_len:
            raise ValueError(f"GPT: sequence of {seq} tokens is longer than seq_len={self.config.seq_len}")
        positions = torch.arange(seq, device=inputs.device)
        x = self.wte(inputs) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


# ---- the synthetic corpus --------------------------------------------------------------------------------
class SyntheticCorpus:
    """A fixed random first-order Markov chain over ``vocab_size`` tokens.

    Each token has ``branching`` likely successors (random weights); with probability ``noise`` the next
    token is uniform instead. A model that learns the table reaches ``entropy_rate()`` nats per token,
    far below the ``ln(vocab_size)`` of the untrained model. ``batch(step, ...)`` is a pure function of
    (seed, step, shape): the same call gives the same tokens, on any device.
    """

    def __init__(self, vocab_size: int, seed: int = 0, branching: int = 4, noise: float = 0.05):
        if not 1 <= branching <= vocab_size:
            raise ValueError(f"SyntheticCorpus: branching={branching} must lie in [1, vocab_size={vocab_size}]")
        if not 0.0 <= noise <= 1.0:
            raise ValueError(f"SyntheticCorpus: noise={noise} must lie in [0, 1]")
        self.vocab_size = vocab_size
        self.seed = seed
        generator = torch.Generator().manual_seed(seed)
        successors = torch.rand(vocab_size, vocab_size, generator=generator).argsort(dim=1)[:, :branching]
        weights = torch.rand(vocab_size, branching, generator=generator, dtype=torch.float64) + 0.5
        table = torch.zeros(vocab_size, vocab_size, dtype=torch.float64)
        table.scatter_(1, successors, weights / weights.sum(dim=1, keepdim=True))
        self.transition = (1.0 - noise) * table + noise / vocab_size
        """(vocab, vocab) float64: row i is the distribution of the token after token i."""
        self._cdf = self.transition.cumsum(dim=1)
        self._cdf[:, -1] = 1.0

    def entropy_rate(self) -> float:
        """The loss (nats per token) of a model that knows the table: the chain's entropy rate."""
        stationary = torch.full((self.vocab_size,), 1.0 / self.vocab_size, dtype=torch.float64)
        for _ in range(200):
            stationary = stationary @ self.transition
        row_entropy = -(self.transition * self.transition.log()).sum(dim=1)
        return float(stationary @ row_entropy)

    def batch(self, step: int, batch_size: int, seq_len: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), both (batch_size, seq_len) int64; targets are inputs shifted by one."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        tokens = torch.empty(batch_size, seq_len + 1, dtype=torch.int64)
        tokens[:, 0] = torch.randint(0, self.vocab_size, (batch_size,), generator=generator)
        uniforms = torch.rand(seq_len, batch_size, 1, generator=generator, dtype=torch.float64)
        for t in range(seq_len):  # one vectorised draw per position: the chain is sequential in t
            cdf = self._cdf[tokens[:, t]]
            nxt = torch.searchsorted(cdf, uniforms[t]).squeeze(1)
            tokens[:, t + 1] = nxt.clamp_(max=self.vocab_size - 1)
        tokens = tokens.to(device)
        return tokens[:, :-1], tokens[:, 1:]


def batches(seed: int, batch_size: int, seq_len: int, vocab_size: int, device="cpu",
            start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (inputs, targets) batches of ``SyntheticCorpus(vocab_size, seed)``, from step ``start``."""
    corpus = SyntheticCorpus(vocab_size, seed)
    step = start
    while True:
        yield corpus.batch(step, batch_size, seq_len, device)
        step += 1


def gpt_loss(model: GPT, batch: tuple) -> torch.Tensor:
    """The GPT's mean cross-entropy over an (inputs, targets) batch: the ``loss_fn`` a ``graphstep.Iteration``
    over it calls per micro-batch."""
    inputs, targets = batch
    return model(inputs, targets)


def micro_batches(inputs: torch.Tensor, targets: torch.Tensor, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A batch's rows dealt into ``k`` micro-batches (row i to micro-batch i mod k)."""
    return [(inputs[i::k], targets[i::k]) for i in range(k)]
