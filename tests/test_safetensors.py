"""Saving a graphstep-managed model through safetensors loses nothing.

graphstep makes every param a view of one flat buffer; graphstep/hooks/model_state_dict.py gives each param's
``model.state_dict()`` value a storage object of its own (zero-copy). Each saver below round-trips every
weight bitwise after a few training steps, into a fresh graphstep-managed model built the same way (other
seed); tied weights stay tied and are stored once. The oracle is the trained model itself.
"""

import gc
import io
import warnings
import weakref

import pytest
import torch

import graphstep as gs
from graphstep import fp8
from toy import loss_fn, tiny_transformer

safetensors_torch = pytest.importorskip("safetensors.torch", reason="safetensors is not installed (extra 'hf')")
from safetensors import safe_open  # noqa: E402

CONFIGS = {
    "adam_fp32": dict(optimizer="adam", lr=1e-2, weight_decay=0.1),  # the params are the main params
    "adam_bf16": dict(optimizer="adam", lr=1e-2, bf16=True),  # bf16 params, separate fp32 main params
    "sgd_offload": dict(optimizer="sgd", lr=1e-2, sgd_momentum=0.9, optimizer_cpu_offload=True,
                        optimizer_offload_fraction=0.5),
}


def build(seed, config="adam_fp32", tied=False):
    dtype = torch.bfloat16 if config == "adam_bf16" else torch.float32
    model = tiny_transformer(seed, dtype=dtype)
    if tied:  # the output head shares the embedding (both 64 x 32): one Parameter under two names
        model[3].weight = model[0].weight
    opt = gs.get_optimizer(gs.OptimizerConfig(capture="eager", **CONFIGS[config]), model)
    return model, opt


def train(model, opt, steps=3):
    for step in range(steps):
        loss_fn(model, step).backward()
        opt.step()
        opt.zero_grad()


def trained(config="adam_fp32", tied=False):
    model, opt = build(0, config, tied)
    train(model, opt)
    return model, opt


def bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype in fp8.FP8_DTYPES:  # no torch.equal for fp8 on the CPU: compare the bytes
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


def assert_same_weights(model, reference):
    state, expected = model.state_dict(), reference.state_dict()
    assert state.keys() == expected.keys()
    different = [k for k in expected if not bitwise(state[k], expected[k])]
    assert not different, f"not bitwise equal after the round trip: {different}"


def storage_key(tensor):
    return tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes()


# ---- the state dict itself -----------------------------------------------------------------------------
def test_every_value_has_a_storage_of_its_own_over_the_param_memory():
    model, _ = trained()
    state = model.state_dict()
    params = dict(model.named_parameters())
    assert len({storage_key(v) for v in state.values()}) == len(state)
    for name, value in state.items():
        assert type(value) is torch.Tensor and not value.requires_grad
        assert value.data_ptr() == params[name].data_ptr()  # zero-copy: the param's own memory
        assert value.untyped_storage().nbytes() == value.numel() * value.element_size()


def test_keep_vars_still_returns_the_parameters():
    model, _ = trained()
    state = model.state_dict(keep_vars=True)
    for name, param in model.named_parameters():
        assert state[name] is param


