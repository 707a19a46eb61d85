"""Update kernels: fused and compiled against the reference, the reference against torch.optim, skips bitwise."""

import json
from types import SimpleNamespace

import pytest
import torch

import graphstep as gs
from graphstep import kernels as kernels_package
from graphstep.families import FAMILIES, GroupViews, StepScalars
from graphstep.kernels import auto, compiled, fused, get_kernels, reference
from graphstep.native import update_loops
from graphstep.step import compiled_scalar_math
from _dispatched import DispatchedOps
from _auto_kernel import assert_compiled_unless_inductor_cannot_compile

SIZES = [129, 1000, 64]


@pytest.fixture
def through_torch_compile():
    """The compiled kernel through ``torch.compile`` even where the native loop would run its fp32 CPU Adam
    (graphstep/native/update_loops.py): for the tests of the ``torch.compile`` path itself."""
    with update_loops.off():
        yield


def make_state(seed, n_state):
    g = torch.Generator().manual_seed(seed)
    flat = lambda: torch.randn(sum(SIZES), generator=g)
    params, grads = flat(), flat()
    states = [flat().abs() for _ in range(n_state)]
    return params, grads, states


def views(flat):
    out, start = [], 0
    for n in SIZES:
        out.append(flat[start:start + n])
        start += n
    return out


def run_adam(kernels, params, grads, states, *, steps, decoupled, found_inf=0.0, grad_scale=2.0):
    step = torch.zeros(())
    live = kernels.LIVE_FIELDS
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8)
    args = {k: torch.tensor(v, dtype=torch.float64) if k in live else v for k, v in hp.items()}
    for _ in range(steps):
        step += 1 - found_inf
        kernels.adam(views(params), views(grads.clone()), views(states[0]), views(states[1]), step=step,
                     decoupled=decoupled, grad_scale=torch.tensor(grad_scale), found_inf=torch.tensor(found_inf),
                     **args)


def run_sgd(kernels, params, grads, states, *, steps, nesterov, found_inf=0.0, grad_scale=2.0):
    live = kernels.LIVE_FIELDS
    momentum = 0.9 if states else 0.0
    hp = dict(lr=1e-2, weight_decay=0.1, momentum=momentum)
    args = {k: torch.tensor(v, dtype=torch.float64) if k in live else v for k, v in hp.items()}
    for _ in range(steps):
        kernels.sgd(views(params), views(grads.clone()), [v for s in states for v in views(s)], nesterov=nesterov,
                    grad_scale=torch.tensor(grad_scale), found_inf=torch.tensor(found_inf), **args)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("kernels", [fused, compiled], ids=["fused", "compiled"])
@pytest.mark.parametrize("decoupled", [True, False])
def test_adam_matches_reference(kernels, decoupled):
    p1, g, s1 = make_state(0, 2)
    p2, s2 = p1.clone(), [s.clone() for s in s1]
    run_adam(kernels, p1, g, s1, steps=5, decoupled=decoupled)
    run_adam(reference, p2, g, s2, steps=5, decoupled=decoupled)
    assert rel(p1, p2) < 1e-6
    assert rel(s1[0], s2[0]) < 1e-6 and rel(s1[1], s2[1]) < 1e-6


@pytest.mark.parametrize("kernels", [fused, compiled], ids=["fused", "compiled"])
@pytest.mark.parametrize("nesterov, momentum", [(False, True), (True, True), (False, False)])
def test_sgd_matches_reference(kernels, nesterov, momentum):
    p1, g, s1 = make_state(1, 1 if momentum else 0)
    s1 = [torch.zeros_like(s) for s in s1]
    p2, s2 = p1.clone(), [s.clone() for s in s1]
    run_sgd(kernels, p1, g, s1, steps=5, nesterov=nesterov)
    run_sgd(reference, p2, g, s2, steps=5, nesterov=nesterov)
    assert rel(p1, p2) < 1e-6


