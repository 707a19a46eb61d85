"""AdEMAMix (graphstep/families/ademamix.py, graphstep/kernels/ademamix.py) against the paper's Algorithm 1
written out below in plain torch over separate tensors (Pagliardini et al. 2024): the kernel and the whole
engine bitwise, captured and eager, with lr, β1 (torch's OneCycleLR), α and β3 (the paper's warm-ups)
moving every step and no recapture; α = 0 is AdamW (torch.optim's, within the drift of docs/design.md
§8); a skipped step leaves everything bitwise unchanged; both checkpoint formats resume bitwise; an
override routes one param of an Adam model to it; 2 gloo ranks with sharded state match one process as
Adam does (tests/distributed/test_sharded_step.py's standard)."""

import copy
import math

import pytest
import torch

import graphstep as gs
from graphstep.families import FAMILIES, ademamix
from graphstep.families.ademamix import alpha_warmup, beta3_warmup
from graphstep.kernels import ademamix as kernels
import _ademamix_workers as workers
from _engine import make_engine
from _harness import spawn, values
from toy import decay_groups, loss_fn, relative_drift, tiny_transformer

SIZES = [129, 1000, 64]
STEPS, INF_STEP = 10, 4


def paper_step(p, g, m1, m2, nu, *, t, lr, beta1, beta2, beta3, alpha, weight_decay, eps):
    """Algorithm 1 for one tensor, Python floats (m2 is not bias-corrected; decay on the old θ)."""
    m1.copy_(beta1 * m1 + (1 - beta1) * g)
    m2.copy_(beta3 * m2 + (1 - beta3) * g)
    nu.copy_(beta2 * nu + (1 - beta2) * g**2)
    m1_hat = m1 / (1 - beta1**t)
    nu_hat = nu / (1 - beta2**t)
    p.copy_(p - lr * ((m1_hat + alpha * m2) / (nu_hat.sqrt() + eps) + weight_decay * p))


def schedule(step):
    """Every hyperparameter moving: lr, β1 and β2 a little, α and β3 by the paper's warm-ups."""
    return dict(lr=1e-3 * (1 + 0.1 * step), beta1=0.9 - 0.01 * step, beta2=0.99 + 0.0005 * step,
                beta3=beta3_warmup(step, 0.999, 8, beta_start=0.9), alpha=alpha_warmup(step, 5.0, 8),
                weight_decay=0.1 - 0.005 * step, eps=1e-8 * (1 + step))


def hp(value):
    return torch.tensor(value, dtype=torch.float64)  # the live table's dtype on the CPU


def problem(seed):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=gen) for n in SIZES]
    states = [[0.1 * torch.randn(n, generator=gen) for n in SIZES] for _ in range(2)]
    states.append([torch.rand(n, generator=gen) for n in SIZES])  # ν >= 0
    return params, states, gen


def run_kernel(params, grads, states, step, *, found_inf=0.0, grad_scale=None, **hyper):
    kernels.ademamix(params, grads, *states, step=torch.tensor(float(step)), found_inf=torch.tensor(found_inf),
                     grad_scale=None if grad_scale is None else torch.tensor(grad_scale),
                     **{k: hp(v) for k, v in hyper.items()})


# ---- the kernel --------------------------------------------------------------------------------------

def test_kernel_equals_the_paper_bitwise_with_every_hyperparameter_moving():
    params, states, gen = problem(0)
    ref_params, ref_states = copy.deepcopy(params), copy.deepcopy(states)
    for step in range(1, 16):
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        run_kernel(params, grads, states, step, grad_scale=2.0, **schedule(step))
        for i, (p, g) in enumerate(zip(ref_params, grads)):
            paper_step(p, g / 2.0, *(s[i] for s in ref_states), t=step, **schedule(step))
    for got, want in zip(params + sum(states, []), ref_params + sum(ref_states, [])):
        assert torch.equal(got, want)


def test_a_skipped_step_leaves_params_and_every_state_bitwise_unchanged_even_the_first():
    params, states, gen = problem(1)
    before = copy.deepcopy(params + sum(states, []))
    grads = [torch.randn(p.shape, generator=gen) for p in params]
    grads[1][7] = float("nan")
    for step in (0, 3):  # step 0: the bias corrections are 1 − β^0 = 0, the update inf/NaN, and dropped
        run_kernel(params, grads, states, step, found_inf=1.0, **schedule(step))
        assert all(torch.equal(a, b) for a, b in zip(params + sum(states, []), before))


