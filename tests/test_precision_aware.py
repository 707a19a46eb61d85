"""Adam's moments stored below fp32 (``use_precision_aware_optimizer``, ``exp_avg_dtype``, ``exp_avg_sq_dtype``).

The reference is Transformer Engine FusedAdam's algorithm (fused_adam.py: ``get_unscaled_state``, the kernel on
fp32 moments, ``_apply_scale``), written here per param: read each moment into fp32 (bf16: a cast; fp16 and
fp8: ``stored * scale``), run torch's fused AdamW on fp32, store it back (bf16: a cast; fp16 / fp8 E4M3: scale =
amax / range with range 32752 / 448, stored ``cast(value * (1 / scale))``, zeros where amax is 0).
"""

import pytest
import torch

import graphstep as gs
from graphstep import checkpoint

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.uint8}
RANGES = {torch.bfloat16: None, torch.float16: 32752.0, torch.uint8: 448.0}
STORED = {torch.bfloat16: torch.bfloat16, torch.float16: torch.float16, torch.uint8: torch.float8_e4m3fn}
LR, BETAS, EPS, WD = 1e-2, (0.9, 0.999), 1e-8, 0.01


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _config(dtype, **extra):
    return gs.OptimizerConfig(lr=LR, adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_eps=EPS, weight_decay=WD,
                              clip_grad=0.0, use_precision_aware_optimizer=True, exp_avg_dtype=dtype,
                              exp_avg_sq_dtype=dtype, **extra)


def _loss(model, step):
    torch.manual_seed(100 + step)
    return model(torch.randn(8, 16)).square().mean()


def _train(model, opt, steps, first=0):
    for step in range(first, first + steps):
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()


class _Reference:
    """TE FusedAdam's precision-aware step, one tensor (param) at a time."""

    def __init__(self, params, dtype):
        self.params, self.dtype, self.range = params, dtype, RANGES[dtype]
        self.stored = {name: [torch.zeros(p.numel(), dtype=STORED[dtype]) for p in params]
                       for name in ("exp_avg", "exp_avg_sq")}
        self.scales = {name: [torch.zeros((), dtype=torch.float32) for _ in params] for name in self.stored}
        self.step = torch.zeros(())

    def _read(self, name, i):
        value = self.stored[name][i].float()
        return value if self.range is None else value * self.scales[name][i]

    def _write(self, name, i, value):
        if self.range is None:
            self.stored[name][i].copy_(value)
            return
        scale = value.abs().max() / self.range
        self.scales[name][i] = scale
        inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        self.stored[name][i].copy_((value * inverse).clamp(-self.range, self.range))

    @torch.no_grad()
    def update(self):
        self.step += 1
        for i, p in enumerate(self.params):
            n = p.numel()
            # Zero-padded to graphstep's 64-element param alignment, so torch's CPU kernel takes its vectorised
            # path for every element as it does over graphstep's buffers (its scalar tail rounds differently).
            flat, grad, m, v = (_padded(x) for x in (p.data.view(-1), p.grad.view(-1), self._read("exp_avg", i),
                                                     self._read("exp_avg_sq", i)))
            decay = WD if p.dim() > 1 else 0.0  # the standard overrides: no decay for biases
            torch._fused_adamw_([flat], [grad], [m], [v], [], [self.step], lr=LR, beta1=BETAS[0],
                                beta2=BETAS[1], weight_decay=decay, eps=EPS, amsgrad=False, maximize=False)
            p.data.view(-1).copy_(flat[:n])
            self._write("exp_avg", i, m[:n])
            self._write("exp_avg_sq", i, v[:n])


def _padded(x):
    return torch.cat([x, x.new_zeros(-x.numel() % 64)])


def _stored_bytes(opt):
    return {name: [(s.data.view(torch.uint8).clone(), None if s.scales is None else s.scales.clone())
                   for s in per_buffer] for name, per_buffer in opt.buffers.stored.items()}


def _same_bytes(a, b):
    return all(torch.equal(x[0], y[0]) and (x[1] is None or torch.equal(x[1], y[1]))
               for name in a for x, y in zip(a[name], b[name]))