def test_reference_adam_matches_torch_adamw():
    p, g, _ = make_state(2, 0)
    states = [torch.zeros_like(p), torch.zeros_like(p)]
    ours = p.clone()
    param = torch.nn.Parameter(p.clone())
    opt = torch.optim.AdamW([param], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8, foreach=False)
    for _ in range(5):
        param.grad = g / 2.0
        opt.step()
    run_adam(reference, ours, g, states, steps=5, decoupled=True)
    assert rel(ours, param.detach()) < 1e-6


@pytest.mark.parametrize("kernels", [fused, compiled, reference], ids=["fused", "compiled", "reference"])
@pytest.mark.parametrize("rule", ["adam", "sgd"])
def test_skip_leaves_everything_bitwise_unchanged(kernels, rule):
    params, grads, states = make_state(3, 2 if rule == "adam" else 1)
    grads[5] = float("inf")
    before = [params.clone()] + [s.clone() for s in states]
    if rule == "adam":
        run_adam(kernels, params, grads, states, steps=3, decoupled=True, found_inf=1.0)
    else:
        run_sgd(kernels, params, grads, states, steps=3, nesterov=False, found_inf=1.0)
    for a, b in zip(before, [params] + states):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kernels", [fused, reference], ids=["fused", "reference"])
@pytest.mark.parametrize("found_inf", [0.0, 1.0])
def test_grads_left_unscaled_only_on_applied_steps(kernels, found_inf):
    params, grads, states = make_state(5, 2)
    before = grads.clone()
    kernels.adam(views(params), views(grads), views(states[0]), views(states[1]), step=torch.ones(()),
                 lr=torch.tensor(1e-3, dtype=torch.float64), beta1=0.9, beta2=0.99, weight_decay=0.0, eps=1e-8,
                 decoupled=True, grad_scale=torch.tensor(4.0), found_inf=torch.tensor(found_inf))
    assert torch.equal(grads, before if found_inf else before / 4.0)


def test_compiled_kernel_reads_the_grads_without_writing_them():
    params, grads, states = make_state(5, 2)
    before, start = grads.clone(), params.clone()
    compiled.adam(views(params), views(grads), views(states[0]), views(states[1]), step=torch.ones(()),
                  lr=torch.tensor(1e-3, dtype=torch.float64), beta1=0.9, beta2=0.99, weight_decay=0.0, eps=1e-8,
                  decoupled=True, grad_scale=torch.tensor(4.0), found_inf=torch.zeros(()))
    assert torch.equal(grads, before) and not torch.equal(params, start)


def test_compiled_kernel_is_one_operator_per_call_to_the_dispatcher():
    # What lets capture's replay backend record it and capture.check see it.
    params, grads, states = make_state(6, 2)
    with DispatchedOps() as ops:
        compiled.adam(views(params), views(grads), views(states[0]), views(states[1]), step=torch.ones(()),
                      lr=torch.tensor(1e-3, dtype=torch.float64), beta1=0.9, beta2=0.99, weight_decay=0.1,
                      eps=1e-8, decoupled=True, grad_scale=None, found_inf=torch.zeros(()))
    assert ops.names.count("graphstep.compiled_adam_.default") == 1  # all three views in one call


@pytest.mark.parametrize("kernels", [fused, compiled, reference], ids=["fused", "compiled", "reference"])
def test_adam_groups_equal_one_adam_call_per_group_bitwise(kernels):
    # Two groups of different hyperparameters (a no-decay group with its own lr and betas); the compiled
    # kernel runs both in one call, each view reading its own group's coefficients.
    f64 = (lambda v: torch.tensor(v, dtype=torch.float64)) if kernels is not fused else float
    hypers = [dict(lr=f64(1e-2), beta1=f64(0.9), beta2=f64(0.95), weight_decay=f64(0.1), eps=f64(1e-8)),
              dict(lr=f64(3e-3), beta1=f64(0.8), beta2=f64(0.99), weight_decay=f64(0.0), eps=f64(1e-6))]
    if kernels is fused:
        hypers = [dict(h, lr=torch.tensor(h["lr"])) for h in hypers]
    together, apart = make_state(8, 2), make_state(8, 2)
    step_wide = dict(step=torch.tensor(3.0), decoupled=True, grad_scale=torch.tensor(4.0), found_inf=torch.zeros(()))

    def group_views(flat, group):  # group 0: the first two views, group 1: the third
        return views(flat)[:2] if group == 0 else views(flat)[2:]

    def group(state, index):
        params, grads, (exp_avg, exp_avg_sq) = state
        return tuple(group_views(t, index) for t in (params, grads, exp_avg, exp_avg_sq)) + (hypers[index],)

    kernels.adam_groups([group(together, 0), group(together, 1)], **step_wide)
    for index in (0, 1):
        *tensors, hyper = group(apart, index)
        kernels.adam(*tensors, **hyper, **step_wide)
    for a, b in zip([together[0], *together[2]], [apart[0], *apart[2]]):
        assert torch.equal(a, b)
    assert not torch.equal(together[0], make_state(8, 2)[0])  # the step did move the params