def test_declarations():
    assert kernels.LIVE_FIELDS == {column for _, column in FAMILIES["ademamix"].hyperparameters}
    assert kernels.STATE_NAMES == ("exp_avg", "exp_avg_slow", "exp_avg_sq")
    twin = kernels.compiled_twin()
    assert (twin.LIVE_FIELDS, twin.STATE_NAMES) == (kernels.LIVE_FIELDS, kernels.STATE_NAMES)
    assert [s.nonnegative for s in FAMILIES["ademamix"].states] == [False, False, True]
    params, states, gen = problem(2)
    with pytest.raises(ValueError, match="one of each per view"):
        run_kernel(params, params[:2], states, 1, **schedule(1))


def test_the_papers_warmups():
    assert [alpha_warmup(t, 8.0, 4) for t in (0, 1, 4, 9)] == [0.0, 2.0, 8.0, 8.0]
    assert beta3_warmup(0, 0.9999, 100, beta_start=0.9) == pytest.approx(0.9)
    assert beta3_warmup(100, 0.9999, 100, beta_start=0.9) == 0.9999
    # The half-life ln(0.5) / ln(β) grows linearly from β_start's to β3's.
    half = [math.log(0.5) / math.log(beta3_warmup(t, 0.9999, 100, beta_start=0.9)) for t in (0, 25, 50)]
    assert half[2] - half[1] == pytest.approx(half[1] - half[0])
    with pytest.raises(ValueError, match="beta_start"):
        beta3_warmup(1, 0.9, 10, beta_start=0.0)


# ---- the engine --------------------------------------------------------------------------------------

def ademamix_engine(net, **changes):
    fields = dict(optimizer="ademamix", lr=1e-2, clip_grad=0.0, weight_decay=0.1, capture_warmup_steps=2,
                  ademamix_beta3=0.999, ademamix_alpha=5.0)
    return make_engine(net, **{**fields, **changes})


def set_warmups(opt, step):
    for group in opt.param_groups:
        group["alpha"] = alpha_warmup(step, 5.0, 6)
        group["beta3"] = beta3_warmup(step, 0.999, 6, beta_start=0.9)


def paper_twin_step(twin, opt, states, step_count):
    """The paper's step on ``twin`` (by param name) with each of ``opt``'s groups' current values."""
    named = dict(twin.named_parameters())
    for group in opt.param_groups:
        hyper = dict(lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1], beta3=group["beta3"],
                     alpha=group["alpha"], weight_decay=group["weight_decay"], eps=group["eps"])
        for name in group["param_names"]:
            p = named[name]
            with torch.no_grad():
                paper_step(p, p.grad, *states[name], t=step_count, **hyper)


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.small_fold_units
def test_engine_equals_the_paper_bitwise_under_one_cycle_lr_and_the_papers_warmups(mode):
    net = tiny_transformer()
    twin = copy.deepcopy(net)
    opt = ademamix_engine(net, capture=mode)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-2, total_steps=STEPS + 1)  # lr and β1
    states = {n: [torch.zeros_like(p) for _ in range(3)] for n, p in twin.named_parameters()}
    t, betas = 0, set()
    for step in range(STEPS):
        set_warmups(opt, step)
        betas.add(opt.param_groups[0]["betas"][0])
        for model in (net, twin):
            model.zero_grad()
            loss_fn(model, step).backward()
        if step == INF_STEP:
            net[1].linear1.weight.main_grad[0, 0] = float("nan")
        applied = bool(opt.step().update_successful)
        assert applied == (step != INF_STEP)
        if applied:
            t += 1
            paper_twin_step(twin, opt, states, t)
        scheduler.step()
    assert len(betas) == STEPS  # OneCycleLR cycled β1 every step, and it reached the kernel
    assert opt.recaptures == 0 and opt.captured == (mode == "graph")
    for (name, a), b in zip(net.named_parameters(), twin.parameters()):
        assert torch.equal(a, b), name
    saved = gs.checkpoint.sharded_state_dict(opt)  # per param, by name
    for name, (m1, m2, nu) in states.items():
        for state, want in (("exp_avg", m1), ("exp_avg_slow", m2), ("exp_avg_sq", nu)):
            assert torch.equal(saved[f"optimizer.state.{state}.{name}"].view_as(want), want), (state, name)