def test_an_in_place_write_into_a_value_reaches_the_param_as_dcp_loads():
    model, opt = trained()
    state = model.state_dict()
    new = torch.randn_like(state["3.weight"])
    state["3.weight"].copy_(new)
    assert torch.equal(model[3].weight, new)
    place = opt.layout.params[[n for n, _ in model.named_parameters()].index("3.weight")]
    assert torch.equal(opt.buffers.param_flat[place.buffer][place.start:place.end].view(place.shape), new)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_torch_distributed_checkpoint_loads_into_the_params(tmp_path):
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    model, _ = trained()
    dcp.save(model.state_dict(), checkpoint_id=tmp_path, no_dist=True)
    fresh, _ = build(1)
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=tmp_path, no_dist=True)  # in place, into the state dict's tensors
    assert_same_weights(fresh, model)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_an_in_place_write_into_a_value_of_low_precision_params_reaches_the_main_params(dtype):
    # The values are aliases with version counters of their own: the params' counters do not see a write
    # through them (what torch.distributed.checkpoint.load does), and the step used to copy the old main
    # params back over it.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)).to(dtype)
    config = dict(bf16=True) if dtype == torch.bfloat16 else dict(fp16=True, loss_scale=1.0)
    opt = gs.get_optimizer(gs.OptimizerConfig(optimizer="adam", lr=0.0, capture="eager", **config), model)
    for value in model.state_dict().values():
        value.fill_(0.5)
    model(torch.randn(2, 8, dtype=dtype)).sum().backward()
    opt.step()
    moved = [name for name, p in model.named_parameters() if not torch.equal(p, torch.full_like(p, 0.5))]
    assert not moved, f"the step undid the write into {moved}"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_load_into_a_bf16_models_state_dict_survives_the_next_step(tmp_path):
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    model, _ = trained("adam_bf16")
    dcp.save(model.state_dict(), checkpoint_id=tmp_path, no_dist=True)
    fresh, opt = build(1, "adam_bf16")
    train(fresh, opt, steps=1)  # main params and moments of the first weights
    dcp.load(fresh.state_dict(), checkpoint_id=tmp_path, no_dist=True)
    for group in opt.param_groups:
        group["lr"] = 0.0
    train(fresh, opt, steps=1)
    assert_same_weights(fresh, model)


@pytest.mark.parametrize("first_again", ["step", "recapture"])
def test_aliases_follow_the_optimizer_that_holds_the_params_in_any_order(tmp_path, first_again):
    # A second optimizer over the same model takes the params over; stepping the first again takes them back:
    # the state dict must alias the first one's buffers again (one storage per value), and a write through
    # it must reach the first one's main params.
    model, first = trained("adam_bf16")
    second = gs.get_optimizer(gs.OptimizerConfig(capture="eager", **CONFIGS["adam_bf16"]), model)
    train(model, second, steps=1)
    if first_again == "recapture":
        first.recapture()
    train(model, first, steps=1)
    state = model.state_dict()
    assert len({storage_key(v) for v in state.values()}) == len(state)
    safetensors_torch.save_model(model, tmp_path / "m.safetensors")
    fresh, _ = build(1, "adam_bf16")
    safetensors_torch.load_model(fresh, tmp_path / "m.safetensors")
    assert_same_weights(fresh, model)
    for value in model.state_dict().values():
        value.fill_(0.25)
    for group in first.param_groups:
        group["lr"] = 0.0
    train(model, first, steps=1)
    moved = [name for name, p in model.named_parameters() if not torch.equal(p, torch.full_like(p, 0.25))]
    assert not moved, f"the first optimizer undid the write into {moved}"


def test_a_param_the_user_replaced_is_not_aliased_until_the_step_adopts_it():
    model, opt = trained()
    new = torch.randn_like(model[3].weight)
    model[3].weight.data = new
    state = model.state_dict()
    assert state["3.weight"].untyped_storage().data_ptr() == new.untyped_storage().data_ptr()
    assert torch.equal(state["3.weight"], new)
    assert storage_key(state["0.weight"]) != storage_key(opt.buffers.param_flat[0])  # the others still are
    train(model, opt, steps=1)  # adopts the new tensor back into the flat buffer
    state = model.state_dict()
    assert state["3.weight"].data_ptr() == model[3].weight.data_ptr()
    assert state["3.weight"].untyped_storage().nbytes() == new.numel() * new.element_size()