def test_compiled_adam_groups_is_one_operator_call():
    params, grads, (exp_avg, exp_avg_sq) = make_state(9, 2)
    hyper = dict(lr=torch.tensor(1e-3, dtype=torch.float64), beta1=0.9, beta2=0.99, weight_decay=0.1, eps=1e-8)
    groups = [tuple(views(t)[:1] for t in (params, grads, exp_avg, exp_avg_sq)) + (hyper,),
              tuple(views(t)[1:] for t in (params, grads, exp_avg, exp_avg_sq)) + (dict(hyper, weight_decay=0.0),)]
    with DispatchedOps() as ops:
        compiled.adam_groups(groups, step=torch.ones(()), decoupled=True, grad_scale=None, found_inf=torch.zeros(()))
    assert ops.names.count("graphstep.compiled_adam_.default") == 1


def _adam_once(kernels, params, grads, exp_avgs, exp_avg_sqs):
    f64 = lambda v: torch.tensor(v, dtype=torch.float64)
    kernels.adam(params, grads, exp_avgs, exp_avg_sqs, step=torch.ones(()), lr=f64(1e-2), beta1=f64(0.9),
                 beta2=f64(0.95), weight_decay=f64(0.1), eps=f64(1e-8), decoupled=True, grad_scale=None,
                 found_inf=torch.zeros(()))


@pytest.mark.usefixtures("through_torch_compile")
def test_compiled_kernel_keeps_the_cut_of_views_it_sees_again_and_cuts_again_what_changed(monkeypatch):
    # An engine passes the same view objects every step: cut on the first two calls, kept from the second.
    # A list with another tensor (here a fresh temporary each time) or a view moved to other memory is cut
    # again, never served the old cut (which would update the old memory): each such call matches the
    # reference kernel.
    cuts = []
    as_rows = compiled._as_rows
    monkeypatch.setattr(compiled, "_as_rows", lambda views: cuts.append(len(views)) or as_rows(views))
    params, grads, (exp_avg, exp_avg_sq) = make_state(11, 2)
    lists = [views(t) for t in (params, grads, exp_avg, exp_avg_sq)]
    for expected_cuts in (4, 8, 8, 8):  # one cut per list, on the first and second call only
        _adam_once(compiled, *lists)
        assert len(cuts) == expected_cuts

    def last_view_matches_reference(step_with_last_param):
        expected = [lists[0][2].clone()] if step_with_last_param is None else [step_with_last_param.clone()]
        state = [[lst[2].clone()] for lst in lists[2:]]
        before = len(cuts)
        _adam_once(compiled, lists[0][:2] + [step_with_last_param if step_with_last_param is not None
                                             else lists[0][2]], *lists[1:])
        _adam_once(reference, expected, [lists[1][2]], *state)
        updated = lists[0][2] if step_with_last_param is None else step_with_last_param
        return len(cuts) > before and rel(updated, expected[0]) < 1e-6

    for _ in range(3):  # a temporary last param, freed after each call
        assert last_view_matches_reference(torch.randn(64))
    for _ in range(2):
        _adam_once(compiled, *lists)  # the original views again, twice: cut, and kept
    lists[0][2].set_(torch.randn(64))  # the same view object, over other memory
    assert last_view_matches_reference(None)