@pytest.mark.parametrize("name", DTYPES)
def test_every_step_is_te_fused_adams_algorithm_bitwise(name):
    dtype = DTYPES[name]
    model, reference_model = _model(), _model()
    opt = gs.get_optimizer(_config(dtype, capture="eager"), model)
    reference = _Reference(list(reference_model.parameters()), dtype)
    for step in range(8):
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()
        for p in reference_model.parameters():
            p.grad = None
        _loss(reference_model, step).backward()
        reference.update()
        for ours, theirs in zip(model.parameters(), reference_model.parameters()):
            assert torch.equal(ours, theirs), f"step {step}"
    # The stored moments too, param by param (the buffers' pieces are the params with one rank).
    for i, (p_name, p) in enumerate(model.named_parameters()):
        place = next(pl for pl in opt.layout.params if pl.name == p_name)
        owned = next(o for o in opt.layout.owned_ranges(0) if o.param == place.index)
        for state in ("exp_avg", "exp_avg_sq"):
            stored = opt.buffers.stored[state][place.buffer]
            data = stored.data[owned.shard_start:owned.shard_start + p.numel()]
            assert torch.equal(data.view(torch.uint8), reference.stored[state][i].view(torch.uint8))


@pytest.mark.parametrize("name", DTYPES)
def test_captured_steps_equal_eager_bitwise(name):
    eager_model, graph_model = _model(), _model()
    eager = gs.get_optimizer(_config(DTYPES[name], capture="eager"), eager_model)
    graph = gs.get_optimizer(_config(DTYPES[name], capture="graph", capture_warmup_steps=1), graph_model)
    _train(eager_model, eager, 6)
    _train(graph_model, graph, 6)
    assert graph.captured
    assert all(torch.equal(a, b) for a, b in zip(eager_model.parameters(), graph_model.parameters()))
    assert _same_bytes(_stored_bytes(eager), _stored_bytes(graph))


@pytest.mark.parametrize("capture", ["eager", "graph"])
@pytest.mark.parametrize("name", DTYPES)
def test_a_skipped_step_leaves_every_stored_byte_and_scale(name, capture):
    model = _model()
    opt = gs.get_optimizer(_config(DTYPES[name], capture=capture, capture_warmup_steps=1), model)
    _train(model, opt, 4)
    before, params = _stored_bytes(opt), [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    _loss(model, 4).backward()
    model[0].weight.grad[0, 0] = float("nan")
    result = opt.step()
    assert not bool(result.update_successful)
    assert _same_bytes(before, _stored_bytes(opt))
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))


@pytest.mark.parametrize("name", DTYPES)
def test_the_flat_checkpoint_round_trips_every_stored_byte_and_resumes_bitwise(name):
    model = _model()
    opt = gs.get_optimizer(_config(DTYPES[name], capture="eager"), model)
    _train(model, opt, 5)
    saved = opt.state_dict()
    assert all(t.dtype == torch.float32 for t in saved["state"]["exp_avg"])  # values, as TE saves them
    resumed_model = _model()
    resumed_model.load_state_dict(model.state_dict())
    resumed = gs.get_optimizer(_config(DTYPES[name], capture="eager"), resumed_model)
    resumed.load_state_dict(saved)
    assert _same_bytes(_stored_bytes(opt), _stored_bytes(resumed))
    _train(model, opt, 3, first=5)
    _train(resumed_model, resumed, 3, first=5)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed_model.parameters()))


@pytest.mark.parametrize("name", DTYPES)
def test_the_sharded_format_saves_fp32_values_and_reloads_them(name, tmp_path):
    model = _model()
    opt = gs.get_optimizer(_config(DTYPES[name], capture="eager"), model)
    _train(model, opt, 5)
    sd = checkpoint.sharded_state_dict(opt)
    entry = sd["optimizer.state.exp_avg.0.weight"]
    assert entry.dtype == torch.float32
    # Another bucket size: another layout, the same per-param values.
    other_model = _model()
    other_model.load_state_dict(model.state_dict())
    other = gs.get_optimizer(_config(DTYPES[name], capture="eager", bucket_size=256), other_model)
    checkpoint.load_sharded_state_dict(other, sd)
    again = checkpoint.sharded_state_dict(other)
    for key, value in sd.items():
        if key.startswith("optimizer.state."):
            assert torch.equal(value, again[key]), key


def test_the_checkpoint_loads_into_fp32_moments_and_back():
    """A run can switch its moments' dtype at a resume: the checkpoint holds values, not bytes."""
    model = _model()
    opt = gs.get_optimizer(_config(torch.bfloat16, capture="eager"), model)
    _train(model, opt, 3)
    full = gs.get_optimizer(gs.OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=0.0, capture="eager"), _model())
    full.load_state_dict(opt.state_dict())
    assert torch.equal(full.state_dict()["state"]["exp_avg"][0], opt.state_dict()["state"]["exp_avg"][0])