def train_against_for_loop_adamw(make_optimizer, steps=20):
    """The drift (docs/design.md §8) of ``make_optimizer(model)`` from torch.optim.AdamW's for-loop."""
    net = tiny_transformer()
    start = [p.detach().clone() for p in net.parameters()]
    twin = copy.deepcopy(net)
    pair = ((net, make_optimizer(net)), (twin, torch.optim.AdamW(decay_groups(twin, 0.1), lr=1e-2, foreach=False)))
    for step in range(steps):
        for model, optimizer in pair:
            optimizer.zero_grad()
            loss_fn(model, step).backward()
            optimizer.step()
    return relative_drift(list(net.parameters()), list(twin.parameters()), start)


def test_alpha_zero_is_adamw_within_the_drift_of_torchs_own_fused_adamw():
    """With α = 0 the slow EMA drops out and the rule is AdamW's; the op forms differ (torch: lerp,
    addcdiv, √ν / √(1 − β2^t)), and Adam turns last-bit differences into sign flips of near-zero grads.
    The bound is torch's own: its fused AdamW against its for-loop AdamW (measured 2.3e-3 of the motion over
    20 steps here; AdEMAMix with α = 0: 1.8e-3, and 1.6e-6 after one step)."""
    ademamix_drift = train_against_for_loop_adamw(lambda net: ademamix_engine(net, ademamix_alpha=0.0))
    torch_drift = train_against_for_loop_adamw(lambda net: torch.optim.AdamW(decay_groups(net, 0.1), lr=1e-2,
                                                                             fused=True))
    assert 0 < ademamix_drift < 1.5 * torch_drift, (ademamix_drift, torch_drift)
    one_step = train_against_for_loop_adamw(lambda net: ademamix_engine(net, ademamix_alpha=0.0), steps=1)
    assert one_step < 1e-5, one_step


def test_cosine_annealing_moves_the_captured_step_as_it_moves_the_eager_one():
    finals = {}
    for mode, scheduled in (("graph", True), ("eager", True), ("graph", False)):
        net = tiny_transformer()
        opt = ademamix_engine(net, capture=mode)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4) if scheduled else None
        for step in range(6):
            opt.zero_grad()
            loss_fn(net, step).backward()
            opt.step()
            if scheduler is not None:
                scheduler.step()
        assert opt.recaptures == 0
        finals[mode, scheduled] = [p.detach().clone() for p in net.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(finals["graph", True], finals["eager", True]))
    assert not all(torch.equal(a, b) for a, b in zip(finals["graph", True], finals["graph", False]))


@pytest.mark.parametrize("fmt", ["state_dict", "dcp"])
def test_checkpoint_round_trip_then_training_continues_bitwise(fmt, tmp_path):
    net, twin_net = tiny_transformer(), tiny_transformer(seed=1)
    opt, twin = ademamix_engine(net, capture="graph"), ademamix_engine(twin_net, capture="graph")
    for step in range(4):
        set_warmups(opt, step)
        opt.zero_grad()
        loss_fn(net, step).backward()
        opt.step()
    if fmt == "state_dict":
        twin.load_state_dict(opt.state_dict())
    else:
        gs.checkpoint.save(opt, tmp_path / "ckpt", model=net)
        gs.checkpoint.load(twin, tmp_path / "ckpt", model=twin_net)
    assert [g["alpha"] for g in twin.param_groups] == [g["alpha"] for g in opt.param_groups]
    for step in range(4, 7):
        for model, optimizer in ((net, opt), (twin_net, twin)):
            set_warmups(optimizer, step)
            optimizer.zero_grad()
            loss_fn(model, step).backward()
            optimizer.step()
    for a, b in zip(net.parameters(), twin_net.parameters()):
        assert torch.equal(a, b)
    for name, (a, b) in {n: (opt.buffers.state[n], twin.buffers.state[n]) for n in opt.buffers.state}.items():
        assert all(torch.equal(x, y) for x, y in zip(a, b)), name