@pytest.mark.usefixtures("through_torch_compile")
def test_compiled_kernel_keeps_no_cut_of_grads_that_are_new_every_call():
    # A torch.optim-style caller: the same params, grads reallocated every step. Keeping their cut would
    # hold the last step's grads in memory until the next call.
    params, _, (exp_avg, exp_avg_sq) = make_state(13, 2)
    param_views, state = views(params), [views(exp_avg), views(exp_avg_sq)]
    for _ in range(3):
        _adam_once(compiled, param_views, views(torch.randn(sum(SIZES))), *state)
    assert compiled._rows_by_first_view[param_views[0]].parts is None


@pytest.mark.usefixtures("through_torch_compile")
def test_compiled_kernel_forgets_the_cut_of_views_that_are_gone():
    # The cut of an optimizer's views holds their memory: it must go when the views do.
    import gc
    gc.collect()
    held = len(compiled._rows_by_first_view)
    params, grads, (exp_avg, exp_avg_sq) = make_state(12, 2)
    lists = [views(t) for t in (params, grads, exp_avg, exp_avg_sq)]
    for _ in range(2):
        _adam_once(compiled, *lists)
    assert len(compiled._rows_by_first_view) == held + 1
    assert compiled._rows_by_first_view[lists[0][0]].parts is not None  # the cut, holding the views' memory
    del lists
    gc.collect()
    assert len(compiled._rows_by_first_view) == held


def test_fused_kernel_refuses_tensor_betas():
    params, grads, states = make_state(4, 2)
    with pytest.raises(TypeError, match="beta1 must be a Python float"):
        fused.adam(views(params), views(grads), views(states[0]), views(states[1]), step=torch.ones(()),
                   lr=torch.tensor(1e-3), beta1=torch.tensor(0.9), beta2=0.99, weight_decay=0.0, eps=1e-8,
                   decoupled=True, grad_scale=torch.ones(()), found_inf=torch.zeros(()))


def test_get_kernels_names_choices():
    assert get_kernels("fused") is fused
    assert get_kernels("compiled") is compiled
    with pytest.raises(ValueError, match="'fused', 'compiled', 'reference'"):
        get_kernels("triton")



# ---- the contract: an implementation offers entry points, a family names those it calls ------------------
IMPLEMENTATIONS = {"fused": fused, "compiled": compiled, "reference": reference}


@pytest.mark.parametrize("name", sorted(IMPLEMENTATIONS))
def test_an_implementation_declares_the_entry_points_it_offers(name):
    module = IMPLEMENTATIONS[name]
    assert module.ENTRY_POINTS and all(function is getattr(module, entry)
                                       for entry, function in module.ENTRY_POINTS.items())


def _calls_only_its_entry_points(family):
    """Run ``family``'s call through a stand-in implementation that offers only the entry points the family
    declares: a call of any other one fails (AttributeError)."""
    called = []
    offered = {entry: (lambda *args, entry=entry, **kwargs: called.append(entry)) for entry in family.entry_points}
    stand_in = SimpleNamespace(**offered, ENTRY_POINTS=offered, LIVE_FIELDS=frozenset())
    config = gs.OptimizerConfig(optimizer=family.name)
    views = GroupViews([torch.zeros(4)], [torch.zeros(4)], {n: [torch.zeros(4)] for n in family.state_names(config)})
    hyper = {column: 0.5 for _, column in family.hyperparameters}
    family.run(stand_in, [(views, hyper)], StepScalars(torch.ones(()), torch.zeros(())), config, None)
    return called


def test_each_family_on_the_configured_kernels_declares_the_entry_points_it_calls():
    on_configured = [family for family in FAMILIES.values() if family.kernels is None]
    assert on_configured
    for family in on_configured:
        assert family.entry_points, family.name
        assert set(_calls_only_its_entry_points(family)) == set(family.entry_points), family.name
        for name, module in IMPLEMENTATIONS.items():
            assert set(family.entry_points) <= set(module.ENTRY_POINTS), (family.name, name)
    # A family with a kernels module of its own asks nothing of the configured implementation.
    assert all(not family.entry_points for family in FAMILIES.values() if family.kernels is not None)


