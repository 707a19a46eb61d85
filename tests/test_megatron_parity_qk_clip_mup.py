"""Megatron parity at the edges: a QK-clip group whose max logit is exactly τ, and Megatron's "dist_muon" spelling
in ``get_mup_config_overrides``."""

import types
import warnings

import pytest
import torch

import graphstep as gs
from graphstep.plan.overrides import get_mup_config_overrides
from graphstep.qk_clip import HeadLayout, clip_factors, clip_qk_

HIDDEN = 6
# τ for which τ·(1/τ), how torch divides a Python float by a tensor, is 0.99999994 (41 among them), and some for
# which it is 1.
THRESHOLDS = [41.0, 47.0, 55.0, 61.0, 10.0, 100.0]


def _thresholds(tau: float) -> list:
    return [tau, torch.tensor(tau), torch.tensor(tau, dtype=torch.float64)]


@pytest.mark.parametrize("alpha", [0.3, 0.5, 0.7])
@pytest.mark.parametrize("tau", THRESHOLDS)
def test_a_group_whose_max_is_exactly_tau_is_left_bitwise_unchanged(tau, alpha):
    # The reference (Kimi K2's QK-clip): η = min(1, τ / S), exactly 1 at S = τ, so the rows keep
    # their bits; group 1 (S = 350) is clipped in the same call. Separate and fused weights.
    layout, fused = HeadLayout(4, 2, 2), HeadLayout(4, 2, 2, fused_qkv=True)
    maxima = torch.tensor([tau, 3.0, 350.0, -2.0])
    torch.manual_seed(0)
    wq, wk, wqkv = torch.randn(8, HIDDEN), torch.randn(4, HIDDEN), torch.randn(16, HIDDEN)
    for threshold in _thresholds(tau):
        q_factor, k_factor = clip_factors(maxima, layout, threshold, alpha)
        assert q_factor[0].item() == 1.0 and k_factor[0].item() == 1.0, (tau, threshold)
        q, k, qkv = wq.clone(), wk.clone(), wqkv.clone()
        clip_qk_(layout, q_factor, k_factor, q=q, k=k)
        clip_qk_(fused, q_factor, k_factor, qkv=qkv)
        assert torch.equal(q[:4], wq[:4]) and torch.equal(k[:2], wk[:2]), (tau, threshold)
        assert torch.equal(qkv[:8], wqkv[:8]), (tau, threshold)  # group 0's block: its Q, K and V rows
        eta = torch.tensor(tau, dtype=torch.float64) / 350.0  # group 1: clipped by τ / S
        torch.testing.assert_close(q_factor[1].double(), eta ** alpha, rtol=3e-7, atol=0)
        torch.testing.assert_close(k_factor[1].double(), eta ** (1 - alpha), rtol=3e-7, atol=0)


class Attention(torch.nn.Module):
    """Separate W_q (8 rows: 4 heads of 2) and W_k (4 rows: 2 query groups), registered for QK-clip; its loss
    touches both, and the test writes the per-head maxima itself (as Transformer Engine hands them over)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.q = torch.nn.Parameter(torch.randn(8, HIDDEN))
        self.k = torch.nn.Parameter(torch.randn(4, HIDDEN))
        gs.qk_clip.register(self, layout=HeadLayout(4, 2, 2), q=self.q, k=self.k)

    def forward(self, x):
        return (x @ self.q.T).square().mean() + (x @ self.k.T).square().mean()


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("alpha", [0.3, 0.7])
def test_the_engine_leaves_a_group_at_exactly_tau_bitwise_unchanged(mode, alpha):
    # lr 0: only the clip moves the weights. Steps 0-1 (warm-up, capture) have every group under τ; step 2 has
    # group 0 at exactly τ and group 1 over it, on the main params and the model params alike.
    tau = 41.0
    under = torch.tensor([10.0, 3.0, 7.0, 9.0])
    at_and_over = torch.tensor([tau, 3.0, 300.0, 9.0])
    model = Attention()
    q0, k0 = model.q.detach().clone(), model.k.detach().clone()
    opt = gs.get_optimizer(gs.OptimizerConfig(lr=0.0, weight_decay=0.0, qk_clip=True, qk_clip_threshold=tau,
                                              qk_clip_alpha=alpha, capture=mode, capture_warmup_steps=1), model)
    for maxima in (under, under, at_and_over):
        opt.zero_grad()
        model(torch.randn(3, HIDDEN)).backward()
        model.qk_clip_max_logits.copy_(maxima)
        opt.step()
    assert mode == "eager" or opt.captured
    assert torch.equal(model.q[:4], q0[:4]) and torch.equal(model.k[:2], k0[:2])  # group 0: bitwise
    assert not torch.equal(model.q[4:], q0[4:]) and not torch.equal(model.k[2:], k0[2:])  # group 1 clipped


def _megatron_clip_qk(maxima, weight, heads, groups, head_dim, tau, alpha):
    """Megatron-Core 0.16.1's own ``SelfAttention.clip_qk`` (fused QKV weight) on a stand-in for the layer: the
    attributes its code reads, nothing else."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron.core warns that Transformer Engine and Apex are missing
        attention = pytest.importorskip("megatron.core.transformer.attention",
                                        reason="megatron-core is not installed (the test extra)")
    layer = types.SimpleNamespace(
        config=types.SimpleNamespace(qk_clip=True, qk_clip_threshold=tau, qk_clip_alpha=alpha),
        core_attention=types.SimpleNamespace(current_max_attn_logits=maxima.clone()),
        num_attention_heads_per_partition=heads, num_query_groups_per_partition=groups,
        query_projection_size=heads * head_dim, kv_projection_size=groups * head_dim,
        linear_qkv=types.SimpleNamespace(weight=torch.nn.Parameter(weight.clone())))
    layer._clip_linear_qkv = types.MethodType(attention.SelfAttention._clip_linear_qkv, layer)
    attention.SelfAttention.clip_qk(layer)
    return layer.linear_qkv.weight.detach()