@pytest.mark.parametrize("name, state_bytes", [("bf16", 2), ("fp16", 2), ("fp8", 1)])
def test_memory_stats_count_the_stored_bytes(name, state_bytes):
    model = torch.nn.Linear(256, 256)  # 65,792 params: the scales and piece bounds are a rounding error
    opt = gs.get_optimizer(_config(DTYPES[name], capture="eager"), model)
    full = gs.get_optimizer(gs.OptimizerConfig(capture="eager"), torch.nn.Linear(256, 256))
    numel = sum(p.numel() for p in model.parameters())
    ours, theirs = opt.memory_stats()["device"], full.memory_stats()["device"]
    for state in ("exp_avg", "exp_avg_sq"):
        assert theirs[state] >= 4 * numel
        assert state_bytes * numel <= ours[state] <= state_bytes * numel + 64 * 3 * 8 + 256


def test_fp8_moments_saturate_nowhere_and_zero_pieces_stay_zero():
    model = _model()
    opt = gs.get_optimizer(_config(torch.uint8, capture="eager"), model)
    _train(model, opt, 3)
    for stored in opt.buffers.stored["exp_avg"]:
        assert stored.data.float().abs().max() <= 448.0
        assert torch.isfinite(stored.data.float()).all()
        zero = stored.scales == 0
        for k in torch.nonzero(zero).flatten().tolist():  # padding pieces: no grads, no moments
            assert not stored.data[stored.starts[k]:stored.starts[k + 1]].float().any()


# ---- main params below fp32: bf16 params + remainders, fp16 main params -------------------------------------

MAIN_SETTINGS = {
    "remainders": dict(store_param_remainders=True),
    "fp16-main": dict(main_params_dtype=torch.float16, store_param_remainders=False),
}


def _bf16_model():
    return _model().to(torch.bfloat16)


def _bf16_loss(model, step):
    torch.manual_seed(100 + step)
    return model(torch.randn(8, 16, dtype=torch.bfloat16)).float().square().mean()


def _bf16_train(model, opt, steps, first=0):
    for step in range(first, first + steps):
        opt.zero_grad()
        _bf16_loss(model, step).backward()
        opt.step()


def _main_config(setting, **extra):
    return gs.OptimizerConfig(lr=LR, adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_eps=EPS, weight_decay=WD,
                              clip_grad=0.0, bf16=True, use_precision_aware_optimizer=True, **MAIN_SETTINGS[setting],
                              **extra)


def _main_values(opt):
    return torch.cat([opt.buffers.full_shard("main", b) for b in range(len(opt.layout.buffers))])


def test_remainders_keep_the_fp32_main_params_exactly_in_2_bytes():
    """The fp32 main params, rebuilt from the bf16 params and their remainders, equal the plain run's fp32 main
    params bitwise at every step; the bf16 params are those values rounded to nearest (ties away from zero:
    TE's rule, where torch's cast rounds ties to even)."""
    plain_model, model = _bf16_model(), _bf16_model()
    plain = gs.get_optimizer(gs.OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=0.0, bf16=True, capture="eager"),
                             plain_model)
    opt = gs.get_optimizer(_main_config("remainders", capture="eager"), model)
    assert all(t.dtype == torch.int16 for t in opt.buffers.main_shard)
    for step in range(6):
        _bf16_train(plain_model, plain, 1, first=step)
        _bf16_train(model, opt, 1, first=step)
        main = _main_values(opt)
        assert torch.equal(main, _main_values(plain)), f"step {step}"
    low = main.view(torch.int32) & 0xFFFF
    params = torch.cat([opt.buffers.param_flat[b] for b in range(len(opt.layout.buffers))]).float()
    tie = low == 0x8000
    assert torch.equal(params[~tie], main[~tie].to(torch.bfloat16).float())
    assert (params[tie].abs() >= main[tie].abs()).all()


def test_fp16_main_params_follow_te_fused_adams_fp16_master_weights_bitwise():
    """TE's fp16 master weights: per param, scale = amax / 32752, the update in fp32, stored scaled; the bf16
    param is the stored main param's value, rounded."""
    model, reference_model = _bf16_model(), _bf16_model()
    opt = gs.get_optimizer(_main_config("fp16-main", capture="eager"), model)
    params = list(reference_model.parameters())
    masters = []
    for p in params:  # seeded from the bf16 values, as graphstep seeds its main params
        value = p.detach().float().reshape(-1)
        scale = value.abs().max() / 32752.0
        masters.append([(value * (1 / scale)).to(torch.float16), scale])
    states = [[torch.zeros(_padded(p.detach().reshape(-1)).numel()) for _ in range(2)] for p in params]
    step_count = torch.zeros(())
    for step in range(6):
        _bf16_train(model, opt, 1, first=step)
        for p in params:
            p.grad = None
        _bf16_loss(reference_model, step).backward()
        step_count += 1
        for i, p in enumerate(params):
            stored, scale = masters[i]
            main = _padded(stored.float() * scale)
            grad = _padded(p.grad.float().reshape(-1))
            decay = WD if p.dim() > 1 else 0.0
            torch._fused_adamw_([main], [grad], states[i][:1], states[i][1:], [], [step_count], lr=LR,
                                beta1=BETAS[0], beta2=BETAS[1], weight_decay=decay, eps=EPS, amsgrad=False,
                                maximize=False)
            value = main[:p.numel()]
            scale = value.abs().max() / 32752.0
            masters[i] = [(value * (1 / scale)).clamp(-32752, 32752).to(torch.float16), scale]
            p.data.copy_((masters[i][0].float() * scale).reshape(p.shape))
        for ours, theirs in zip(model.parameters(), reference_model.parameters()):
            assert torch.equal(ours, theirs), f"step {step}"