def test_an_implementation_lacking_an_entry_point_a_family_needs_is_refused(monkeypatch):
    partial = SimpleNamespace(ENTRY_POINTS={"adam_groups": reference.adam_groups}, LIVE_FIELDS=reference.LIVE_FIELDS)
    monkeypatch.setitem(kernels_package.IMPLEMENTATIONS, "reference", partial)
    needing = [family for family in FAMILIES.values() if family.kernels is None
               and not set(family.entry_points) <= set(partial.ENTRY_POINTS)]
    assert needing
    for family in needing:
        config = gs.OptimizerConfig(optimizer=family.name, kernel="reference")
        with pytest.raises(ValueError, match=rf"kernel='reference' offers no {family.entry_points[0]!r} entry point, "
                                             rf"which {family.title}'s update calls"):
            kernels_package.choose_kernels(config, CPU, [family])
    # Families it offers everything for run on it.
    config = gs.OptimizerConfig(kernel="reference")
    offered = [family for family in FAMILIES.values() if family.kernels is not None
               or set(family.entry_points) <= set(partial.ENTRY_POINTS)]
    assert kernels_package.choose_kernels(config, CPU, offered)[0] is partial

def test_compiled_kernel_layouts_of_many_view_counts_do_not_share_one_recompile_limit(monkeypatch):
    # Each view count compiles its own function: with a limit of 2 variants, four counts still run.
    # (Fresh functions, so that variants other tests compiled do not count here.)
    monkeypatch.setattr(compiled, "_RECOMPILE_LIMIT", 2)
    compiled._compiled.cache_clear()
    for count in (1, 2, 3, 5):
        params, grads, states = make_state(10 + count, 2)
        parts = [torch.tensor_split(t, count) for t in (params, grads, states[0], states[1])]
        start = params.clone()
        compiled.adam(*parts, step=torch.ones(()), lr=torch.tensor(1e-3, dtype=torch.float64), beta1=0.9,
                      beta2=0.99, weight_decay=0.0, eps=1e-8, decoupled=True, grad_scale=None,
                      found_inf=torch.zeros(()))
        assert not torch.equal(params, start)


# ---- kernel="auto", the default (graphstep/kernels/auto.py) -----------------------------------------------
CPU = torch.device("cpu")


@pytest.mark.auto_as_large
def test_auto_runs_the_compiled_kernel_where_torch_compile_works(monkeypatch):
    # Probed afresh: a verdict another test took from the machine's remembered file carries no compile time.
    monkeypatch.setattr(auto, "_probed", {})
    choice = auto.choose("auto", CPU, capture="eager", warmup_steps=3)
    assert_compiled_unless_inductor_cannot_compile(choice)
    works, why_not, seconds = auto.probe_compiled(CPU)
    assert seconds > 0
    if choice.name == "compiled":
        assert works and why_not == "" and "torch.compile works" in choice.reason
    else:
        assert not works and why_not in choice.reason


@pytest.mark.auto_as_large
def test_auto_falls_back_to_fused_with_one_warning_where_torch_compile_fails(monkeypatch):
    def no_compiler(device, hyper_dtype):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found\nmore detail")

    monkeypatch.setattr(auto, "_probed", {})
    monkeypatch.setattr(auto, "_compare_with_reference", no_compiler)
    with pytest.warns(UserWarning, match=r"kernel='auto' runs 'fused': .*InvalidCxxCompiler") as record:
        first = auto.choose("auto", CPU, capture="eager", warmup_steps=3)
    second = auto.choose("auto", CPU, capture="eager", warmup_steps=3)  # the answer is kept: no second warning
    assert len(record) == 1 and "more detail" not in str(record[0].message)
    assert first.name == second.name == "fused" and "does not work" in second.reason


