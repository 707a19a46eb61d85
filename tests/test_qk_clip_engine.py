"""QK-clip through the engine: registered attention layers, the stage after the update (skipped step or
not), recomputed logits peaking at min(S_g, τ) per query group, eager = replay, S ≤ 0 stays finite."""

import pytest
import torch

import graphstep as gs
from graphstep.step.qk_clip import HeadLayout

HIDDEN, SEQ = 32, 6


class Attention(torch.nn.Module):
    """Grouped-query attention with separate or Megatron-fused QKV weights, recording its max logits."""

    def __init__(self, num_heads, num_groups, head_dim, fused, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.layout = HeadLayout(num_heads, num_groups, head_dim, fused_qkv=fused)
        q_rows, kv_rows = num_heads * head_dim, num_groups * head_dim
        if fused:
            self.qkv = torch.nn.Linear(HIDDEN, q_rows + 2 * kv_rows, bias=False)
            gs.qk_clip.register(self, layout=self.layout, qkv=self.qkv.weight)
        else:
            self.q = torch.nn.Linear(HIDDEN, q_rows, bias=False)
            self.k = torch.nn.Linear(HIDDEN, kv_rows, bias=False)
            self.v = torch.nn.Linear(HIDDEN, kv_rows, bias=False)
            gs.qk_clip.register(self, layout=self.layout, q=self.q.weight, k=self.k.weight)
        with torch.no_grad():  # spread the heads' scales so that some groups clip and others do not
            wq = self.weights()[0]
            wq.mul_(torch.linspace(0.3, 2.0, num_heads).repeat_interleave(head_dim)[:, None] * 6)
        self.out = torch.nn.Linear(q_rows, HIDDEN, bias=False)

    def weights(self):
        """(W_q, W_k, W_v) as views of the params."""
        if not self.layout.fused_qkv:
            return self.q.weight, self.k.weight, self.v.weight
        lay = self.layout
        blocks = self.qkv.weight.view(lay.num_kv_groups, lay.fused_rows_per_group, HIDDEN)
        q_rows = lay.q_rows_per_group
        return (blocks[:, :q_rows].reshape(-1, HIDDEN), blocks[:, q_rows:q_rows + lay.head_dim].reshape(-1, HIDDEN),
                blocks[:, q_rows + lay.head_dim:].reshape(-1, HIDDEN))

    @torch.no_grad()
    def boost_queries(self, factor):
        """W_q times ``factor``, in place (every logit times ``factor``): drives groups over τ."""
        if self.layout.fused_qkv:
            lay = self.layout
            self.qkv.weight.view(lay.num_kv_groups, lay.fused_rows_per_group, HIDDEN)[:, :lay.q_rows_per_group] \
                .mul_(factor)
        else:
            self.q.weight.mul_(factor)

    def scores_and_values(self, x):
        lay = self.layout
        wq, wk, wv = self.weights()
        b = x.shape[0]
        q = (x @ wq.T).view(b, SEQ, lay.num_heads, lay.head_dim).transpose(1, 2)
        k, v = ((x @ w.T).view(b, SEQ, lay.num_kv_groups, lay.head_dim).transpose(1, 2) for w in (wk, wv))
        k, v = (t.repeat_interleave(lay.heads_per_group, dim=1) for t in (k, v))
        return q @ k.mT * lay.head_dim ** -0.5, v

    def forward(self, x):
        scores, v = self.scores_and_values(x)
        gs.qk_clip.record(self, scores)
        y = scores.float().softmax(-1).to(v.dtype) @ v
        return self.out(y.transpose(1, 2).reshape(x.shape[0], SEQ, -1))


def micro_batches(step, count=2):
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(2, SEQ, HIDDEN, generator=gen) for _ in range(count)]


def group_maxima(model, batches):
    with torch.no_grad():
        per_head = torch.stack([model.scores_and_values(x.to(model.out.weight.dtype))[0].float().amax(dim=(0, 2, 3))
                                for x in batches]).amax(dim=0)
    return per_head.view(model.layout.num_kv_groups, -1).amax(dim=1)


def make(num_heads=8, num_groups=2, fused=False, threshold=10.0, mode="graph", **changes):
    model = Attention(num_heads, num_groups, 4, fused)
    # lr 0: the update leaves W_q / W_k as they were, so the clip alone moves them and min(S_g, τ) is exact.
    settings = dict(lr=0.0, weight_decay=0.0, qk_clip=True, qk_clip_threshold=threshold, capture=mode,
                    capture_warmup_steps=1)
    config = gs.OptimizerConfig(**{**settings, **changes})
    return model, gs.get_optimizer(config, model)


