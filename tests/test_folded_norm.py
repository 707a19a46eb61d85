"""fold_grad_norm on one rank: each buffer's rows folded a unit at a time by the hook of the unit's last
param to arrive (graphstep/step/folded_sums.py; the tests marked ``small_fold_units`` fold units of one row,
tests/conftest.py, the others run the real unit sizes).

The oracle is the unfolded step, and the folded one equals it bitwise: the same rows normed by the same op,
summed in the same order, so the same norm, skip decisions and params. The folded step is exact across
modes too: eager equals captured bitwise, and a loop under ``no_sync()`` equals one that folds every
micro-batch bitwise (the last fold sees the same final grads).
"""

import contextlib
import math
import warnings

import pytest
import torch
from _dispatched import DispatchedOps
from toy import VOCAB, loss_fn

import graphstep as gs
from graphstep.step.stages.norm import RESCUE_ROWS, ROW, SumOfSquares

WIDTH = 96  # wide enough that most weights hold whole 4,096-element rows (folded in backward) and tails

STEPS = 6
SGD = dict(optimizer="sgd", lr=0.05, weight_decay=1e-3, sgd_momentum=0.9)


def folded_model() -> torch.nn.Module:
    """The toy transformer at width 96: six weights of 1-6 full rows plus a tail, ten params under a row."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(VOCAB, WIDTH),
        torch.nn.TransformerEncoderLayer(WIDTH, 4, 2 * WIDTH, dropout=0.0, batch_first=True),
        torch.nn.LayerNorm(WIDTH),
        torch.nn.Linear(WIDTH, VOCAB),
    )


def build(fold: bool, **changes):
    model = folded_model()
    fields = dict(optimizer="adam", lr=3e-3, weight_decay=0.1, clip_grad=0.5, capture="eager", kernel="fused",
                  fold_grad_norm=fold)
    fields.update(changes)
    return model, gs.get_optimizer(gs.OptimizerConfig(**fields), model)


def train(fold: bool, *, micro_batches: int = 1, use_no_sync: bool = True, inf_at=None, steps: int = STEPS,
          **changes) -> dict:
    """``inf_at``: (step, micro-batch) whose loss is multiplied by inf."""
    model, opt = build(fold, **changes)
    norms, ok = [], []
    for step in range(steps):
        opt.zero_grad()
        for micro in range(micro_batches):
            loss = loss_fn(model, step * micro_batches + micro) / micro_batches
            if inf_at == (step, micro):
                loss = loss * math.inf
            if micro < micro_batches - 1 and use_no_sync:
                with opt.no_sync():
                    opt.scale_loss(loss).backward()
            else:
                opt.scale_loss(loss).backward()
        result = opt.step()
        norms.append(float(result.grad_norm))
        ok.append(bool(result.update_successful))
    opt.finish_param_gather()  # an overlapped CPU-offload update may still be copying params back
    return {"params": [p.detach().clone() for p in model.parameters()], "norms": norms, "ok": ok,
            "counts": dict(opt.fold_counts), "captured": opt.captured, "units": backward_units(opt) if fold else 0}


def same_floats(a, b) -> bool:
    """Equal lists of floats, NaN equal to NaN (a skipped step's norm)."""
    return len(a) == len(b) and all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b))


def assert_same_as_unfolded(folded, plain):
    assert folded["ok"] == plain["ok"]
    assert same_floats(folded["norms"], plain["norms"])
    assert all(torch.equal(a, b) for a, b in zip(folded["params"], plain["params"]))


def backward_units(opt) -> int:
    """The units of ``opt``'s rows folded in backward (one row each here: tests/conftest.py)."""
    return len(opt.build_record.fold.hooked.current)


@pytest.mark.parametrize("family", ["sgd", "adam"])
@pytest.mark.parametrize("micro_batches", [1, 2, 3, 4])
@pytest.mark.small_fold_units
def test_folded_norm_is_the_unfolded_step_bitwise_with_grad_accumulation(micro_batches, family):
    changes = SGD if family == "sgd" else {}
    folded = train(True, micro_batches=micro_batches, **changes)
    assert_same_as_unfolded(folded, train(False, micro_batches=micro_batches, **changes))
    # Every unit folded once per step, in the last micro-batch's backward; none before the step.
    assert folded["units"] > 1
    assert folded["counts"] == {"in_backward": folded["units"] * STEPS, "before_step": 0}