@pytest.mark.auto_as_large
def test_auto_falls_back_to_fused_when_the_compiled_result_differs_from_the_reference(monkeypatch):
    monkeypatch.setattr(auto, "_probed", {})
    monkeypatch.setattr(compiled, "adam", lambda *args, **kwargs: None)  # a "miscompile": nothing updated
    with pytest.warns(UserWarning, match="differs from the reference"):
        assert auto.choose("auto", CPU, capture="eager", warmup_steps=3).name == "fused"


@pytest.mark.auto_as_large
@pytest.mark.usefixtures("through_torch_compile")
def test_compiled_set_explicitly_is_refused_at_build_where_its_result_differs_from_the_reference(monkeypatch):
    monkeypatch.setattr(auto, "_probed", {})
    monkeypatch.setattr(compiled, "adam", lambda *args, **kwargs: None)  # a "miscompile": nothing updated
    message = r"kernel='compiled': torch.compile does not work on cpu \(its result differs .*set kernel='fused'"
    with pytest.raises(RuntimeError, match=message):
        auto.choose("compiled", CPU, capture="eager", warmup_steps=3)
    with pytest.raises(RuntimeError, match=message):
        gs.get_optimizer(gs.OptimizerConfig(kernel="compiled", capture="eager"), torch.nn.Linear(4, 4))
    # A family that brings its own kernel runs no compiled update: nothing to refuse.
    assert auto.choose("compiled", CPU, capture="eager", warmup_steps=3, needs_kernel=False).name == "compiled"


def test_a_compile_error_at_the_first_call_says_what_to_build_with_instead():
    from torch._inductor.exc import CppCompileError

    def cannot_compile():
        raise CppCompileError(["c++", "kernel.cpp"], "kernel.cpp:1: error: 'at::vec' has not been declared")

    with pytest.raises(RuntimeError, match=r"kernel='compiled': torch.compile could not compile the step's kernel "
                                           r"\(CppCompileError: C\+\+ compile error\); build with kernel='fused'"):
        compiled.call_compiled(cannot_compile, variant=("a variant never called before", object()))

    def user_error():
        raise ValueError("not a compile error")

    with pytest.raises(ValueError, match="not a compile error"):  # passed through as it was
        compiled.call_compiled(user_error, variant=("another variant never called before", object()))


@pytest.mark.auto_as_large
def test_auto_probes_with_the_hyperparameter_dtype_the_step_will_use(monkeypatch):
    # A GPU step keeps fp32 hyperparameter tensors (fp64 only on the CPU): the probe must compile that variant.
    seen = []

    def recording_adam(*args, **hyper):
        seen.append(hyper["lr"].dtype)
        reference.adam(*args, **hyper)

    monkeypatch.setattr(auto, "_probed", {})
    monkeypatch.setattr(compiled, "adam", recording_adam)
    assert auto.choose("auto", CPU, capture="eager", warmup_steps=3, hyper_dtype=torch.float32).name == "compiled"
    assert seen == [torch.float32]


def test_scalar_graphs_stay_eager_with_a_warning_where_inductor_lacks_their_options(monkeypatch):
    # Compiled on the first step, after the stages are built: an option this torch lacks must be found at build.
    device = torch.device("meta")  # any device but the CPU, where scalar graphs are never compiled
    assert compiled_scalar_math.wanted("compiled", device)
    monkeypatch.setattr(compiled_scalar_math, "COMPILE_OPTIONS", {**compiled_scalar_math.COMPILE_OPTIONS, "no_such.option": True})
    with pytest.warns(UserWarning, match="no option no_such.option"):
        assert not compiled_scalar_math.wanted("compiled", device)
    assert compiled.missing_compile_options(compiled.COMPILE_OPTIONS) == []


@pytest.mark.auto_as_large
def test_auto_picks_fused_without_probing_when_compiling_first_is_impossible_or_useless(monkeypatch):
    def must_not_probe(device):
        raise AssertionError("probed")

    monkeypatch.setattr(auto, "probe_compiled", must_not_probe)
    assert auto.choose("auto", CPU, capture="graph", warmup_steps=0).name == "fused"
    assert auto.choose("auto", CPU, capture="eager", warmup_steps=3, needs_kernel=False).name == "fused"
    assert auto.choose("reference", CPU, capture="eager", warmup_steps=3).name == "reference"