def test_the_hooks_keep_no_optimizer_alive_and_a_later_one_aliases_its_own_buffers():
    model, opt = trained()
    dropped = weakref.ref(opt)
    del opt
    gc.collect()
    assert dropped() is None
    opt = gs.get_optimizer(gs.OptimizerConfig(capture="eager", **CONFIGS["adam_fp32"]), model)
    state = model.state_dict()
    for name, param in model.named_parameters():
        assert state[name].data_ptr() == param.data_ptr()
    assert len({storage_key(v) for v in state.values()}) == len(state)
    hooks = [h for m in model.modules() for h in m._state_dict_hooks.values()]
    assert len(hooks) == len([m for m in model.modules() if m._parameters])  # the dropped one's went
    opt.close()  # the params stay views of the flat buffer: the hooks stay with the model
    del opt
    gc.collect()
    assert len({storage_key(v) for v in model.state_dict().values()}) == len(state)


@pytest.mark.parametrize("tied", [False, True])
def test_torch_save_round_trips_and_stores_a_tie_once(tied):
    model, _ = trained(tied=tied)
    blob = io.BytesIO()
    torch.save(model.state_dict(), blob)
    blob.seek(0)
    loaded = torch.load(blob)
    if tied:
        assert storage_key(loaded["0.weight"]) == storage_key(loaded["3.weight"])
    unique = {id(p): p for p in model.parameters()}.values()
    assert sum(t.untyped_storage().nbytes() for t in {storage_key(v): v for v in loaded.values()}.values()) \
        == sum(p.numel() * p.element_size() for p in unique)
    fresh, _ = build(1, tied=tied)
    fresh.load_state_dict(loaded)
    assert_same_weights(fresh, model)


# ---- safetensors ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("config", ["adam_fp32", "adam_bf16"])
def test_save_file_load_file_round_trips(tmp_path, config):
    model, _ = trained(config)
    safetensors_torch.save_file(model.state_dict(), tmp_path / "m.safetensors")
    fresh, _ = build(1, config)
    fresh.load_state_dict(safetensors_torch.load_file(tmp_path / "m.safetensors"))
    assert_same_weights(fresh, model)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_save_model_load_model_round_trips(tmp_path, config):
    model, _ = trained(config)
    safetensors_torch.save_model(model, tmp_path / "m.safetensors")
    fresh, _ = build(1, config)
    missing, unexpected = safetensors_torch.load_model(fresh, tmp_path / "m.safetensors")
    assert not missing and not unexpected
    assert_same_weights(fresh, model)


def test_save_model_stores_a_tied_weight_once_and_load_model_keeps_the_tie(tmp_path):
    model, _ = trained(tied=True)
    safetensors_torch.save_model(model, tmp_path / "m.safetensors")
    with safe_open(tmp_path / "m.safetensors", "pt") as saved:
        keys = set(saved.keys())
    assert len(keys & {"0.weight", "3.weight"}) == 1
    assert keys | {"0.weight", "3.weight"} == set(model.state_dict())
    fresh, _ = build(1, tied=True)
    safetensors_torch.load_model(fresh, tmp_path / "m.safetensors")
    assert fresh[3].weight is fresh[0].weight
    assert_same_weights(fresh, model)