@pytest.mark.parametrize("micro_batches", [2, 4])
@pytest.mark.small_fold_units
def test_no_sync_only_saves_folds_the_result_is_bitwise_the_same(micro_batches):
    marked = train(True, micro_batches=micro_batches)
    with pytest.warns(RuntimeWarning, match="more than once outside opt.no_sync"):
        unmarked = train(True, micro_batches=micro_batches, use_no_sync=False)
    assert same_floats(marked["norms"], unmarked["norms"])
    assert all(torch.equal(a, b) for a, b in zip(marked["params"], unmarked["params"]))
    # The first step folds in the first backward, and again before the step (the later backwards changed
    # the grads); having seen that, later steps fold right before the step only.
    units = marked["units"]
    assert unmarked["counts"] == {"in_backward": units, "before_step": STEPS * units}


def test_the_fold_returns_to_backward_once_micro_batches_are_marked():
    model, opt = build(True)
    units = backward_units(opt)
    where = []
    for step, marked in enumerate([False, False, True, True]):
        before = dict(opt.fold_counts)
        opt.zero_grad()
        with opt.no_sync() if marked else contextlib.nullcontext():
            loss_fn(model, 2 * step).backward()
        loss_fn(model, 2 * step + 1).backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            opt.step()
        where.append({k: opt.fold_counts[k] - before[k] for k in before})
    assert where == [{"in_backward": units, "before_step": units},  # unmarked: the second backward undoes it
                     {"in_backward": 0, "before_step": units},  # the step folds instead
                     {"in_backward": 0, "before_step": units},  # one backward seen: back in backward next
                     {"in_backward": units, "before_step": 0}]


@pytest.mark.parametrize("micro", [0, 1, 2])
def test_an_inf_in_any_micro_batch_skips_the_step(micro):
    folded = train(True, micro_batches=3, inf_at=(2, micro), **SGD)
    plain = train(False, micro_batches=3, inf_at=(2, micro), **SGD)
    assert folded["ok"] == plain["ok"] == [True, True, False, True, True, True]
    assert_same_as_unfolded(folded, plain)


def test_dynamic_loss_scale_backs_off_on_a_folded_inf():
    fp16 = dict(fp16=True, initial_loss_scale=2.0**10, hysteresis=1)
    folded = train(True, micro_batches=2, inf_at=(1, 0), **fp16)
    plain = train(False, micro_batches=2, inf_at=(1, 0), **fp16)
    assert folded["ok"][1] is False
    assert_same_as_unfolded(folded, plain)


@pytest.mark.parametrize("dtype_changes", [{}, {"bf16": True}], ids=["fp32", "bf16-main-grads"])
def test_captured_folded_step_equals_eager_bitwise(dtype_changes):
    eager = train(True, micro_batches=2, inf_at=(4, 1), steps=8, **dtype_changes)
    graph = train(True, micro_batches=2, inf_at=(4, 1), steps=8, capture="graph", capture_warmup_steps=2,
                  **dtype_changes)
    assert graph["captured"]
    assert same_floats(eager["norms"], graph["norms"]) and eager["ok"] == graph["ok"]
    assert all(torch.equal(a, b) for a, b in zip(eager["params"], graph["params"]))


def test_bf16_params_fold_their_fp32_main_grads():
    assert_same_as_unfolded(train(True, micro_batches=3, bf16=True, **SGD), train(False, micro_batches=3, bf16=True, **SGD))


# The output layer gets two backwards outside no_sync(): the unmarked-accumulation warning, expected here.
@pytest.mark.filterwarnings("ignore:graphstep. fold_grad_norm. backward ran more than once")
@pytest.mark.small_fold_units
def test_grads_that_did_not_come_through_backward_are_folded_before_the_step():
    # Hand-written grads, a param unused in the last micro-batch, and a step with no backward at all: the
    # step folds every slot that is not current, so the norm is still that of the grads the update reads.
    results = {}
    for fold in (False, True):
        model, opt = build(fold, clip_grad=0.1, **SGD)
        opt.zero_grad()
        loss_fn(model, 0).backward()
        with torch.no_grad():
            model[3].bias.grad.fill_(0.25)  # written by hand, after its hook folded the backward's grad
        with opt.no_sync():
            loss_fn(model, 1).backward()  # folds nothing; every grad changed
        loss = model[3](torch.randn(2, WIDTH)).sum()  # the last backward reaches only the output layer
        loss.backward()
        norms = [float(opt.step().grad_norm)]
        norms.append(float(opt.step().grad_norm))  # no backward since the last step: same grads, refolded
        model[0].weight.grad = None  # a grad set to None reads as zero
        norms.append(float(opt.step().grad_norm))
        results[fold] = (norms, [p.detach().clone() for p in model.parameters()], dict(opt.fold_counts))
    (folded, folded_params, counts), (plain, plain_params, _) = results[True], results[False]
    assert same_floats(folded, plain)
    assert all(torch.equal(a, b) for a, b in zip(folded_params, plain_params))
    assert counts["before_step"] > 0


