"""QK-clip: recomputed logits after clipping peak at min(S_g, τ) per query group (GQA, separate and fused
QKV); heads with S ≤ 0 stay finite and unscaled; flat shards; the recording helper; capture safety."""

import pytest
import torch

import capture
from graphstep.step.qk_clip import (HeadLayout, clip_factors, clip_qk_, record_max_logits, reset, row_factors,
                                    scale_flat_rows_, shard_row_index)

HIDDEN = 32


def attention_logits(x, wq, wk, num_heads, num_groups, head_dim):
    """(b, heads, s, s) scaled scores from separate weights, written out independently of the module."""
    b, s, _ = x.shape
    q = (x @ wq.T).view(b, s, num_heads, head_dim).transpose(1, 2)
    k = (x @ wk.T).view(b, s, num_groups, head_dim).transpose(1, 2)
    k = k.repeat_interleave(num_heads // num_groups, dim=1)
    return q @ k.mT * head_dim ** -0.5


def fuse(wq, wk, wv, num_groups):
    """Megatron's linear_qkv rows: per group [its query heads, its key, its value]."""
    per_group = [w.view(num_groups, -1, HIDDEN) for w in (wq, wk, wv)]
    return torch.cat(per_group, dim=1).reshape(-1, HIDDEN)


def unfuse(wqkv, num_heads, num_groups, head_dim):
    blocks = wqkv.view(num_groups, num_heads // num_groups + 2, head_dim, HIDDEN)
    q = blocks[:, :-2].reshape(-1, HIDDEN)
    return q, blocks[:, -2].reshape(-1, HIDDEN), blocks[:, -1].reshape(-1, HIDDEN)


def make_layer(seed, num_heads, num_groups, head_dim):
    gen = torch.Generator().manual_seed(seed)
    wq = torch.randn(num_heads * head_dim, HIDDEN, generator=gen)
    wk = torch.randn(num_groups * head_dim, HIDDEN, generator=gen)
    wv = torch.randn(num_groups * head_dim, HIDDEN, generator=gen)
    # Vary the head scales so the groups' maxima spread out.
    wq *= torch.linspace(0.3, 1.5, num_heads).repeat_interleave(head_dim)[:, None]
    micro_batches = [torch.randn(2, 6, HIDDEN, generator=gen) for _ in range(2)]
    return wq, wk, wv, micro_batches


def group_maxima(micro_batches, wq, wk, num_heads, num_groups, head_dim):
    per_head = torch.stack([attention_logits(x, wq, wk, num_heads, num_groups, head_dim).amax(dim=(0, 2, 3))
                            for x in micro_batches]).amax(dim=0)
    return per_head, per_head.view(num_groups, -1).amax(dim=1)


@pytest.mark.parametrize("num_heads,num_groups", [(8, 2), (8, 8), (6, 3)], ids=["gqa", "mha", "gqa3"])
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
@pytest.mark.parametrize("alpha", [0.5, 0.3])
def test_recomputed_group_max_is_min_of_s_and_tau(num_heads, num_groups, fused, alpha):
    head_dim = 8
    layout = HeadLayout(num_heads, num_groups, head_dim, fused_qkv=fused)
    wq, wk, wv, micro_batches = make_layer(0, num_heads, num_groups, head_dim)

    buffer = torch.empty(num_heads)
    reset(buffer)
    for x in micro_batches:  # the model records during forward, one call per micro-batch
        record_max_logits(buffer, attention_logits(x, wq, wk, num_heads, num_groups, head_dim))
    per_head, before = group_maxima(micro_batches, wq, wk, num_heads, num_groups, head_dim)
    assert torch.equal(buffer, per_head)

    tau = before.median().item()  # some groups clipped, some not
    q_factor, k_factor = clip_factors(buffer, layout, torch.tensor(tau, dtype=torch.float64), alpha)
    if fused:
        wqkv = fuse(wq, wk, wv, num_groups)
        clip_qk_(layout, q_factor, k_factor, qkv=wqkv)
        wq_new, wk_new, wv_new = unfuse(wqkv, num_heads, num_groups, head_dim)
        assert torch.equal(wv_new, wv)  # V untouched
    else:
        wq_new, wk_new = wq.clone(), wk.clone()
        clip_qk_(layout, q_factor, k_factor, q=wq_new, k=wk_new)

    _, after = group_maxima(micro_batches, wq_new, wk_new, num_heads, num_groups, head_dim)
    torch.testing.assert_close(after, torch.clamp(before, max=tau), rtol=2e-6, atol=0)
    unclipped = before <= tau
    assert unclipped.any() and (~unclipped).any()
    rows = torch.arange(num_groups).repeat_interleave(num_heads // num_groups * head_dim)
    assert torch.equal(wq_new[unclipped[rows]], wq[unclipped[rows]])  # factor exactly 1: bitwise


def test_fused_and_separate_scale_identically():
    layout_sep, layout_fused = HeadLayout(8, 2, 4), HeadLayout(8, 2, 4, fused_qkv=True)
    wq, wk, wv, _ = make_layer(1, 8, 2, 4)
    max_logits = torch.tensor([150.0, 20.0, 3.0, 90.0, 400.0, -1.0, 7.0, 8.0])
    q_factor, k_factor = clip_factors(max_logits, layout_sep, 100.0, 0.3)
    wqkv = fuse(wq, wk, wv, 2)
    clip_qk_(layout_fused, q_factor, k_factor, qkv=wqkv)
    clip_qk_(layout_sep, q_factor, k_factor, q=wq, k=wk)
    assert torch.equal(wqkv, fuse(wq, wk, wv, 2))
    # Group maxima 150 and 400: η = τ/S_g; W_q rows by η^α, W_k rows by η^(1−α).
    torch.testing.assert_close(q_factor, torch.tensor([(100 / 150) ** 0.3, (100 / 400) ** 0.3]))
    torch.testing.assert_close(k_factor, torch.tensor([(100 / 150) ** 0.7, (100 / 400) ** 0.7]))


def test_heads_at_or_below_zero_stay_finite_and_unscaled():
    layout = HeadLayout(4, 4, 2)
    max_logits = torch.tensor([250.0, -5.0, float("-inf"), 0.0])  # -inf: nothing recorded
    tau, alpha = 100.0, 0.5
    # Megatron's clamp(τ/S, max=1) ** α: NaN for the negative head, the bug this avoids.
    assert torch.isnan(torch.clamp(tau / max_logits, max=1) ** alpha)[1]
    q_factor, k_factor = clip_factors(max_logits, layout, tau, alpha)
    assert torch.equal(q_factor[1:], torch.ones(3)) and torch.equal(k_factor[1:], torch.ones(3))
    torch.testing.assert_close(q_factor[0] * k_factor[0], torch.tensor(100 / 250))
    wq, wk = torch.randn(8, HIDDEN), torch.randn(8, HIDDEN)
    new_q, new_k = wq.clone(), wk.clone()
    clip_qk_(layout, q_factor, k_factor, q=new_q, k=new_k)
    assert torch.isfinite(new_q).all() and torch.isfinite(new_k).all()
    assert torch.equal(new_q[2:], wq[2:]) and torch.equal(new_k[2:], wk[2:])
    assert not torch.equal(new_q[:2], wq[:2])


def test_flat_shards_match_the_2d_weight():
    layout = HeadLayout(6, 3, 4, fused_qkv=True)
    weight = torch.randn(3 * layout.fused_rows_per_group, HIDDEN)
    q_factor, k_factor = clip_factors(torch.tensor([300.0, 1.0, 2.0, 3.0, 120.0, 5.0]), layout, 100.0, 0.5)
    factors = row_factors(layout, q_factor, k_factor)["qkv"]
    clipped = weight.clone()
    clip_qk_(layout, q_factor, k_factor, qkv=clipped)
    flat = weight.flatten().clone()
    for start, numel in [(0, 101), (101, 250), (351, flat.numel() - 351)]:  # shards that cut rows
        scale_flat_rows_(flat[start:start + numel], factors, shard_row_index(start, numel, HIDDEN))
    assert torch.equal(flat, clipped.flatten())
    separate = row_factors(HeadLayout(6, 3, 4), q_factor, k_factor)
    assert separate["q"].shape == (24,) and separate["k"].shape == (12,)


def test_model_params_in_bf16_scale_like_the_fp32_main_params():
    layout = HeadLayout(4, 2, 4)
    wq, wk = torch.randn(16, HIDDEN), torch.randn(8, HIDDEN)
    q_bf16, k_bf16 = wq.bfloat16(), wk.bfloat16()
    q_factor, k_factor = clip_factors(torch.tensor([400.0, 1.0, 2.0, 3.0]), layout, 100.0, 0.5)
    clip_qk_(layout, q_factor, k_factor, q=wq, k=wk)
    clip_qk_(layout, q_factor, k_factor, q=q_bf16, k=k_bf16)
    assert q_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(q_bf16.float(), wq, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(k_bf16.float(), wk, rtol=1e-2, atol=1e-2)


def test_record_accepts_per_head_maxima_and_other_head_axes():
    buffer = torch.empty(3)
    reset(buffer)
    assert torch.equal(buffer, torch.full((3,), float("-inf")))
    record_max_logits(buffer, torch.tensor([1.0, -2.0, 5.0]))
    scores = torch.full((2, 4, 3, 4), -10.0, requires_grad=True)  # (b, s, heads, s_kv)
    record_max_logits(buffer, scores * 1 + torch.tensor([0.0, 0.0, 20.0])[None, None, :, None], head_dim=2)
    assert torch.equal(buffer, torch.tensor([1.0, -2.0, 10.0])) and not buffer.requires_grad
    with pytest.raises(ValueError, match="head_dim"):
        record_max_logits(buffer, torch.zeros(2, 4, 3, 4))  # heads on axis 2, default axis 1


def test_layout_and_argument_errors():
    with pytest.raises(ValueError, match="multiple of num_kv_groups"):
        HeadLayout(6, 4, 8)
    layout = HeadLayout(4, 2, 4)
    q_factor, k_factor = clip_factors(torch.zeros(4), layout, 1.0, 0.5)
    with pytest.raises(ValueError, match="both q= and k="):
        clip_qk_(layout, q_factor, k_factor, q=torch.zeros(16, HIDDEN))
    with pytest.raises(ValueError, match="declares separate"):
        clip_qk_(layout, q_factor, k_factor, qkv=torch.zeros(32, HIDDEN))
    with pytest.raises(ValueError, match="expected"):
        clip_qk_(layout, q_factor, k_factor, q=torch.zeros(12, HIDDEN), k=torch.zeros(8, HIDDEN))
    with pytest.raises(ValueError, match=r"\(4,\)"):
        clip_factors(torch.zeros(3), layout, 1.0, 0.5)


def test_capture_safe_and_live_threshold_under_replay():
    layout = HeadLayout(4, 2, 4, fused_qkv=True)
    weight = torch.randn(2 * layout.fused_rows_per_group, HIDDEN)
    eager_weight = weight.clone()
    buffer = torch.empty(4)
    tau = torch.tensor(100.0, dtype=torch.float64)
    logits = torch.zeros(1, 4, 2, 2)

    def forward_and_clip(w=weight):
        record_max_logits(buffer, logits)
        q_factor, k_factor = clip_factors(buffer, layout, tau, 0.5)
        clip_qk_(layout, q_factor, k_factor, qkv=w)
        reset(buffer)

    reset(buffer)
    assert capture.check(forward_and_clip) == []  # logits are 0: nothing clipped, weight unchanged
    graph = capture.graph(forward_and_clip, warmup=1, backend="replay")
    for step, (peak, threshold) in enumerate([(50.0, 100.0), (300.0, 100.0), (300.0, 150.0), (80.0, 60.0)]):
        logits.fill_(peak)
        tau.fill_(threshold)
        graph()
        forward_and_clip(eager_weight)
    assert graph.num_replays == 2
    assert torch.equal(weight, eager_weight)
    assert torch.isinf(buffer).all()  # reset at the end of each step


def test_a_non_finite_max_logit_leaves_its_group_unscaled():
    # An overflowed score (+inf) or NaN must not turn into eta = tau / inf = 0 and zero W_q and W_k.
    layout = HeadLayout(3, 3, 2)
    q_factor, k_factor = clip_factors(torch.tensor([float("inf"), float("nan"), 250.0]), layout, 100.0, 0.5)
    assert torch.equal(q_factor[:2], torch.ones(2)) and torch.equal(k_factor[:2], torch.ones(2))
    torch.testing.assert_close(q_factor[2] * k_factor[2], torch.tensor(100 / 250))


def megatron_factors(max_logits, layout, tau, alpha):
    """Megatron-Core's ``clip_qk`` factors, written out: η = clamp(τ / S_g, max=1), then (η^α, η^(1−α)).

    The oracle for groups with S_g > 0 (Megatron gives NaN at S ≤ 0, see the test above): a group at or under
    τ gets clamp(...) = 1 exactly, so Megatron leaves its weights bitwise unchanged.
    """
    group_max = max_logits.view(layout.num_kv_groups, -1).amax(dim=1)
    eta = torch.clamp(tau / group_max, max=1.0)
    return eta ** alpha, eta ** (1 - alpha)


@pytest.mark.parametrize("alpha", [0.3, 0.5, 0.7])
def test_unclipped_groups_stay_bitwise_unchanged_for_every_threshold(alpha):
    # Group 0 peaks at 10 (clipped only for τ < 10), group 1 at 350 (clipped for every τ here). τ/τ computed as
    # τ·(1/τ) is 0.99999994 for 40 of these τ, which once scaled an unclipped group's K (or Q) rows.
    layout = HeadLayout(4, 2, 2)
    max_logits = torch.tensor([10.0, 3.0, 350.0, -2.0])
    wq, wk = torch.randn(8, HIDDEN), torch.randn(4, HIDDEN)
    for tau in range(1, 301):
        oracle_q, oracle_k = megatron_factors(max_logits, layout, float(tau), alpha)
        for threshold in (float(tau), torch.tensor(tau, dtype=torch.float64), torch.tensor(float(tau))):
            q_factor, k_factor = clip_factors(max_logits, layout, threshold, alpha)
            new_q, new_k = wq.clone(), wk.clone()
            clip_qk_(layout, q_factor, k_factor, q=new_q, k=new_k)
            if tau >= 10:  # group 0 not over τ: factor exactly 1, rows bitwise unchanged, as in Megatron-Core
                assert q_factor[0].item() == 1.0 and k_factor[0].item() == 1.0, (tau, threshold)
                assert torch.equal(new_q[:4], wq[:4]) and torch.equal(new_k[:2], wk[:2]), (tau, threshold)
            if isinstance(threshold, float):  # same arithmetic as Megatron's (τ a Python float): bitwise
                assert torch.equal(q_factor, oracle_q) and torch.equal(k_factor, oracle_k), tau
            else:  # τ / S_g in a tensor division rounds apart from the float scalar's reciprocal
                torch.testing.assert_close(q_factor, oracle_q, rtol=2e-7, atol=0)
                torch.testing.assert_close(k_factor, oracle_k, rtol=2e-7, atol=0)
            assert not torch.equal(new_q[4:], wq[4:]) and not torch.equal(new_k[2:], wk[2:])  # group 1 clipped


def test_qk_clip_lives_in_one_module_that_the_public_one_re_exports():
    # The math, the registration and the step's stage in graphstep/step/qk_clip.py; gs.qk_clip is that module's.
    from pathlib import Path

    import graphstep as gs
    from graphstep.step import qk_clip as owner
    from graphstep.step.stages import Stage

    assert gs.qk_clip.__all__ and all(getattr(gs.qk_clip, name) is getattr(owner, name)
                                      for name in gs.qk_clip.__all__)
    assert owner.build_stage.__annotations__["return"] in (Stage, "Stage")
    stages = Path(owner.__file__).parent / "stages"
    assert not [p.name for p in stages.glob("*.py") if "qk" in p.name]
