"""Per-rank optimizer state of the sharded layout, without spawning: 1/dp of the params plus at most
0.5% padding for a model of realistic shapes, and 1/dp of the single-process layout exactly where the
bucket alignment already divides by dp."""

import pytest
import torch

from graphstep.plan.layout import ParamSpec, plan_layout


def gpt_specs(layers=12, width=768, vocab=50304, seq=1024):
    f32 = torch.float32
    specs = [ParamSpec("wte", (vocab, width), f32, f32, 0), ParamSpec("wpe", (seq, width), f32, f32, 0)]
    for i in range(layers):
        for name, shape, group in (("ln1.weight", (width,), 1), ("ln1.bias", (width,), 1),
                                   ("attn.qkv.weight", (3 * width, width), 0), ("attn.qkv.bias", (3 * width,), 1),
                                   ("attn.proj.weight", (width, width), 0), ("attn.proj.bias", (width,), 1),
                                   ("ln2.weight", (width,), 1), ("ln2.bias", (width,), 1),
                                   ("mlp.fc.weight", (4 * width, width), 0), ("mlp.fc.bias", (4 * width,), 1),
                                   ("mlp.proj.weight", (width, 4 * width), 0), ("mlp.proj.bias", (width,), 1)):
            specs.append(ParamSpec(f"h.{i}.{name}", shape, f32, f32, group))
    specs.append(ParamSpec("ln_f.weight", (width,), f32, f32, 1))
    return specs


@pytest.mark.parametrize("dp", [2, 3, 4, 8, 64])
def test_per_rank_shard_is_one_over_dp_of_the_params_plus_at_most_half_a_percent(dp):
    specs = gpt_specs()
    params = sum(s.numel for s in specs)
    layout = plan_layout(specs, dp, bucket_size=None)
    for rank in range(dp):
        shard = sum(b.shard_numel for b in layout.buffers)
        assert shard <= params / dp * 1.005, (dp, rank, shard, params / dp)
        assert len(layout.segments(rank)) >= 1


@pytest.mark.parametrize("dp", [2, 4, 8, 128])
def test_shard_is_exactly_one_over_dp_of_the_single_process_layout_when_dp_divides_128(dp):
    specs = gpt_specs(layers=2, width=64, vocab=512, seq=64)
    single = plan_layout(specs, 1, bucket_size=20_000)
    sharded = plan_layout(specs, dp, bucket_size=20_000)
    assert sum(b.shard_numel for b in sharded.buffers) * dp == sum(b.shard_numel for b in single.buffers)