def test_model_zero_grad_to_none_then_backward_folds_the_fresh_grads():
    results = {}
    for fold in (False, True):
        model, opt = build(fold)
        norms = []
        for step in range(4):
            model.zero_grad(set_to_none=True)  # autograd makes fresh grads: the hook moves them into the buffer
            loss_fn(model, step).backward()
            norms.append(float(opt.step().grad_norm))
        results[fold] = (norms, dict(opt.fold_counts))
    assert same_floats(results[True][0], results[False][0])
    assert results[True][1]["before_step"] == 0


@pytest.mark.small_fold_units
def test_the_step_reads_only_the_folded_sums():
    # Poison a grad after backward folded it, through .data (which bypasses the version counter, so the fold
    # cannot see it): the step's norm is the folded one, not the poisoned grads'.
    model, opt = build(True, clip_grad=0.0)
    loss_fn(model, 0).backward()
    expected = math.sqrt(sum(float(SumOfSquares(p.grad.reshape(-1))()) for p in model.parameters()))
    model[3].weight.grad.data[0, 0] = math.nan
    result = opt.step()
    assert float(result.grad_norm) == pytest.approx(expected, rel=1e-7)  # the reported norm is fp32
    assert opt.fold_counts["before_step"] == 0


@pytest.mark.parametrize("change", ["mul_", "clip_grad_norm_", "small_param_add_"])
@pytest.mark.small_fold_units
def test_grads_changed_in_place_after_backward_are_folded_again(change):
    # Any in-place write to a grad bumps its buffer's version counter: the step refolds that buffer, so the
    # norm is that of the grads the update reads. "small_param_add_" writes a small (unhooked) param's grad.
    results = {}
    for fold in (False, True):
        model, opt = build(fold, clip_grad=0.1, **SGD)
        norms = []
        for step in range(3):
            opt.zero_grad()
            loss_fn(model, step).backward()
            with torch.no_grad():
                if change == "mul_":
                    model[3].weight.grad.mul_(3.0)
                elif change == "clip_grad_norm_":
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
                else:
                    model[2].bias.grad.add_(5.0)
            norms.append(float(opt.step().grad_norm))
        results[fold] = (norms, [p.detach().clone() for p in model.parameters()], dict(opt.fold_counts))
    (folded, folded_params, counts), (plain, plain_params, _) = results[True], results[False]
    assert same_floats(folded, plain)
    assert all(torch.equal(a, b) for a, b in zip(folded_params, plain_params))
    assert counts["before_step"] == counts["in_backward"] > 0  # every unit refolded, every step


@pytest.mark.small_fold_units
def test_debug_step_warns_naming_a_grad_changed_after_its_fold():
    model, opt = build(True)
    loss_fn(model, 0).backward()
    model[3].weight.grad.data.mul_(2.0)  # bypasses the version counter: the one change the step cannot see
    with pytest.warns(RuntimeWarning, match=r"param '3\.weight'.*no longer matches"):
        opt.debug_step()


def test_debug_step_does_not_warn_on_a_clean_loop(recwarn):
    model, opt = build(True)
    for step in range(2):
        opt.zero_grad()
        loss_fn(model, step).backward()
        opt.debug_step()
    assert not [w for w in recwarn if "fold_grad_norm" in str(w.message)]


def test_fold_counts_are_zero_without_the_fold():
    model, opt = build(False)
    loss_fn(model, 0).backward()
    opt.step()
    assert opt.fold_counts == {"in_backward": 0, "before_step": 0}