@pytest.mark.parametrize("alpha", [0.3, 0.5, 0.7])
@pytest.mark.parametrize("tau", THRESHOLDS)
def test_against_megatrons_clip_qk_only_a_group_at_exactly_tau_differs_by_megatrons_rounding(tau, alpha):
    # Megatron computes η = clamp(τ / S, max=1) with τ a Python float: torch evaluates τ / S as τ·(1/S), which at
    # S = τ is 0.99999994 for τ = 41, 47, 55, 61; its power then moves that group's rows by about one ulp (α ≠ 0.5)
    # although the group is not over τ. graphstep keeps them (the test above); every other group is bitwise
    # Megatron's.
    heads, groups, head_dim = 4, 2, 2
    layout = HeadLayout(heads, groups, head_dim, fused_qkv=True)
    torch.manual_seed(1)
    weight = torch.randn((heads + 2 * groups) * head_dim, HIDDEN)
    for maxima in (torch.tensor([5.0, 3.0, 350.0, 5.0]), torch.tensor([tau, 3.0, 350.0, 5.0])):
        theirs = _megatron_clip_qk(maxima, weight, heads, groups, head_dim, tau, alpha)
        ours = weight.clone()
        clip_qk_(layout, *clip_factors(maxima, layout, tau, alpha), qkv=ours)
        assert torch.equal(ours[8:], theirs[8:]), (tau, alpha)  # group 1, over τ: bitwise Megatron's
        assert torch.equal(ours[:8], weight[:8])  # group 0, at or under τ: unchanged
        reciprocal_rounds = (tau * (1 / torch.tensor(tau))).item() != 1.0
        at_tau = maxima[0] == tau and reciprocal_rounds
        if at_tau and alpha != 0.5:
            assert not torch.equal(theirs[:6], weight[:6])  # Megatron's ulp on group 0's Q and K rows
            torch.testing.assert_close(theirs[:8], weight[:8], rtol=2.5e-7, atol=0)
        elif at_tau:
            # η^0.5 falls within a hair of half an ulp below 1: whether Megatron's rows move depends on the
            # processor's pow (they stay on the AMD EPYC machines here, move an ulp on an Intel Xeon)
            torch.testing.assert_close(theirs[:8], weight[:8], rtol=2.5e-7, atol=0)
        else:
            assert torch.equal(theirs[:8], weight[:8]), (tau, alpha)


@pytest.mark.parametrize("spelling", ["dist_muon", "DIST_MUON", "Dist_Muon"])
def test_mup_accepts_megatrons_dist_muon_spelling_as_muon(spelling):
    # Megatron-Core's MuP test: for 'muon' and 'dist_muon' alike one override, lr and min_lr / m, no eps.
    config = gs.OptimizerConfig(lr=1e-3, min_lr=1e-5)
    overrides = get_mup_config_overrides(config, 4.0, optimizer_type=spelling)
    muon = get_mup_config_overrides(config, 4.0, optimizer_type="muon")
    assert list(overrides.values()) == list(muon.values()) == [{"max_lr": 1e-3 / 4.0, "min_lr": 1e-5 / 4.0}]
    params = {"hidden": torch.nn.Parameter(torch.zeros(4, 4)), "bias": torch.nn.Parameter(torch.zeros(4)),
              "embedding.weight": torch.nn.Parameter(torch.zeros(4, 4))}
    for name, p in params.items():
        assert [key.matches(p, name) for key in overrides] == [key.matches(p, name) for key in muon], name
    assert get_mup_config_overrides(config, 1.0, optimizer_type=spelling) == {}


def test_optimizer_dist_muon_is_muon_with_the_layer_wise_distributed_optimizer():
    # Megatron-LM's --optimizer dist_muon: Muon, sharded layer-wise. It was refused as no family's name.
    import graphstep as gs

    config = gs.OptimizerConfig(optimizer="dist_muon")
    assert config.optimizer == "muon"
    assert config.use_layer_wise_distributed_optimizer and config.use_distributed_optimizer
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    opt = gs.get_optimizer(config.replace(capture="eager"), model)
    model(torch.randn(2, 8)).sum().backward()
    assert bool(opt.step().update_successful)