@pytest.mark.parametrize("kernel", ["fused", "reference", "auto"])
def test_every_kernel_setting_runs_the_ademamix_kernel(kernel):
    """There is no fused AdEMAMix: the family brings its own module (Family.kernels), as Lion does, so every
    setting but "compiled" runs it, bitwise alike, all hyperparameters live; "auto" probes no compile."""
    runs = []
    for setting in ("reference", kernel):
        net = tiny_transformer()
        opt = ademamix_engine(net, kernel=setting, capture="graph")
        for step in range(5):
            set_warmups(opt, step)
            opt.zero_grad()
            loss_fn(net, step).backward()
            opt.step()
        assert opt.recaptures == 0
        runs.append([p.detach().clone() for p in net.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def correctly_rounded_sqrt(monkeypatch):
    """The eager kernel's ``sqrt_`` rounded correctly (through fp64, exact for fp32 inputs). torch's CPU sqrt is
    not everywhere: on the AMD EPYC machines here this build rounds one fp32 value in six an ulp off, on an Intel
    Xeon it is exact, whatever ``ATEN_CPU_CAPABILITY`` says (MKL's vector math, which picks its code by processor,
    is the likely cause); the compiled loop's is the processor's exact instruction. That is the one difference
    between the compiled twin and the eager kernel, which the tests below pin by patching it out."""
    monkeypatch.setattr(torch.Tensor, "sqrt_", lambda self: self.copy_(self.double().sqrt()))


def twin_problem_steps(module, params, states, gen_seed):
    gen = torch.Generator().manual_seed(gen_seed)
    for step in range(1, 12):
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        module.ademamix(params, grads, *states, step=torch.tensor(float(step)),
                        found_inf=torch.tensor(1.0 if step == 5 else 0.0),
                        grad_scale=torch.tensor(2.0) if step % 2 else None,
                        **{k: hp(v) for k, v in schedule(step).items()})


def test_the_compiled_twin_is_the_eager_kernel_bitwise_with_every_hyperparameter_moving(monkeypatch):
    """graphstep/kernels/compiled_ademamix.py: the eager kernel's ops traced into one loop, bitwise the eager kernel
    with a correctly rounded sqrt, over views of odd lengths (tails), a grad scale and a skipped step; against the
    eager kernel as it is, only its sqrt's last bits apart."""
    from graphstep.kernels import compiled_ademamix
    params, states, _ = problem(3)
    start = copy.deepcopy(params)
    runs = {}
    for name, module, exact in (("twin", compiled_ademamix, False), ("eager", kernels, False),
                                ("eager_exact_sqrt", kernels, True)):
        ps, ss = copy.deepcopy(params), copy.deepcopy(states)
        with monkeypatch.context() as patch:
            if exact:
                correctly_rounded_sqrt(patch)
            twin_problem_steps(module, ps, ss, 7)
        runs[name] = ps + sum(ss, [])
    for k, (got, want) in enumerate(zip(runs["twin"], runs["eager_exact_sqrt"])):
        assert torch.equal(got, want), f"tensor {k}"
    # against torch's own sqrt: bitwise where this processor's sqrt is exact, else its last bits apart
    assert relative_drift(runs["twin"][:3], runs["eager"][:3], start) < 1e-5


def test_kernel_compiled_runs_the_compiled_twin_captured_bitwise(monkeypatch):
    from graphstep.kernels import compiled_ademamix
    calls = []
    op = compiled_ademamix._ademamix_op
    monkeypatch.setattr(compiled_ademamix, "_ademamix_op", lambda *a: (calls.append(1), op(*a)))
    runs = []
    for setting, capture in (("compiled", "graph"), ("reference", "eager")):
        net = tiny_transformer()
        opt = ademamix_engine(net, kernel=setting, capture=capture)
        with monkeypatch.context() as patch:
            if setting == "reference":
                correctly_rounded_sqrt(patch)
            for step in range(5):
                set_warmups(opt, step)
                opt.zero_grad()
                loss_fn(net, step).backward()
                if step == 3:
                    net[1].linear1.weight.main_grad[0, 0] = float("nan")
                opt.step()
        assert opt.recaptures == 0 and opt.captured == (capture == "graph")
        runs.append([p.detach().clone() for p in net.parameters()])
    assert calls, "kernel='compiled' did not run the compiled AdEMAMix"
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.auto_as_large
def test_auto_kernel_runs_the_compiled_twin_where_torch_compile_works():
    # AdEMAMix has its own kernels module, with a compiled twin: "auto" probes as for Adam.
    from _auto_kernel import assert_compiled_unless_inductor_cannot_compile

    opt = ademamix_engine(tiny_transformer(), kernel="auto")
    assert_compiled_unless_inductor_cannot_compile(opt.kernel_choice)


def test_an_override_routes_one_param_of_an_adam_model_to_ademamix():
    """The rest stays torch.optim.AdamW(fused=True) bitwise (kernel="fused"), the routed param the paper."""
    net = tiny_transformer()
    twin = copy.deepcopy(net)
    routed = "1.linear1.weight"
    config = gs.OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=0.0, weight_decay=0.1, kernel="fused",
                                capture="eager")
    opt = gs.get_optimizer(config, net, config_overrides={gs.ParamKey(name=routed): {"optimizer": "ademamix"}})
    (group,) = [g for g in opt.param_groups if g.get("optimizer") == "ademamix"]
    assert group["param_names"] == [routed] and group["alpha"] == 5.0 and "momentum" not in group
    assert all(g.get("optimizer") == "adam" for g in opt.param_groups if g is not group)
    named = dict(twin.named_parameters())
    others = [{"params": [named[n] for n in g["param_names"]], "weight_decay": g["weight_decay"]}
              for g in opt.param_groups if g is not group]
    torch_opt = torch.optim.AdamW(others, lr=1e-2, fused=True)
    states = {routed: [torch.zeros_like(named[routed]) for _ in range(3)]}
    for step in range(6):
        for model in (net, twin):
            model.zero_grad()
            loss_fn(model, step).backward()
        opt.step()
        torch_opt.step()
        with torch.no_grad():
            paper_step(named[routed], named[routed].grad, *states[routed], t=step + 1, lr=1e-2, beta1=0.9,
                       beta2=0.999, beta3=0.9999, alpha=5.0, weight_decay=group["weight_decay"], eps=1e-8)
    for (name, a), b in zip(net.named_parameters(), twin.parameters()):
        assert torch.equal(a, b), name


# ---- 2 gloo ranks, sharded state ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_ranks():
    return values(spawn(workers.both_modes, 2, timeout=55))  # one spawn: eager and captured


@pytest.mark.distributed
def test_two_sharded_ranks_match_one_process_as_adam_does(two_ranks):
    """tests/distributed/test_sharded_step.py's standard for Adam in fp32: only the grad reduction's order
    differs from one process, so within 1e-3 of the motion; every rank holds the same params bitwise, skips
    the step one rank's grads made non-finite, and holds a shard of the three states; replay equals eager
    bitwise with α and β3 moving, never recaptured."""
    reference = workers.train(0, 1, "eager")
    expected = [step != workers.INF_STEP for step in range(workers.STEPS)]
    assert reference["ok"] == expected
    for rank, result in enumerate(two_ranks):
        eager, graph = result["eager"], result["graph"]
        drift = relative_drift(eager["params"], reference["params"], reference["start"])
        assert 0 < drift < 1e-3, f"rank {rank}: drift {drift:.2e} of the motion"
        assert eager["ok"] == graph["ok"] == expected
        assert graph["captured"] and graph["recaptures"] == 0
        assert all(torch.equal(a, b) for a, b in zip(eager["params"], graph["params"])), f"rank {rank}"
        assert all(torch.equal(a, b) for a, b in zip(graph["params"], two_ranks[0]["graph"]["params"]))
        assert 0 < eager["state_numel"] < 0.6 * 3 * eager["param_numel"]  # about half of m1, m2 and ν


# ---- config, MuP ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("changes, field", [
    (dict(ademamix_beta3=1.0), "ademamix_beta3"), (dict(ademamix_beta3=-0.1), "ademamix_beta3"),
    (dict(ademamix_alpha=-1.0), "ademamix_alpha"), (dict(adam_eps=0.0), "adam_eps"),
    (dict(adam_beta1=1.0), "adam_beta1"), (dict(decoupled_weight_decay=False), "decoupled_weight_decay")])
def test_config_validation(changes, field):
    with pytest.raises(ValueError, match=rf"OptimizerConfig\.{field}="):
        gs.OptimizerConfig(optimizer="ademamix", **changes)


def test_l2_decay_elsewhere_is_not_refused_and_alpha_zero_is_allowed():
    gs.OptimizerConfig(optimizer="adam", decoupled_weight_decay=False)  # AdEMAMix's rule is for its own config
    gs.OptimizerConfig(optimizer="ademamix", ademamix_alpha=0.0, ademamix_beta3=0.0)


def test_mup_gives_it_adams_rule():
    config = gs.OptimizerConfig(optimizer="ademamix")
    assert gs.get_mup_config_overrides(config, 2.0, "ademamix") == gs.get_mup_config_overrides(config, 2.0, "adam")
    assert ademamix.FAMILY.offload is False