def test_fold_grad_norm_must_be_a_bool():
    with pytest.raises((TypeError, ValueError), match="fold_grad_norm"):
        gs.OptimizerConfig(fold_grad_norm="yes")


class _Weights(torch.nn.Module):
    """Two params whose grads are whatever coefficients the loss multiplies them by."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(3 * ROW + 5))
        self.b = torch.nn.Parameter(torch.zeros(2 * ROW + 7))


def _folded_norm_of(coefficients: list[torch.Tensor]) -> float:
    model = _Weights()
    opt = gs.get_optimizer(gs.OptimizerConfig(optimizer="sgd", lr=0.0, clip_grad=0.0, capture="eager",
                                              kernel="fused", fold_grad_norm=True), model)
    sum((p * c).sum() for p, c in zip(model.parameters(), coefficients)).backward()
    norm = float(opt.step().grad_norm)
    assert opt.fold_counts == {"in_backward": backward_units(opt), "before_step": 0}
    return norm


def _coefficients(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3 * ROW + 5, generator=g), torch.randn(2 * ROW + 7, generator=g)]


@pytest.mark.parametrize("overflowing_rows", [1, RESCUE_ROWS])
def test_folded_rows_whose_squares_overflow_fp32_are_rescued(overflowing_rows):
    coefficients = _coefficients()
    for row in range(overflowing_rows):  # spread over both params' rows
        param, offset = (0, row * ROW + 3) if row < 3 else (1, (row - 3) * ROW + 1)
        coefficients[param][offset] = 3e19
    exact = math.sqrt(sum(float(c.double().square().sum()) for c in coefficients))
    assert _folded_norm_of(coefficients) == pytest.approx(exact, rel=1e-6)


def test_more_overflowing_folded_rows_than_rescued_count_as_non_finite():
    coefficients = _coefficients()
    for row in range(3):
        coefficients[0][row * ROW] = 3e19
    for row in range(RESCUE_ROWS + 1 - 3):
        coefficients[1][row * ROW] = 3e19
    assert not math.isfinite(_folded_norm_of(coefficients))


def test_units_end_where_a_param_ends_and_hold_at_least_unit_rows(monkeypatch):
    from graphstep.step import folded_sums

    monkeypatch.setattr(folded_sums, "UNIT_ROWS", 4)
    # Params ending inside rows 2, 5, 6, 11 and 13 of a 14-row buffer: a unit closes at the first param end
    # at least 4 rows on; the row a param ends inside belongs to the next unit; the last runs to the end.
    ends = [2 * ROW + 7, 5 * ROW + 1, 6 * ROW + 9, 11 * ROW, 13 * ROW + 5]
    assert folded_sums._unit_cuts(ends, 14) == [(0, 5), (5, 11), (11, 14)]
    assert folded_sums._unit_cuts([3 * ROW], 3) == [(0, 3)]  # shorter than a unit: one unit


def _weights(count: int, numel: int) -> torch.nn.Module:
    model = torch.nn.Module()
    model.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(numel)) for _ in range(count))
    return model


def _vector_norms(block) -> int:
    """The row-norm ops ``block`` dispatches: torch's vector norm, or graphstep's native one on the CPU
    (graphstep/kernels/row_norms.py)."""
    with DispatchedOps() as ops:
        block()
    return sum(name.startswith(("aten.linalg_vector_norm", "graphstep.row_norms_")) for name in ops.names)


@pytest.mark.parametrize("count, numel, in_backward", [(2000, ROW, 0), (6, 2**20 + 100, 6)],
                         ids=["many-small", "few-large"])
def test_the_fold_costs_one_op_per_unit_and_none_for_small_params(count, numel, in_backward):
    # Many 4,096-element params: no hook folds (each would cost backward more than the fold saves); the
    # step norms their rows in one op. Large params: one op per unit in backward. Bitwise the unfolded norm.
    g = torch.Generator().manual_seed(5)
    coefficients = [torch.randn(numel, generator=g) for _ in range(count)]
    norms = {}
    for fold in (True, False):
        model = _weights(count, numel)
        opt = gs.get_optimizer(gs.OptimizerConfig(optimizer="sgd", lr=0.0, clip_grad=0.0, capture="eager",
                                                  kernel="fused", fold_grad_norm=fold), model)
        loss = sum((p * c).sum() for p, c in zip(model.weights, coefficients))
        backward_norms = _vector_norms(loss.backward)
        norms[fold] = float(opt.step().grad_norm)
        if fold:
            assert backward_norms == in_backward
            assert opt.fold_counts == {"in_backward": in_backward, "before_step": 0}
            assert sum(bool(p._post_accumulate_grad_hooks) for p in model.weights) == (count if in_backward else 0)
    assert norms[True] == norms[False]


@pytest.mark.parametrize("backward", [True, False], ids=["backward", "grads-by-hand"])
def test_ops_per_step_do_not_grow_with_the_number_of_params(backward):
    ops = []
    for count in (150, 3000):
        model = _weights(count, 64)
        opt = gs.get_optimizer(gs.OptimizerConfig(lr=1e-3, clip_grad=1.0, capture="eager", kernel="fused"), model)
        for _ in range(2):
            if backward:
                sum(p.sum() for p in model.weights).backward()
            else:
                for p in model.weights:
                    p.grad = torch.ones_like(p)
            with DispatchedOps() as dispatched:
                opt.step()
            opt.zero_grad()
        ops.append(len(dispatched.names))
    assert ops[0] == ops[1]


@pytest.mark.parametrize("where", ["row", "tail"])
def test_a_folded_inf_or_nan_stays_non_finite(where):
    coefficients = _coefficients()
    coefficients[1][ROW + 2 if where == "row" else -1] = math.inf if where == "row" else math.nan
    assert not math.isfinite(_folded_norm_of(coefficients))


@pytest.mark.parametrize("changes", [dict(optimizer_cpu_offload=True, optimizer_offload_fraction=0.5),
                                     dict(optimizer_cpu_offload=True, optimizer_offload_fraction=0.5,
                                          overlap_cpu_optimizer_d2h_h2d=True)],
                         ids=["offload", "offload-overlapped"])
def test_cpu_offload_with_the_folded_norm_is_bitwise_the_folded_step(changes, monkeypatch):
    # The norm is over every grad on the device either way; offload only moves where the update runs.
    if changes.get("overlap_cpu_optimizer_d2h_h2d"):
        # As tests/test_offload.py does: a slow worker, so the next forward waits for its chunks instead of
        # running its matmuls alongside the host update (concurrent CPU ops may split their work, and so
        # round, differently from one run to the next).
        import time

        from graphstep.offload import Offload
        update_chunk = Offload.update_chunk
        monkeypatch.setattr(Offload, "update_chunk",
                            lambda self, chunk, rows: (time.sleep(0.01), update_chunk(self, chunk, rows)))
    offloaded = train(True, micro_batches=2, inf_at=(3, 1), **SGD, **changes)
    monkeypatch.undo()
    plain = train(True, micro_batches=2, inf_at=(3, 1), **SGD)
    assert same_floats(offloaded["norms"], plain["norms"]) and offloaded["ok"] == plain["ok"]
    assert all(torch.equal(a, b) for a, b in zip(offloaded["params"], plain["params"]))


@pytest.mark.small_fold_units
def test_muon_with_the_folded_norm_is_the_unfolded_step():
    changes = dict(optimizer="muon", lr=0.02, muon_momentum=0.9, muon_fp32_matmul_prec="highest")  # no bf16 NS
    folded, plain = train(True, micro_batches=2, **changes), train(False, micro_batches=2, **changes)
    assert folded["counts"]["in_backward"] > 0
    assert_same_as_unfolded(folded, plain)


@pytest.mark.small_fold_units
def test_fp8_weights_fold_their_main_grads_in_backward():
    from graphstep import fp8

    runs = {}
    for fold in (False, True):
        model = folded_model()
        fp8.convert(model, recipe="tensorwise", dtype=torch.float8_e4m3fn)
        opt = gs.get_optimizer(gs.OptimizerConfig(fp8_recipe="tensorwise", capture="eager", clip_grad=0.5,
                                                  kernel="fused", fold_grad_norm=fold, **SGD), model)
        norms = []
        for step in range(4):
            opt.zero_grad()
            loss_fn(model, step).backward()
            norms.append(float(opt.step().grad_norm))
        runs[fold] = (norms, opt.fold_counts)
    assert sum(fp8.is_fp8(p) for p in model.parameters()) > 0
    assert same_floats(runs[True][0], runs[False][0])
    assert runs[True][1]["in_backward"] > 0 and runs[True][1]["before_step"] == 0