def train_step(model, opt, step, inject_inf=False):
    batches = micro_batches(step)
    opt.zero_grad()
    for x in batches:  # the running max covers both micro-batches
        model(x.to(model.out.weight.dtype)).float().pow(2).mean().backward()
    if inject_inf:
        model.out.weight.main_grad[0, 0] = float("inf")
    before = group_maxima(model, batches)
    result = opt.step()
    return before, group_maxima(model, batches), result


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
@pytest.mark.parametrize("num_heads,num_groups", [(8, 2), (4, 4)], ids=["gqa", "mha"])
def test_recomputed_group_max_is_min_of_s_and_tau_through_the_engine(fused, num_heads, num_groups):
    threshold = 10.0
    model, opt = make(num_heads, num_groups, fused, threshold)
    clipped = 0
    for step in range(5):
        model.boost_queries(3.0)
        before, after, result = train_step(model, opt, step, inject_inf=step == 3)
        assert bool(result.update_successful) == (step != 3)  # the clip applies to a skipped step too
        torch.testing.assert_close(after, torch.minimum(before, torch.tensor(threshold)), rtol=2e-6, atol=0)
        clipped += int((before > threshold).sum())
    assert opt.captured and clipped >= 3
    assert torch.all(model.qk_clip_max_logits == float("-inf"))  # reset for the next step's forwards


def test_v_and_unclipped_groups_stay_bitwise_unchanged():
    model, opt = make(8, 2, fused=True, threshold=1e6)  # nothing exceeds τ
    before = model.qkv.weight.detach().clone()
    train_step(model, opt, 0)
    assert torch.equal(model.qkv.weight, before)
    model, opt = make(8, 2, fused=True, threshold=10.0)
    wv = model.weights()[2].detach().clone()
    train_step(model, opt, 0)
    assert torch.equal(model.weights()[2], wv)


def test_bf16_params_are_clipped_through_the_fp32_main_params():
    model, opt = make(8, 2, fused=False, bf16=True)
    before, after, _ = train_step(model, opt, 0)
    assert model.q.weight.dtype == torch.bfloat16
    main_q = opt.buffers.main_shard[0][opt.layout.params[0].start:opt.layout.params[0].end].view(32, HIDDEN)
    assert torch.equal(model.q.weight, main_q.to(torch.bfloat16))
    assert (before > 10.0).any()
    torch.testing.assert_close(after, torch.minimum(before, torch.tensor(10.0)), rtol=2e-2, atol=0)


def test_replay_equals_eager_bitwise_with_muon():
    results = []
    for mode in ("eager", "graph"):
        model, opt = make(8, 2, fused=True, mode=mode, optimizer="muon", lr=0.01, kernel="reference")
        for step in range(6):
            model.boost_queries(2.0)
            train_step(model, opt, step)
        results.append([p.detach().clone() for p in model.parameters()])
    assert opt.captured and opt.recaptures == 0
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_heads_at_or_below_zero_stay_finite_and_unscaled():
    model, opt = make(4, 4, fused=False, threshold=5.0)
    before = [w.detach().clone() for w in model.weights()]
    opt.zero_grad()
    model(micro_batches(0)[0]).pow(2).mean().backward()
    # What Transformer Engine's return_max_logit hands over: per-head maxima, here non-positive or absent.
    model.qk_clip_max_logits.copy_(torch.tensor([-3.0, 0.0, float("-inf"), 50.0]))
    opt.step()
    wq, wk, _ = model.weights()
    assert torch.isfinite(wq).all() and torch.isfinite(wk).all()
    assert torch.equal(wq[:12], before[0][:12]) and torch.equal(wk[:12], before[1][:12])
    assert not torch.equal(wq[12:], before[0][12:])


