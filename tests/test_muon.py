"""Muon kernels against a per-matrix reference written here from the notes (EO 0.3.0's rule), and
torch.optim.Muon as a loose second oracle; skip, live hyperparameters, capture safety, op counts."""

import math

import pytest
import torch
import torch.nn.functional as F
from capture.profile import OpCounter

import capture
from graphstep.kernels import muon as muon_kernels
from graphstep.kernels.muon import QKVSplit, muon, orthogonalize, orthogonalize_qkv, scale_factor
from graphstep.kernels.newton_schulz import COEFFICIENT_SETS, coefficient_schedule, newton_schulz

# EO 0.3.0's constants, pinned here independently of the implementation (notes §1).
QUINTIC = [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
           (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)]
SIMPLE = [(3.4445, -4.7750, 2.0315)]
EPS = 1e-7

SHAPES = {"wide": (32, 64), "tall": (64, 32), "square": (48, 48)}
BATCH = 3  # matrices per shape


# ---------------------------------------------------------------- the reference (one matrix at a time)

def reference_schedule(coefficient_type, steps):
    table = {"quintic": QUINTIC, "simple": SIMPLE}[coefficient_type]
    return [table[i % len(table)] for i in range(steps)]


def reference_newton_schulz(u, *, steps, coefficient_type, precision):
    transpose = u.size(0) > u.size(1)
    x = u.mT if transpose else u
    X = F.normalize(x, p=2, dim=(-2, -1), eps=EPS)
    if precision == "medium":
        X = X.to(torch.bfloat16)
    for a, b, c in reference_schedule(coefficient_type, steps):
        A = X @ X.mT
        B = torch.addmm(A, A, A, alpha=c, beta=b)
        X = torch.addmm(X, B, X, alpha=1.0, beta=a)
    X = X.to(torch.float32)
    return X.mT if transpose else X


def reference_scale(rows, cols, mode):
    return {"spectral": max(rows, cols) ** 0.5, "shape_scaling": max(1, rows / cols) ** 0.5,
            "unit_rms_norm": (rows / cols) ** 0.5}[mode]


def reference_muon_step(p, g, m, *, lr, wd, mu, nesterov, decoupled, grad_scale, steps=5,
                        coefficient_type="quintic", scale_mode="spectral", extra=1.0, precision="highest"):
    """EO's OrthogonalizedOptimizer.step + Muon.scaled_orthogonalize_fn for one 2-D param, Python floats."""
    g = g / grad_scale
    if decoupled:
        p.add_(p, alpha=-(wd * lr))
    else:
        g = g + wd * p
    m.lerp_(g, 1 - mu)
    u = g.lerp(m, mu) if nesterov else m
    orth = reference_newton_schulz(u, steps=steps, coefficient_type=coefficient_type, precision=precision)
    orth = orth * reference_scale(p.size(0), p.size(1), scale_mode) * extra
    p.add_(orth, alpha=-lr)


# ---------------------------------------------------------------- helpers

def hp(value):
    # fp64 on the CPU, as graphstep's hyperparameter tensors are there.
    return torch.tensor(value, dtype=torch.float64)


def make_problem(seed, shapes=SHAPES.values(), batch=BATCH):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(batch, *shape, generator=gen) for shape in shapes]
    return params, [torch.zeros_like(p) for p in params], gen


def grads_like(params, gen):
    return [torch.randn(p.shape, generator=gen) for p in params]


def run_graphstep(params, bufs, grads, *, lr, wd, mu, found_inf=0.0, **options):
    opts = dict(nesterov=False, decoupled=True, ns_steps=5, coefficient_type="quintic", scale_mode="spectral",
                extra_scale_factor=1.0, fp32_matmul_prec="highest", grad_scale=torch.tensor(2.0))
    opts.update(options)
    muon(params, grads, bufs, lr=hp(lr), weight_decay=hp(wd), momentum=hp(mu), found_inf=torch.tensor(found_inf),
         **opts)