def test_fp8_weights_round_trip_through_save_model(tmp_path):
    def fp8_built(seed):
        model = tiny_transformer(seed, dtype=torch.bfloat16)
        fp8.convert(model)
        config = gs.OptimizerConfig(optimizer="adam", lr=1e-2, bf16=True, fp8_recipe="tensorwise",
                                    capture="eager", clip_grad=0.0)
        return model, gs.get_optimizer(config, model)

    model, opt = fp8_built(0)
    train(model, opt)
    assert any(v.dtype in fp8.FP8_DTYPES for v in model.state_dict().values())
    safetensors_torch.save_model(model, tmp_path / "m.safetensors")
    fresh, _ = fp8_built(1)
    safetensors_torch.load_model(fresh, tmp_path / "m.safetensors")
    assert_same_weights(fresh, model)


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
@pytest.mark.parametrize("how", ["load_state_dict", "dcp"])
def test_fp8_weights_loaded_after_the_build_survive_the_next_step(tmp_path, recipe, how):
    # The oracle: the same weights loaded before the optimizer was built, then the same step (lr 0: the
    # step only requantizes from the main params, which must now stand for the loaded weights).
    def fp8_built(seed, loaded=None):
        model = tiny_transformer(seed, dtype=torch.bfloat16)
        fp8.convert(model, recipe=recipe)
        if loaded is not None:
            model.load_state_dict(loaded)
        config = gs.OptimizerConfig(optimizer="adam", lr=1e-2, bf16=True, fp8_recipe=recipe, capture="eager",
                                    clip_grad=0.0)
        return model, gs.get_optimizer(config, model)

    source, source_opt = fp8_built(2)
    train(source, source_opt, steps=2)
    saved = {k: v.detach().clone() for k, v in source.state_dict().items()}
    model, opt = fp8_built(0)
    train(model, opt, steps=2)  # main params and moments of the first weights
    if how == "dcp":
        dcp = pytest.importorskip("torch.distributed.checkpoint")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # DCP without a process group says so
            dcp.save(saved, checkpoint_id=tmp_path, no_dist=True)
            dcp.load(model.state_dict(), checkpoint_id=tmp_path, no_dist=True)
    else:
        model.load_state_dict(saved)
    reference, reference_opt = fp8_built(0, loaded=saved)
    for each in (opt, reference_opt):
        for group in each.param_groups:
            group["lr"] = 0.0
    train(model, opt, steps=1)
    train(reference, reference_opt, steps=1)
    assert_same_weights(model, reference)


# ---- accelerate ----------------------------------------------------------------------------------------
@pytest.fixture
def accelerator_factory():
    accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed (extra 'hf')")
    yield lambda: accelerate.Accelerator(cpu=True)
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)


def test_accelerate_save_state_load_state_round_trips_model_and_optimizer(tmp_path, accelerator_factory):
    model, opt = build(0)
    accelerator = accelerator_factory()
    model, opt = accelerator.prepare(model, opt)
    train(model, opt)
    accelerator.save_state(tmp_path)  # safetensors by default
    with safe_open(tmp_path / "model.safetensors", "pt") as saved:
        assert set(saved.keys()) == set(model.state_dict())

    fresh, fresh_opt = build(1)
    fresh_accelerator = accelerator_factory()
    fresh, fresh_opt = fresh_accelerator.prepare(fresh, fresh_opt)
    fresh_accelerator.load_state(tmp_path)
    assert_same_weights(fresh, model)
    # The optimizer state came back too: one more step on each stays bitwise together.
    train(model, opt, steps=1)
    train(fresh, fresh_opt, steps=1)
    assert_same_weights(fresh, model)


# ---- transformers --------------------------------------------------------------------------------------
def tiny_gpt2(seed):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (extra 'hf')")
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    return transformers.GPT2LMHeadModel(config)


def test_transformers_save_pretrained_from_pretrained_round_trips_and_keeps_the_tie(tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (extra 'hf')")
    model = tiny_gpt2(0)
    assert model.lm_head.weight is model.transformer.wte.weight
    opt = gs.get_optimizer(gs.OptimizerConfig(optimizer="adam", lr=1e-2, capture="eager"), model)
    for step in range(3):
        tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(step))
        model(tokens, labels=tokens).loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(tmp_path)  # safetensors by default
    with safe_open(tmp_path / "model.safetensors", "pt") as saved:
        keys = set(saved.keys())
    assert len(keys & {"transformer.wte.weight", "lm_head.weight"}) == 1  # the tied weight, stored once
    assert keys | {"lm_head.weight", "transformer.wte.weight"} == set(model.state_dict())

    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    assert reloaded.lm_head.weight is reloaded.transformer.wte.weight
    assert_same_weights(reloaded, model)
    gs.get_optimizer(gs.OptimizerConfig(optimizer="adam", lr=1e-2, capture="eager"), reloaded)
    assert reloaded.lm_head.weight is reloaded.transformer.wte.weight  # managed, still tied and equal
    assert_same_weights(reloaded, model)