@pytest.mark.parametrize("capture", ["eager", "graph"])
@pytest.mark.parametrize("setting", MAIN_SETTINGS)
def test_stored_main_params_skip_bitwise_and_capture_equals_eager(setting, capture):
    model, eager_model = _bf16_model(), _bf16_model()
    opt = gs.get_optimizer(_main_config(setting, capture=capture, capture_warmup_steps=1), model)
    eager = gs.get_optimizer(_main_config(setting, capture="eager"), eager_model)
    _bf16_train(model, opt, 4)
    _bf16_train(eager_model, eager, 4)
    assert opt.captured == (capture == "graph")
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), eager_model.parameters()))
    main, params = [t.view(torch.uint8).clone() for t in opt.buffers.main_shard], [p.clone() for p in model.parameters()]
    opt.zero_grad()
    _bf16_loss(model, 4).backward()
    model[0].weight.main_grad[0, 0] = float("inf")  # bf16 params: backward accumulates into the fp32 main grad
    assert not bool(opt.step().update_successful)
    assert all(torch.equal(a, b.view(torch.uint8)) for a, b in zip(main, opt.buffers.main_shard))
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))


@pytest.mark.parametrize("setting", MAIN_SETTINGS)
def test_stored_main_params_checkpoint_as_fp32_values_and_resume_bitwise(setting):
    model = _bf16_model()
    opt = gs.get_optimizer(_main_config(setting, capture="eager"), model)
    _bf16_train(model, opt, 4)
    saved = opt.state_dict()
    assert all(t.dtype == torch.float32 for t in saved["main_params"])
    resumed_model = _bf16_model()
    resumed = gs.get_optimizer(_main_config(setting, capture="eager"), resumed_model)
    resumed.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed_model.parameters()))
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(opt.buffers.main_shard, resumed.buffers.main_shard))
    sharded = checkpoint.sharded_state_dict(opt)
    other_model = _bf16_model()
    other = gs.get_optimizer(_main_config(setting, capture="eager", bucket_size=256), other_model)
    checkpoint.load_sharded_state_dict(other, sharded)
    assert torch.equal(checkpoint.sharded_state_dict(other)["optimizer.state.fp32_param.0.weight"],
                       sharded["optimizer.state.fp32_param.0.weight"])
    _bf16_train(model, opt, 3, first=4)
    _bf16_train(resumed_model, resumed, 3, first=4)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed_model.parameters()))


@pytest.mark.parametrize("setting", MAIN_SETTINGS)
def test_stored_main_params_take_2_bytes_per_param(setting):
    model = torch.nn.Linear(256, 256).to(torch.bfloat16)
    opt = gs.get_optimizer(_main_config(setting, capture="eager"), model)
    numel = sum(p.numel() for p in model.parameters())
    assert 2 * numel <= opt.memory_stats()["device"]["main_params"] <= 2 * numel + 64 * 3 * 8 + 256


MAIN_REFUSED = [
    (dict(main_params_dtype=torch.float16, use_precision_aware_optimizer=True), "main_params_dtype", "bf16=True"),
    (dict(main_params_dtype=torch.float16), "main_params_dtype", "use_precision_aware_optimizer"),
    (dict(bf16=True, use_precision_aware_optimizer=True, qk_clip=True), "store_param_remainders", "qk_clip"),
    (dict(bf16=True, use_precision_aware_optimizer=True, fp8_recipe="tensorwise"), "store_param_remainders",
     "fp8_recipe"),
    (dict(bf16=True, use_precision_aware_optimizer=True, main_params_dtype=torch.float16, optimizer_cpu_offload=True,
          optimizer_offload_fraction=0.5, capture="eager"), "main_params_dtype", "optimizer_cpu_offload"),
]


@pytest.mark.parametrize("kwargs, field, why", MAIN_REFUSED, ids=[w for _, _, w in MAIN_REFUSED])
def test_what_stored_main_params_cannot_do_is_refused(kwargs, field, why):
    with pytest.raises(ValueError, match=rf"OptimizerConfig\.{field}=.*{why}"):
        gs.OptimizerConfig(**kwargs)