def run_reference(params, bufs, grads, *, lr, wd, mu, nesterov=False, decoupled=True, ns_steps=5,
                  coefficient_type="quintic", scale_mode="spectral", extra_scale_factor=1.0,
                  fp32_matmul_prec="highest"):
    for p3, m3, g3 in zip(params, bufs, grads):
        for i in range(p3.size(0)):
            reference_muon_step(p3[i], g3[i], m3[i], lr=lr, wd=wd, mu=mu, nesterov=nesterov, decoupled=decoupled,
                                grad_scale=2.0, steps=ns_steps, coefficient_type=coefficient_type,
                                scale_mode=scale_mode, extra=extra_scale_factor, precision=fp32_matmul_prec)


def drift(a, b, start):
    """‖a − b‖ / ‖b − start‖ over lists of tensors: error relative to how far the params moved."""
    num = sum(((x - y) ** 2).sum() for x, y in zip(a, b)).sqrt()
    den = sum(((y - s) ** 2).sum() for y, s in zip(b, start)).sqrt()
    return (num / den).item()


def schedule(step):
    return dict(lr=0.02 * (1 - step / 40), wd=0.1 + 0.01 * step, mu=0.95 - 0.005 * step)


# ---------------------------------------------------------------- parity with the reference

@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("decoupled", [True, False])
def test_matches_reference_bitwise_fp32_over_20_steps(nesterov, decoupled):
    params, bufs, gen = make_problem(0)
    ref_params, ref_bufs = [p.clone() for p in params], [b.clone() for b in bufs]
    for step in range(20):
        grads = grads_like(params, gen)
        run_graphstep(params, bufs, grads, nesterov=nesterov, decoupled=decoupled, **schedule(step))
        run_reference(ref_params, ref_bufs, grads, nesterov=nesterov, decoupled=decoupled, **schedule(step))
    for got, want in zip(params + bufs, ref_params + ref_bufs):
        assert torch.equal(got, want)


def test_medium_precision_matches_reference_and_states_bf16_drift():
    # The bf16 path runs the same ops in the same order (bmm/baddbmm round like mm/addmm on this CPU),
    # so it matches the reference bitwise too; its distance from the fp32 path is the bf16 rounding.
    params, bufs, gen = make_problem(1)
    start = [p.clone() for p in params]
    ref_params, ref_bufs = [p.clone() for p in params], [b.clone() for b in bufs]
    fp32_params, fp32_bufs = [p.clone() for p in params], [b.clone() for b in bufs]
    for step in range(20):
        grads = grads_like(params, gen)
        run_graphstep(params, bufs, grads, fp32_matmul_prec="medium", **schedule(step))
        run_reference(ref_params, ref_bufs, grads, fp32_matmul_prec="medium", **schedule(step))
        run_graphstep(fp32_params, fp32_bufs, grads, fp32_matmul_prec="highest", **schedule(step))
    assert drift(params, ref_params, start) == 0.0
    bf16_drift = drift(params, fp32_params, start)
    # Measured 2.3e-3 of the motion after 20 steps on these shapes (bf16 NS versus fp32 NS).
    assert 1e-4 < bf16_drift < 1e-2


@pytest.mark.parametrize("scale_mode", ["spectral", "shape_scaling", "unit_rms_norm"])
@pytest.mark.parametrize("coefficient_type,ns_steps", [("quintic", 5), ("quintic", 10), ("simple", 3)])
def test_scale_modes_and_coefficient_sets_match_reference(scale_mode, coefficient_type, ns_steps):
    params, bufs, gen = make_problem(2)
    ref_params, ref_bufs = [p.clone() for p in params], [b.clone() for b in bufs]
    options = dict(scale_mode=scale_mode, coefficient_type=coefficient_type, ns_steps=ns_steps, extra_scale_factor=0.2)
    for step in range(3):
        grads = grads_like(params, gen)
        run_graphstep(params, bufs, grads, **options, **schedule(step))
        run_reference(ref_params, ref_bufs, grads, **options, **schedule(step))
    for got, want in zip(params, ref_params):
        assert torch.equal(got, want)


def test_scale_factors_follow_the_three_formulas():
    for rows, cols in [(32, 64), (64, 32), (48, 48)]:
        assert scale_factor(rows, cols, "spectral") == math.sqrt(max(rows, cols))
        assert scale_factor(rows, cols, "shape_scaling") == math.sqrt(max(1.0, rows / cols))
        assert scale_factor(rows, cols, "unit_rms_norm") == math.sqrt(rows / cols)
    with pytest.raises(ValueError, match="scale_mode"):
        scale_factor(4, 4, "rms")


