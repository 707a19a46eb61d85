"""plan_layout: property tests over random shapes, dtypes, groups and data-parallel sizes."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphstep.plan.layout import BUCKET_ALIGNMENT, PARAM_ALIGNMENT, ParamSpec, plan_layout

DTYPE_PAIRS = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.float16, torch.float32)]


@st.composite
def layouts(draw):
    n = draw(st.integers(1, 12))
    specs = []
    for i in range(n):
        shape = tuple(draw(st.lists(st.integers(1, 40), min_size=1, max_size=3)))
        dtype, grad_dtype = draw(st.sampled_from(DTYPE_PAIRS))
        specs.append(ParamSpec(f"p{i}", shape, dtype, grad_dtype, draw(st.integers(0, 2))))
    dp = draw(st.integers(1, 8))
    bucket_size = draw(st.sampled_from([None, 1, 100, 500, 5000]))
    return specs, dp, bucket_size


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_layout_properties(case):
    specs, dp, bucket_size = case
    layout = plan_layout(specs, dp, bucket_size)

    # Alignment, no overlap, each param inside its bucket and buffer.
    for buf in layout.buffers:
        mine = sorted((p for p in layout.params if p.buffer == buf.index), key=lambda p: p.start)
        for a, b in zip(mine, mine[1:]):
            assert a.end <= b.start
        for p in mine:
            assert p.start % PARAM_ALIGNMENT == 0
            bucket = layout.buckets[p.bucket]
            assert bucket.buffer == buf.index and bucket.start <= p.start and p.end <= bucket.end
            spec = specs[p.index]
            assert (spec.dtype, spec.grad_dtype) == (buf.param_dtype, buf.grad_dtype)
        # Buckets tile the buffer and split evenly into dp shards.
        buckets = [layout.buckets[i] for i in buf.buckets]
        assert buckets[0].start == 0 and buckets[-1].end == buf.numel
        for a, b in zip(buckets, buckets[1:]):
            assert a.end == b.start
        for bucket in buckets:
            assert bucket.numel % math.lcm(dp, BUCKET_ALIGNMENT) == 0
        assert buf.shard_numel == sum(b.numel for b in buckets) // dp

    # Bucket membership follows Megatron-Core's closing rule over each buffer's backward order.
    for buf in layout.buffers:
        backward = [i for i in reversed(range(len(specs))) if (specs[i].dtype, specs[i].grad_dtype)
                    == (buf.param_dtype, buf.grad_dtype)]
        limit = bucket_size if bucket_size is not None else math.inf
        expected, current, used = [], [], 0
        for i in backward:
            current.append(i)
            used = math.ceil(used / PARAM_ALIGNMENT) * PARAM_ALIGNMENT + specs[i].numel
            if used >= limit:
                expected.append(sorted(current))
                current, used = [], 0
        expected += [sorted(current)] if current else []
        assert [sorted(layout.buckets[b].params) for b in buf.buckets] == expected

    # Every element of every param is owned by exactly one rank, and shard offsets don't collide.
    owners = {p.index: [0] * p.numel for p in layout.params}
    for rank in range(dp):
        seen_shard = {}
        for r in layout.owned_ranges(rank):
            for k in range(r.param_start, r.param_end):
                owners[r.param][k] += 1
            buffer = layout.params[r.param].buffer
            for k in range(r.shard_start, r.shard_start + r.param_end - r.param_start):
                assert (buffer, k) not in seen_shard
                seen_shard[(buffer, k)] = r.param
                assert k < layout.buffers[buffer].shard_numel
    assert all(count == 1 for counts in owners.values() for count in counts)

    # Segments: one group each, covering exactly the owned ranges of that group.
    for rank in range(dp):
        segments = layout.segments(rank)
        for r in layout.owned_ranges(rank):
            place = layout.params[r.param]
            size = r.param_end - r.param_start
            assert any(s.buffer == place.buffer and s.group == place.group
                       and s.shard_start <= r.shard_start and r.shard_start + size <= s.shard_end
                       for s in segments)
        for s in segments:
            assert s.flat_end - s.flat_start == s.numel


def test_backward_order_and_group_order_inside_a_bucket():
    specs = [ParamSpec("a", (10,), torch.float32, torch.float32, 1),
             ParamSpec("b", (10, 3), torch.float32, torch.float32, 0),
             ParamSpec("c", (7,), torch.float32, torch.float32, 1),
             ParamSpec("d", (4, 4), torch.float32, torch.float32, 0)]
    layout = plan_layout(specs, 1)
    order = [p.name for p in sorted(layout.params, key=lambda p: p.start)]
    assert order == ["d", "b", "c", "a"]  # backward order, group 0 first inside the bucket
    assert len(layout.segments(0)) == 2


def test_buckets_close_at_bucket_size_in_backward_order():
    specs = [ParamSpec(f"p{i}", (100,), torch.float32, torch.float32, 0) for i in range(6)]
    layout = plan_layout(specs, 2, bucket_size=200)
    assert len(layout.buckets) == 3
    first = layout.buckets[0]
    assert [specs[i].name for i in first.params] == ["p5", "p4"]


def linear_stack(layers=10, width=95, bias=False):
    """The model of Megatron-Core's test_bucket_sizes: ``layers`` x Linear(width, width), in model order."""
    specs = []
    for i in range(layers):
        specs.append(ParamSpec(f"{i}.weight", (width, width), torch.float32, torch.float32, 0))
        if bias:
            specs.append(ParamSpec(f"{i}.bias", (width,), torch.float32, torch.float32, 0))
    return specs


