"""fp8.convert: which weights become fp8, their memory, and forward/backward against a dequantized oracle."""

import pytest
import torch

from graphstep import fp8


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(16, 8)
        self.fc1 = torch.nn.Linear(8, 32)
        self.fc2 = torch.nn.Linear(32, 8, bias=False)
        self.out = torch.nn.Linear(8, 16)
        self.out.weight.is_embedding_or_output_parameter = True

    def forward(self, tokens):
        return self.out(torch.relu(self.fc2(torch.relu(self.fc1(self.embed(tokens))))))


def test_default_converts_2d_linear_weights_except_output_and_keeps_other_dtypes():
    net = Net()
    assert fp8.convert(net) == ["fc1", "fc2"]
    assert net.fc1.weight.dtype == torch.float8_e4m3fn and net.fc2.weight.dtype == torch.float8_e4m3fn
    assert fp8.is_fp8(net.fc1.weight) and not fp8.is_fp8(net.out.weight)
    assert net.out.weight.dtype == torch.float32 and net.embed.weight.dtype == torch.float32
    assert net.fc1.bias.dtype == torch.float32
    assert isinstance(net.fc1, fp8.Fp8Linear) and type(net.out) is torch.nn.Linear


def test_fp8_weights_take_one_byte_per_element_plus_scales():
    net = Net()
    before = net.fc1.weight.untyped_storage().nbytes()
    fp8.convert(net, recipe="delayed", amax_history_len=4)
    w = net.fc1.weight
    assert before == 4 * w.numel()
    assert w.untyped_storage().nbytes() == w.numel()  # 1 B/element
    meta = w.fp8_meta
    extra = sum(t.untyped_storage().nbytes() for t in (meta.scale, meta.scale_inv, meta.amax_history))
    assert extra == 4 + 4 + 4 * 4


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_convert_quantizes_with_the_weights_own_amax(dtype):
    net = Net()
    original = net.fc1.weight.detach().clone()
    fp8.convert(net, dtype=dtype, margin=1)
    meta = net.fc1.weight.fp8_meta
    scale = fp8.scale_from_amax(original.abs().max(), dtype, 1)
    assert torch.equal(meta.scale, scale) and torch.equal(meta.scale_inv, 1 / scale)
    assert torch.equal(net.fc1.weight.view(torch.uint8), fp8.quantize(original, scale, dtype).view(torch.uint8))
    assert meta.amax_history[0] == original.abs().max()
    # The dequantized weight is within fp8 rounding of the original.
    rel = (fp8.dequantized(net.fc1.weight) - original).abs().max() / original.abs().max()
    assert rel < (2 ** -3 if dtype == torch.float8_e4m3fn else 2 ** -2)


@pytest.mark.parametrize("act_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_forward_and_grads_equal_a_linear_over_the_dequantized_weight(act_dtype, grad_dtype):
    net = Net()
    fp8.convert(net, grad_dtype=grad_dtype)
    layer = net.fc1
    reference = torch.nn.Linear(8, 32, dtype=act_dtype)
    with torch.no_grad():
        reference.weight.copy_(fp8.dequantized(layer.weight, act_dtype))
        reference.bias.copy_(layer.bias)
    layer.bias.data = layer.bias.data.to(act_dtype)
    x = torch.randn(3, 5, 8, dtype=act_dtype)
    x_ref = x.clone().requires_grad_()
    x.requires_grad_()
    for _ in range(2):  # two micro-batches accumulate into main_grad
        out = layer(x)
        ref = reference(x_ref)
        assert out.dtype == act_dtype and torch.equal(out, ref)
        out.square().sum().backward()
        ref.square().sum().backward()
    assert layer.weight.grad is None  # the fp8 leaf receives no (fp8) grad
    assert layer.weight.main_grad.dtype == grad_dtype
    expected = reference.weight.grad.to(grad_dtype) if act_dtype == grad_dtype else None
    if expected is not None and act_dtype == torch.float32:
        assert torch.equal(layer.weight.main_grad, expected)
    else:  # accumulation happens in main_grad's dtype, the reference accumulates in the activations'
        torch.testing.assert_close(layer.weight.main_grad.float(), reference.weight.grad.float(),
                                   rtol=2e-2, atol=1e-2)
    assert torch.equal(layer.bias.grad, reference.bias.grad)
    assert torch.equal(x.grad, x_ref.grad)


def test_convert_refuses_bad_arguments_and_empty_choices():
    with pytest.raises(ValueError, match="recipe"):
        fp8.convert(Net(), recipe="mxfp8")
    with pytest.raises(ValueError, match="fp8 dtype"):
        fp8.convert(Net(), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="delayed recipe only"):
        fp8.convert(Net(), amax_history_len=2)
    with pytest.raises(ValueError, match="no nn.Linear"):
        fp8.convert(Net(), modules=lambda name, module: False)
    net = Net()
    assert fp8.convert(net, modules=lambda name, module: name == "out") == ["out"]
    assert net.fc1.weight.dtype == torch.float32


def test_convert_refuses_a_tied_weight():
    net = Net()
    net.fc2.weight = torch.nn.Parameter(net.fc1.weight.detach().t().contiguous())
    head = torch.nn.Linear(8, 16, bias=False)
    head.weight = net.embed.weight  # tied to the embedding, not marked as output
    net.head = head
    with pytest.raises(ValueError, match="shared.*untie"):
        fp8.convert(net)
    assert net.embed.weight.dtype == torch.float32
    assert net.fc1.weight.dtype == torch.float32  # refused before converting anything


def test_model_state_dict_round_trip_restores_bytes_and_scales_in_place():
    source = Net()
    fp8.convert(source, recipe="delayed", amax_history_len=2)
    with torch.no_grad():
        source.fc1.weight.fp8_meta.scale.mul_(2)  # make the state differ from a fresh conversion
        source.fc1.weight.fp8_meta.amax_history[1] = 0.5
    saved = source.state_dict()
    assert {"fc1.weight_scale", "fc1.weight_scale_inv", "fc1.weight_amax_history"} <= set(saved)
    target = Net()
    with torch.no_grad():
        target.fc1.weight.mul_(3)
    fp8.convert(target, recipe="delayed", amax_history_len=2)
    meta = target.fc1.weight.fp8_meta
    target.load_state_dict(saved)
    assert target.fc1.weight.fp8_meta is meta  # same tensors, updated in place
    for name in ("scale", "scale_inv", "amax_history"):
        assert torch.equal(getattr(meta, name), getattr(source.fc1.weight.fp8_meta, name))
    assert torch.equal(target.fc1.weight.view(torch.uint8), source.fc1.weight.view(torch.uint8))
    tokens = torch.tensor([[1, 2, 3]])
    assert torch.equal(target(tokens), source(tokens))
