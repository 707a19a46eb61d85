"""The built-in GPT and synthetic corpus (graphstep.app.models): shapes, determinism from the seed, and that
it learns."""

import math

import pytest
import torch

import graphstep as gs
from graphstep.app import models

# Smaller than tiny() so the learning test takes a second or two.
MICRO = models.tiny(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2, d_ff=64)


def test_logits_and_loss_shapes():
    config = models.tiny()
    model = models.GPT(config, seed=0)
    inputs, targets = models.SyntheticCorpus(config.vocab_size, seed=0).batch(0, batch_size=3,
                                                                             seq_len=config.seq_len)
    assert inputs.shape == targets.shape == (3, config.seq_len)
    assert inputs.dtype == torch.int64
    assert model(inputs).shape == (3, config.seq_len, config.vocab_size)
    loss = model(inputs, targets)
    assert loss.shape == () and loss.dtype == torch.float32
    # Untrained: about ln(vocab), the loss of a uniform guess.
    assert abs(loss.item() - math.log(config.vocab_size)) < 0.2


def test_shorter_sequences_and_too_long():
    model = models.GPT(MICRO)
    assert model(torch.zeros(2, 5, dtype=torch.int64)).shape == (2, 5, MICRO.vocab_size)
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, MICRO.seq_len + 1, dtype=torch.int64))


def test_presets_and_param_count():
    tiny, small = models.tiny(), models.small()
    assert models.preset("tiny") == tiny and models.preset("small") == small
    assert models.tiny(n_layers=1).n_layers == 1
    n_tiny, n_small = models.GPT(tiny).num_params(), models.GPT(small).num_params()
    assert 0.5e6 < n_tiny < 1.5e6 < n_small
    with pytest.raises(ValueError, match="unknown model preset"):
        models.preset("huge")


def test_bad_config():
    with pytest.raises(ValueError, match="n_heads"):
        models.GPTConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="d_model"):
        models.GPTConfig(d_model=0)


def test_embedding_and_output_params_marked():
    model = models.GPT(MICRO)
    marked = {name for name, p in model.named_parameters() if getattr(p, "is_embedding_or_output_parameter", False)}
    assert marked == {"wte.weight", "wpe.weight", "head.weight"}


def test_init_is_deterministic_from_seed_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a, b, c = models.GPT(MICRO, seed=7), models.GPT(MICRO, seed=7), models.GPT(MICRO, seed=8)
    assert torch.equal(torch.get_rng_state(), before)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.wte.weight, c.wte.weight)
    assert torch.equal(a.blocks[0].ln_1.weight, torch.ones(MICRO.d_model))
    assert torch.equal(a.blocks[0].attn.qkv.bias, torch.zeros(3 * MICRO.d_model))


def test_corpus_is_deterministic_and_structured():
    corpus = models.SyntheticCorpus(64, seed=3)
    x1, y1 = corpus.batch(5, 4, 16)
    x2, y2 = models.SyntheticCorpus(64, seed=3).batch(5, 4, 16)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])
    assert not torch.equal(corpus.batch(6, 4, 16)[0], x1)
    assert not torch.equal(models.SyntheticCorpus(64, seed=4).batch(5, 4, 16)[0], x1)
    assert int(x1.min()) >= 0 and int(x1.max()) < 64
    assert torch.allclose(corpus.transition.sum(dim=1), torch.ones(64, dtype=torch.float64))
    # Learnable: the entropy rate is far below the uniform ln(vocab).
    assert corpus.entropy_rate() < 0.5 * math.log(64)
    stream = models.batches(seed=3, batch_size=4, seq_len=16, vocab_size=64, start=5)
    assert torch.equal(next(stream)[0], x1)
    assert torch.equal(next(stream)[0], corpus.batch(6, 4, 16)[0])


def test_loss_decreases_with_adamw():
    model = models.GPT(MICRO, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    data = models.batches(seed=0, batch_size=16, seq_len=MICRO.seq_len, vocab_size=MICRO.vocab_size)
    losses = []
    for _ in range(50):
        inputs, targets = next(data)
        loss = model(inputs, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.5, (first, last)


def test_qk_clip_preset_registers_every_attention_and_records_its_max_logits():
    model = models.GPT(models.tiny(qk_clip=True))
    attentions = [m for m in model.modules() if isinstance(m, models.CausalSelfAttention)]
    assert len(gs.qk_clip.registrations(model.parameters())) == len(attentions) == models.tiny().n_layers
    buffer = getattr(attentions[0], gs.qk_clip.BUFFER_NAME)
    assert attentions[0].qkv.bias is None and torch.isinf(buffer).all()  # nothing recorded yet
    model(torch.randint(0, 256, (2, 16)))
    assert torch.isfinite(buffer).all()  # each head's max logit of that forward
    model.eval()
    before = buffer.clone()
    model(torch.randint(0, 256, (2, 16)) * 0)
    assert torch.equal(buffer, before)  # eval forwards do not count