def megatron_bucket_sizes(numels, bucket_size, dp):
    """Gold values the way Megatron-Core's test_bucket_sizes derives them (distributed optimizer, no shared
    embedding): walk the params backwards, align each start to 64, close the bucket once its unpadded
    size reaches bucket_size; the padded size rounds that up to lcm(dp, 128)."""
    unpadded, padded, used = [], [], 0
    for numel in reversed(numels):
        used = math.ceil(used / 64) * 64 + numel
        if used >= bucket_size:
            unpadded.append(used)
            used = 0
    if used:
        unpadded.append(used)
    multiple = math.lcm(dp, 128)
    padded = [math.ceil(u / multiple) * multiple for u in unpadded]
    return unpadded, padded


def test_ten_linears_of_95_with_bucket_size_9050_make_megatrons_5_buckets():
    """Counting the 64-padded size of each param (9088 for a 95 x 95 weight) closed every
    bucket after one weight, 10 buckets; Megatron-Core counts the unpadded end (9025, then 9088 + 9025)."""
    layout = plan_layout(linear_stack(), 1, bucket_size=9050)
    assert len(layout.buckets) == 5
    assert [layout.params[i].name for i in layout.buckets[0].params] == ["9.weight", "8.weight"]


@pytest.mark.parametrize("bucket_size", [9000, 9025, 9050, 18000, 18050, 20000])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dp", [1, 2, 3, 8])
def test_bucket_sizes_match_megatron_cores_gold_values(bucket_size, bias, dp):
    specs = linear_stack(bias=bias)
    layout = plan_layout(specs, dp, bucket_size=bucket_size)
    unpadded, padded = megatron_bucket_sizes([s.numel for s in specs], bucket_size, dp)
    # One param group, so params sit in backward order and a bucket's unpadded size is its last param's end.
    assert [max(layout.params[i].end for i in b.params) - b.start for b in layout.buckets] == unpadded
    assert [b.numel for b in layout.buckets] == padded


def test_separate_buffers_per_dtype_key():
    specs = [ParamSpec("w", (8, 8), torch.bfloat16, torch.float32, 0),
             ParamSpec("x", (8,), torch.float32, torch.float32, 0)]
    layout = plan_layout(specs, 4)
    assert [(b.param_dtype, b.grad_dtype) for b in layout.buffers] == [(torch.bfloat16, torch.float32),
                                                                       (torch.float32, torch.float32)]


def test_padding_is_bounded_for_a_realistic_model():
    # GPT-2-small-like shapes at dp=4: padding stays a tiny fraction of the state.
    shapes = [(50257, 768), (1024, 768)] + [(768,), (768,), (768, 2304), (2304,), (768, 768), (768,), (768,),
                                            (768,), (768, 3072), (3072,), (3072, 768), (768,)] * 12
    specs = [ParamSpec(f"p{i}", s, torch.float32, torch.float32, int(len(s) == 1)) for i, s in enumerate(shapes)]
    layout = plan_layout(specs, 4)
    total = sum(math.prod(s) for s in shapes)
    assert layout.padding_numel() / total < 0.005


@pytest.mark.parametrize("kwargs, message", [
    (dict(specs=[], dp_size=1), "no parameters"),
    (dict(specs=[ParamSpec("e", (0,), torch.float32, torch.float32, 0)], dp_size=1), "'e' has no elements"),
    (dict(specs=[ParamSpec("a", (2,), torch.float32, torch.float32, 0)], dp_size=0), "dp_size=0"),
    (dict(specs=[ParamSpec("a", (2,), torch.float32, torch.float32, 0)], dp_size=1, bucket_size=0), "bucket_size=0"),
])
def test_bad_input_is_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_layout(kwargs.pop("specs"), **kwargs)