def test_each_quintic_tuple_is_used_in_order():
    # NS written out by hand with the pinned tuples (plain matmuls, no baddbmm): catches a wrong,
    # reordered or skipped tuple, which a comparison with a reference sharing the table could hide.
    assert coefficient_schedule("quintic", 10) == tuple(QUINTIC * 2)
    x = torch.randn(2, 16, 24, generator=torch.Generator().manual_seed(3))

    def by_hand(tuples):
        X = x / x.norm(dim=(-2, -1), keepdim=True).clamp_min(EPS)
        for a, b, c in tuples:
            A = X @ X.mT
            X = a * X + (b * A + c * A @ A) @ X
        return X

    got = newton_schulz(x, num_steps=5, coefficient_type="quintic", fp32_matmul_prec="highest")
    torch.testing.assert_close(got, by_hand(QUINTIC), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(got, by_hand(QUINTIC[::-1]), atol=1e-3)


def test_polar_express_coefficients_are_the_papers_with_its_safety_factor():
    # Amsel et al. 2025 (arXiv:2505.16932), Algorithm 1: raw minimax coefficients, the first seven
    # divided by (1.01, 1.01^3, 1.01^5); EO lists them to 4 decimals (8.20516 as 8.2051: within 1e-4).
    raw = [(8.28721201814563, -23.595886519098837, 17.300387312530933),
           (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
           (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
           (3.3184196573706015, -2.488488024314874, 0.51004894012372),
           (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
           (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
           (1.8750014808534479, -1.2500016453999487, 0.3750001645474248)]
    expected = [(a / 1.01, b / 1.01 ** 3, c / 1.01 ** 5) for a, b, c in raw] + [(1.875, -1.25, 0.375)]
    table = COEFFICIENT_SETS["polar_express"]
    assert len(table) == 8
    for got, want in zip(table, expected):
        assert all(abs(g - w) <= 1e-4 for g, w in zip(got, want)), (got, want)
    assert coefficient_schedule("polar_express", 10)[8:] == (table[-1], table[-1])
    with pytest.raises(ValueError, match="at least 8"):
        coefficient_schedule("polar_express", 5)
    with pytest.raises(ValueError, match="multiple of 5"):
        coefficient_schedule("quintic", 4)


def test_polar_express_orthogonalises():
    x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(4))
    singular = torch.linalg.svdvals(newton_schulz(x, num_steps=8, coefficient_type="polar_express",
                                                  fp32_matmul_prec="highest"))
    assert (singular - 1).abs().max() < 0.05


def test_against_torch_optim_muon_loosely():
    # torch.optim.Muon: simple coefficients, sqrt(max(1, A/B)) ("original" = shape_scaling), decoupled
    # wd as p *= 1 - lr*wd, and the bf16 cast *before* normalising: a loose oracle only.
    params, bufs, gen = make_problem(5, batch=1)
    start = [p.clone() for p in params]
    torch_params = [torch.nn.Parameter(p[0].clone()) for p in params]
    opt = torch.optim.Muon(torch_params, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True,
                           ns_steps=5, eps=EPS, adjust_lr_fn="original")
    for _ in range(20):
        grads = grads_like(params, gen)
        run_graphstep(params, bufs, grads, lr=0.02, wd=0.1, mu=0.95, nesterov=True, coefficient_type="simple",
                      scale_mode="shape_scaling", fp32_matmul_prec="medium", grad_scale=None)
        for tp, g in zip(torch_params, grads):
            tp.grad = g[0].clone()
        opt.step()
    relative = drift(params, [tp.detach().unsqueeze(0) for tp in torch_params], start)
    # Measured 9.3e-3 of the motion after 4 steps, 4.1e-3 after 20 (the notes: ~1e-2 after 4 against EO).
    assert relative < 2e-2


# ---------------------------------------------------------------- split QKV

def test_split_qkv_orthogonalises_gathered_q_k_v_by_hand():
    groups, heads_per_group, kv_channels, cols = 2, 3, 4, 40
    split = QKVSplit(groups, heads_per_group * kv_channels, kv_channels, kv_channels)
    rows = groups * split.rows_per_group
    update = torch.randn(2, rows, cols, generator=torch.Generator().manual_seed(6))
    options = dict(ns_steps=5, coefficient_type="quintic", scale_mode="spectral", extra_scale_factor=1.0,
                   fp32_matmul_prec="highest")
    got = orthogonalize_qkv(update, split, **options)
    for i in range(update.size(0)):
        grouped = update[i].view(groups, split.rows_per_group, cols)
        q = grouped[:, :12].reshape(-1, cols)        # (groups·q_rows, cols)
        k = grouped[:, 12:16].reshape(-1, cols)
        v = grouped[:, 16:].reshape(-1, cols)
        parts = []
        for part in (q, k, v):
            orth = reference_newton_schulz(part, steps=5, coefficient_type="quintic", precision="highest")
            parts.append((orth * reference_scale(*part.shape, "spectral")).view(groups, -1, cols))
        want = torch.cat(parts, dim=1).view(rows, cols)
        assert torch.equal(got[i], want)
        # Not the same as orthogonalising the fused matrix whole.
        assert not torch.allclose(got[i], orthogonalize(update[i:i + 1], **options)[0], atol=1e-2)


def test_split_qkv_inside_the_step_and_a_wrong_group_count_is_refused():
    split = QKVSplit(2, 8, 4, 4)
    params, bufs, gen = make_problem(7, shapes=[(32, 24)], batch=2)
    ref = params[0].clone()
    grads = grads_like(params, gen)
    run_graphstep(params, bufs, grads, lr=0.02, wd=0.0, mu=0.9, qkv_splits=[split])
    orth = orthogonalize_qkv(grads[0] / 2.0 * 0.1, split, ns_steps=5, coefficient_type="quintic",
                             scale_mode="spectral", extra_scale_factor=1.0, fp32_matmul_prec="highest")
    torch.testing.assert_close(params[0], ref - 0.02 * orth, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="groups"):
        run_graphstep(params, bufs, grads, lr=0.02, wd=0.0, mu=0.9, qkv_splits=[QKVSplit(3, 8, 4, 4)])


# ---------------------------------------------------------------- skip, live hyperparameters, capture

def test_found_inf_skips_bitwise():
    params, bufs, gen = make_problem(8)
    run_graphstep(params, bufs, grads_like(params, gen), **schedule(0))  # non-zero momentum
    before = [t.clone() for t in params + bufs]
    grads = grads_like(params, gen)
    grads[1][0, 3, 5] = float("inf")
    run_graphstep(params, bufs, grads, found_inf=1.0, **schedule(1))
    for got, want in zip(params + bufs, before):
        assert torch.equal(got, want)


def _captured_step(params, bufs, grads, hparams, found_inf, fp32_matmul_prec="highest", qkv_splits=None):
    def step():
        muon(params, grads, bufs, lr=hparams["lr"], weight_decay=hparams["wd"], momentum=hparams["mu"],
             nesterov=True, decoupled=True, grad_scale=None, found_inf=found_inf, ns_steps=5,
             coefficient_type="quintic", scale_mode="spectral", extra_scale_factor=1.0,
             fp32_matmul_prec=fp32_matmul_prec, qkv_splits=qkv_splits)
    return step


def test_live_hyperparameters_replay_bitwise_with_eager_without_recapture():
    params, bufs, gen = make_problem(9)
    eager_params, eager_bufs = [p.clone() for p in params], [b.clone() for b in bufs]
    grads = [torch.zeros_like(p) for p in params]
    hparams = {"lr": hp(0.0), "wd": hp(0.0), "mu": hp(0.0)}
    found_inf = torch.zeros(())
    graph = capture.graph(_captured_step(params, bufs, grads, hparams, found_inf), warmup=1, backend="replay")
    for step in range(12):
        new_grads = grads_like(params, gen)
        for g, new in zip(grads, new_grads):
            g.copy_(new)
        s = schedule(step)
        for key in ("lr", "wd", "mu"):
            hparams[key].fill_(s[key])
        found_inf.fill_(1.0 if step == 7 else 0.0)
        graph()
        if step != 7:
            run_graphstep(eager_params, eager_bufs, new_grads, nesterov=True, grad_scale=None, **s)
    assert graph.num_replays == 10  # one warm-up, one capture, then only replays
    for got, want in zip(params + bufs, eager_params + eager_bufs):
        assert torch.equal(got, want)


def test_changing_the_lr_tensor_changes_the_replayed_result():
    results = []
    for lr in (0.01, 0.03):
        params, bufs, gen = make_problem(10)
        grads = grads_like(params, gen)
        hparams = {"lr": hp(0.01), "wd": hp(0.1), "mu": hp(0.9)}
        graph = capture.graph(_captured_step(params, bufs, grads, hparams, torch.zeros(())), warmup=1,
                              backend="replay")
        graph()  # warm-up, eager
        graph()  # capture (recording runs the step)
        hparams["lr"].fill_(lr)
        graph()  # replay with the new value
        results.append(params[0].clone())
    assert not torch.equal(results[0], results[1])


@pytest.mark.parametrize("precision", ["medium", "highest"])
def test_no_host_sync_or_unsafe_op(precision):
    params, bufs, gen = make_problem(11)
    grads = grads_like(params, gen)
    hparams = {"lr": hp(0.02), "wd": hp(0.1), "mu": hp(0.9)}
    # The wide (32, 64) entry as a fused QKV weight: 2 groups of 8 query + 4 key + 4 value rows.
    splits = [QKVSplit(2, 8, 4, 4), None, None]
    assert capture.check(_captured_step(params, bufs, grads, hparams, torch.zeros(()),
                                        fp32_matmul_prec=precision, qkv_splits=splits)) == []


def count_ops(batch, rows, cols):
    params, bufs, gen = make_problem(12, shapes=[(rows, cols)], batch=batch)
    grads = grads_like(params, gen)
    with OpCounter() as counter:
        run_graphstep(params, bufs, grads, lr=0.02, wd=0.1, mu=0.95, nesterov=True)
    return counter.count


def test_op_count_depends_on_shapes_not_matrices():
    # 8 matrices of 64x128 and 64 of 32x32 hold the same number of params.
    assert count_ops(8, 64, 128) == count_ops(64, 32, 32) == count_ops(1, 32, 32)


def test_bad_inputs_are_refused():
    params, bufs, gen = make_problem(13)
    with pytest.raises(ValueError, match="one entry of each"):
        run_graphstep(params, bufs[:1], grads_like(params, gen), lr=0.1, wd=0.0, mu=0.9)
    with pytest.raises(ValueError, match=r"\(n, rows, cols\)"):
        run_graphstep([p[0] for p in params], [b[0] for b in bufs], [p[0] for p in params], lr=0.1, wd=0.0, mu=0.9)
    with pytest.raises(TypeError, match="float32"):
        newton_schulz(torch.zeros(1, 2, 2, dtype=torch.float64), num_steps=5)
    assert muon_kernels.LIVE_FIELDS == {"lr", "weight_decay", "momentum"}


def test_the_matmul_precision_block_leaves_every_precision_flag_as_it_found_it():
    # torch's legacy setter also writes the per-backend fp32_precision flags ("none" -> "ieee" on the way back
    # to "highest"); a later torch.compile reads them (an odd-length compiled Adam update then came out wrong:
    # tests/test_kernels.py after this file), so the block must put them back as they were.
    from graphstep.kernels import newton_schulz
    backends = [m for m in (torch.backends.cuda.matmul, torch.backends.mkldnn.matmul) if hasattr(m, "fp32_precision")]
    assert backends
    saved = [(b, b.fp32_precision) for b in backends]
    try:
        for backend in backends:
            backend.fp32_precision = "none"
        before = (torch.get_float32_matmul_precision(), [b.fp32_precision for b in backends])
        with newton_schulz.matmul_precision("medium"):
            pass
        assert (torch.get_float32_matmul_precision(), [b.fp32_precision for b in backends]) == before
    finally:
        for backend, flag in saved:
            backend.fp32_precision = flag