@pytest.mark.usefixtures("through_torch_compile")
def test_compile_seconds_count_the_first_call_of_each_compiled_variant():
    params, grads, states = make_state(21, 2)
    kwargs = dict(step=torch.ones(()), lr=torch.tensor(1e-3, dtype=torch.float64), beta1=0.9, beta2=0.99,
                  weight_decay=0.0, eps=1e-8, decoupled=True, grad_scale=None, found_inf=torch.zeros(()))
    parts = [torch.tensor_split(t, 7) for t in (params, grads, states[0], states[1])]  # a count no other test uses
    before = compiled.compile_seconds()
    compiled.adam(*parts, **kwargs)
    after_first = compiled.compile_seconds()
    compiled.adam(*parts, **kwargs)
    assert after_first > before and compiled.compile_seconds() == after_first


@pytest.mark.auto_as_large
def test_auto_runs_fused_without_probing_below_the_size_a_compile_pays_for(monkeypatch):
    def must_not_probe(device, hyper_dtype):
        raise AssertionError("probed")

    monkeypatch.setattr(auto, "COMPILE_MIN_NUMEL", 1000)
    monkeypatch.setattr(auto, "probe_compiled", must_not_probe)
    small = auto.choose("auto", CPU, capture="eager", warmup_steps=3, numel=999)
    assert small.name == "fused" and "999 elements to update, fewer than 1,000" in small.reason
    monkeypatch.undo()
    monkeypatch.setattr(auto, "COMPILE_MIN_NUMEL", 1000)
    assert_compiled_unless_inductor_cannot_compile(auto.choose("auto", CPU, capture="eager", warmup_steps=3,
                                                               numel=1000))


def test_a_small_model_builds_and_steps_without_compiling(monkeypatch):
    # The README's kind of model: the real default choice, no compile, no probe.
    monkeypatch.setattr(auto, "probe_compiled", lambda *args: pytest.fail("probed"))
    compiles = compiled.compile_seconds()
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 10))
    opt = gs.get_optimizer(gs.OptimizerConfig(lr=1e-3, clip_grad=1.0), model)
    model(torch.randn(8, 64)).sum().backward()
    opt.step()
    assert opt.kernel_choice.name == "fused" and "fewer than" in opt.kernel_choice.reason
    assert compiled.compile_seconds() == compiles


@pytest.mark.auto_as_large
def test_a_passed_probe_is_remembered_across_processes_and_a_failed_one_is_not(monkeypatch, tmp_path):
    calls = []

    def compare(device, hyper_dtype):
        calls.append(hyper_dtype)
        return None if hyper_dtype == torch.float64 else "its result differs from the reference kernel's"

    verdicts = tmp_path / "cache" / "graphstep_kernel_probe.json"
    monkeypatch.setattr(auto, "verdict_file", lambda: verdicts)
    monkeypatch.setattr(auto, "_compare_with_reference", compare)
    for process in range(2):  # a fresh process: nothing probed in it yet
        monkeypatch.setattr(auto, "_probed", {})
        assert auto.probe_compiled(CPU, torch.float64)[0]
        assert not auto.probe_compiled(CPU, torch.float32)[0]
    # float64 passed and was probed once, by the first process; the float32 failure was probed by both.
    assert calls == [torch.float64, torch.float32, torch.float32]
    assert list(json.loads(verdicts.read_text()).values()) == ["works"]
    # Anything the answer depends on changes the key (here: the kernels' source): probed again.
    monkeypatch.setattr(auto, "_probed", {})
    real_key = auto._machine_key
    monkeypatch.setattr(auto, "_machine_key", lambda device, dtype: real_key(device, dtype) + " edited")
    assert auto.probe_compiled(CPU, torch.float64)[0] and calls[-1] == torch.float64 and len(calls) == 4
    verdicts.write_text("not json")  # a damaged file only means probing again
    monkeypatch.setattr(auto, "_probed", {})
    assert auto.probe_compiled(CPU, torch.float64)[0] and len(calls) == 5