def test_registration_errors_say_what_to_do():
    layout = HeadLayout(4, 2, 4)
    lin = torch.nn.Linear(HIDDEN, 16, bias=False)
    with pytest.raises(ValueError, match="pass qkv= .* or both q= and k="):
        gs.qk_clip.register(torch.nn.Module(), layout=layout, q=lin.weight)
    with pytest.raises(ValueError, match="8 rows"):
        gs.qk_clip.register(torch.nn.Module(), layout=layout, q=lin.weight, k=lin.weight)
    with pytest.raises(ValueError, match="no attention layer of the model is registered"):
        gs.get_optimizer(gs.OptimizerConfig(qk_clip=True), torch.nn.Linear(4, 4))
    fused = torch.nn.Linear(HIDDEN, 16 + 16, bias=False)
    gs.qk_clip.register(torch.nn.Module(), layout=HeadLayout(4, 2, 4, fused_qkv=True), qkv=fused.weight)
    assert fused.weight.qkv_split == gs.QKVSplit(2, 8, 4, 4)  # Muon's split QKV follows the head layout


def params_and_main_shards(model, opt):
    return [p.detach().clone() for p in model.parameters()] + [s.clone() for s in opt.buffers.main_shard]


# τ for which τ·(1/τ) (how torch divides a Python float by a tensor) is 0.99999994: with α = 0.3 or 0.7 the
# old factor of an unclipped group rounded below 1 and moved its K (or Q) rows.
@pytest.mark.parametrize("threshold", [41.0, 47.0, 55.0])
@pytest.mark.parametrize("alpha", [0.3, 0.5, 0.7])
def test_no_group_over_tau_steps_bitwise_like_qk_clip_off(threshold, alpha):
    results = []
    for qk_clip in (True, False):
        model, opt = make(threshold=threshold, qk_clip=qk_clip, qk_clip_alpha=alpha, lr=1e-3, mode="eager")
        for step in range(3):
            before, _, result = train_step(model, opt, step)
            assert bool(result.update_successful) and (before < threshold).all()  # nothing clipped, params moved
        results.append(params_and_main_shards(model, opt))
    assert len(results[0]) == len(results[1])
    for with_clip, without in zip(*results):
        assert torch.equal(with_clip, without)


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("alpha", [0.3, 0.7])
def test_only_clipped_groups_move_by_megatrons_factors(mode, alpha):
    # Per-head maxima handed over (as from Transformer Engine). Steps 0-1 (warm-up, capture): every group under
    # τ = 41, so the runs with and without QK-clip stay identical. Step 2: group 0 under τ, group 1 over it.
    threshold = 41.0
    under = torch.tensor([10.0, 3.0, 7.0, 9.0, 40.0, 20.0, 5.0, 1.0])
    mixed = torch.tensor([10.0, 3.0, 7.0, 9.0, 300.0, 20.0, 5.0, 1.0])
    results = []
    for qk_clip in (True, False):
        model, opt = make(8, 2, fused=False, threshold=threshold, qk_clip=qk_clip, qk_clip_alpha=alpha, lr=1e-3,
                          mode=mode)
        for step, maxima in enumerate((under, under, mixed)):
            opt.zero_grad()
            model(micro_batches(step)[0]).pow(2).mean().backward()
            model.qk_clip_max_logits.copy_(maxima)
            opt.step()
        results.append((model.q.weight.detach().clone(), model.k.weight.detach().clone()))
    assert mode == "eager" or opt.captured
    (q_on, k_on), (q_off, k_off) = results
    # Megatron-Core's clip on the same update: (η^α, η^(1−α)) per group, η = clamp(τ/S_g, max=1) = (1, τ/300).
    eta = torch.clamp(threshold / mixed.view(2, 4).amax(dim=1), max=1.0)
    assert eta[0].item() == 1.0 and eta[1].item() < 1.0
    q_rows, k_rows = (eta ** alpha).repeat_interleave(16), (eta ** (1 - alpha)).repeat_interleave(4)
    assert torch.equal(q_on, q_off * q_rows[:, None]) and torch.equal(k_on, k_off * k_rows[:, None])
    assert torch.equal(q_on[:16], q_off[:16]) and torch.equal(k_on[:4], k_off[:4])  # group 0: bitwise untouched


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_record_on_an_unregistered_module_says_how_to_register(training):
    module = torch.nn.Linear(HIDDEN, HIDDEN).train(training)
    with pytest.raises(gs.qk_clip.NotRegisteredError, match=r"Linear is not registered for QK-clip.*"
                                                            r"graphstep\.qk_clip\.register\(module, layout="):
        gs.qk_clip.record(module, torch.zeros(1, 4, SEQ, SEQ))
    assert issubclass(gs.qk_clip.NotRegisteredError, ValueError)
