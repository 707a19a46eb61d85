"""graphstep under Lightning's ``Trainer``, against the same LightningModule trained with torch's
``AdamW(fused=True)`` under the same precision plugin: "32-true", "bf16-mixed" and "16-mixed" (torch's
GradScaler stepping the engine through ``_step_supports_amp_scaling``, graphstep/step/torch_amp.py), checkpoint
resume, gradient accumulation and both clipping owners.

16-mixed on the CPU: ``Trainer(accelerator="cpu", precision="16-mixed")`` does not run fp16 — Lightning
warns and swaps in bf16-mixed. The tests pass Lightning's own ``MixedPrecision("16-mixed", "cpu")`` plugin
instead: the plugin Lightning builds for "16-mixed" on CUDA (fp16 autocast, torch's GradScaler), with the
CPU as its device. The scaler's growth interval is short, and one step's loss is made non-finite, so the
scale grows, backs off and skips a step within the run.
"""

import functools
import warnings

import pytest
import torch

L = pytest.importorskip("lightning", reason="needs lightning (the optional lightning extra)")
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

import graphstep as gs  # noqa: E402
from toy import decay_groups, relative_drift  # noqa: E402

LR, WD, BETAS, EPS = 1e-2, 0.1, (0.9, 0.95), 1e-8
BATCHES = 6  # one epoch; the runs go over it twice
STEPS = 2 * BATCHES
INF_STEP = 4  # under 16-mixed this step's loss is inf: both runs skip it and back off the scale
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")


def make_data(batches=BATCHES):
    g = torch.Generator().manual_seed(123)
    return [(torch.randn(16, 64, generator=g), torch.randn(16, 64, generator=g)) for _ in range(batches)]


class ToyModule(L.LightningModule):
    """An MLP whose weights (8,192 elements) are large enough for graphstep's folded norm to fold them in
    backward, so an in-place change to their grads after backward must be seen by the engine."""

    def __init__(self, make_optimizer, clip=None):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.LayerNorm(128),
                                       torch.nn.Linear(128, 64))
        self.make_optimizer = make_optimizer
        self.clip = clip  # the user clipping by hand (clip(module, optimizer)), in place of Lightning's

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        loss = torch.nn.functional.mse_loss(self.net(inputs).float(), targets)
        if self.trainer.precision == "16-mixed" and self.trainer.global_step == INF_STEP:
            loss = loss * float("inf")
        return loss

    def configure_optimizers(self):
        return self.make_optimizer(self)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        if self.clip is None:
            return super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        self.clip(self, optimizer)


def torch_adamw(module):
    return torch.optim.AdamW(decay_groups(module, WD), lr=LR, betas=BETAS, eps=EPS, fused=True)


def graphstep_adamw(clip_grad=0.0, capture="graph"):
    def build(module):
        # Standard overrides (no decay on biases and 1-D params): the groups decay_groups gives torch.
        config = gs.OptimizerConfig(lr=LR, weight_decay=WD, adam_beta1=BETAS[0], adam_beta2=BETAS[1],
                                    adam_eps=EPS, clip_grad=clip_grad, kernel="fused", capture=capture)
        return gs.get_optimizer(config, module)

    return build


def precision_args(precision):
    if precision != "16-mixed":
        return {"precision": precision}
    # Lightning's 16-mixed plugin on the CPU (see the module docstring), with a scale that moves in the run.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=3)
    return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=scaler)]}


class ResumableBatches:
    """The batches in order, resumable mid-epoch: Lightning saves a loader's ``state_dict`` in its checkpoint
    and hands it back on resume (a plain DataLoader restarts the epoch, and the resumed run goes apart from
    the uninterrupted one under torch's AdamW as well)."""

    def __init__(self, batches):
        self.batches, self.start, self.served = batches, 0, 0

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        start, self.start = self.start, 0
        for i in range(start, len(self.batches)):
            self.served = i + 1
            yield self.batches[i]

    def state_dict(self):
        return {"served": self.served}

    def load_state_dict(self, state):
        self.start = state["served"]


def fit(make_optimizer, precision, steps=STEPS, clip=None, ckpt_path=None, callbacks=(), resumable=False,
        batches=BATCHES, **trainer_args):
    """Train a fresh ToyModule; returns it (trained) and its params at the start."""
    module = ToyModule(make_optimizer, clip)
    start = [p.detach().clone() for p in module.parameters()]
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, max_steps=steps, callbacks=list(callbacks),
                        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
                        **precision_args(precision), **trainer_args)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        data = make_data(batches)
        loader = ResumableBatches(data) if resumable else torch.utils.data.DataLoader(data, batch_size=None)
        trainer.fit(module, loader, ckpt_path=ckpt_path)
    return module, start


def params(module):
    return [p.detach().clone() for p in module.parameters()]


def assert_params_equal(a, b):
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(x, y), name


def assert_states_equal(a, b, where="state"):
    """Bitwise equality of two (nested) state dicts."""
    assert type(a) is type(b), where
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_states_equal(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_states_equal(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, where


def scaler_of(module):
    return getattr(module.trainer.precision_plugin, "scaler", None)


# ---- the update ----------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def torch_reference(precision, clip="none", **trainer_args):
    """torch's fused AdamW under Lightning, trained once per setting for the whole module (not mutated)."""
    clips = {"none": None, "recipe": torch_clip(CLIP), **{("recipe", v): torch_clip(CLIP, v) for v in CLIP_VARIANTS}}
    return fit(torch_adamw, precision, clip=clips[clip], **trainer_args)


@pytest.mark.parametrize("precision, capture", [(p, "graph") for p in PRECISIONS] + [("16-mixed", "eager")])
def test_graphstep_is_torch_fused_adamw_bitwise(precision, capture):
    # Unclipped, the same grads go through the same fused AdamW arithmetic: nothing may differ.
    reference, start = torch_reference(precision)
    module, _ = fit(graphstep_adamw(capture=capture), precision)
    assert module.trainer.optimizers[0].captured == (capture == "graph")  # the replayed step, CPU backend
    assert relative_drift(params(reference), start, [torch.zeros_like(p) for p in start]) > 0.1  # it trained
    assert_params_equal(module, reference)
    if precision == "16-mixed":  # the same skipped step and the same scale after it
        assert scaler_of(module).get_scale() == scaler_of(reference).get_scale()
        assert scaler_of(module).state_dict() == scaler_of(reference).state_dict()


REFOLD_WARNING = "fold_grad_norm: backward ran more than once outside opt.no_sync"


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.small_fold_units
def test_gradient_accumulation_is_torch_fused_adamw_bitwise(precision):
    # Lightning divides each micro-batch's loss by 2 and steps every second batch; the grads accumulate in
    # place in graphstep's grad buffer as in torch's .grad: bitwise equal. Lightning's plugins cannot tell
    # graphstep which backward is an earlier micro-batch: it warns and folds its norm before the step.
    reference, _ = torch_reference(precision, accumulate_grad_batches=2)
    with pytest.warns(RuntimeWarning, match=REFOLD_WARNING):
        module, _ = fit(graphstep_adamw(), precision, accumulate_grad_batches=2)
    assert reference.trainer.global_step == STEPS  # optimizer steps: 2 * STEPS batches went through
    assert_params_equal(module, reference)
    assert module.trainer.optimizers[0].fold_counts["before_step"] > 0


@pytest.mark.parametrize("batches", [BATCHES, BATCHES - 1], ids=["even-epoch", "odd-epoch"])
@pytest.mark.small_fold_units
def test_graphstep_accumulation_callback_folds_in_the_last_backward_only(batches):
    # GraphstepAccumulation runs the earlier micro-batches' backward under opt.no_sync(): no warning, every
    # fold in the last backward, none before a step after the first (a wrong guess of Lightning's rule leaves
    # a step's last backward under no_sync, and that step folds before it), the same params. The first step
    # folds again before it: its backward folded before the GradScaler's scale was known to the norm's prescale. An odd epoch ends on
    # a lone micro-batch that Lightning steps after. The callback acts on backward alone, whatever the
    # precision; 16-mixed (scaled grads, a skipped step) is the one that could go wrong.
    precision = "16-mixed"
    from graphstep.app.lightning import GraphstepAccumulation

    reference, _ = fit(torch_adamw, precision, accumulate_grad_batches=2, batches=batches)
    after_first_step = {}

    class FoldsAfterTheFirstStep(Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 1 and not after_first_step:
                after_first_step.update(trainer.optimizers[0].fold_counts)

    with warnings.catch_warnings():
        warnings.filterwarnings("error", REFOLD_WARNING)
        module, _ = fit(graphstep_adamw(), precision, accumulate_grad_batches=2, batches=batches,
                        callbacks=[GraphstepAccumulation(), FoldsAfterTheFirstStep()])
    assert_params_equal(module, reference)
    folds = module.trainer.optimizers[0].fold_counts
    assert folds["before_step"] == after_first_step["before_step"] and folds["in_backward"] > 0, folds


# ---- checkpoint resume -----------------------------------------------------------------------------------

@pytest.mark.parametrize("midway", [BATCHES, BATCHES // 2], ids=["epoch-end", "mid-epoch"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_resume_from_lightning_checkpoint_is_bitwise(precision, midway, tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=midway, save_top_k=-1,
                                 filename="{step}")
    whole, _ = fit(graphstep_adamw(), precision, callbacks=[checkpoint], resumable=True)
    resumed, _ = fit(graphstep_adamw(), precision, ckpt_path=tmp_path / f"step={midway}.ckpt", resumable=True)
    assert resumed.trainer.global_step == STEPS
    assert_params_equal(resumed, whole)
    assert_states_equal(resumed.trainer.optimizers[0].state_dict(), whole.trainer.optimizers[0].state_dict())
    if precision == "16-mixed":  # the GradScaler's state travels in Lightning's checkpoint too
        assert_states_equal(scaler_of(resumed).state_dict(), scaler_of(whole).state_dict())


# ---- clipping: who owns it -------------------------------------------------------------------------------

CLIP = 0.3  # the grad norm runs 0.56..1.06 over the run: every step is clipped
# The calibration of legitimately different clipping arithmetic (torch_clip's variants): under bf16 autocast one
# float32 step of the coefficient may or may not flip a bf16 rounding downstream, so the drift one variant shows
# ranges from 1e-7 to 2e-3 with the CPU's vector width; the largest of several is what such a change can do.
CLIP_VARIANTS = ("as-graphstep", 1, -1, 2, -2)


def torch_clip(max_norm, variant=None):
    """torch's AMP clipping recipe, run in the LightningModule's ``configure_gradient_clipping``: unscale
    (where there is a GradScaler), then clip the grads in place. ``variant``: the recipe changed in a way
    no less legitimate than graphstep's own arithmetic, to calibrate how far such a change alone moves
    training: "as-graphstep" sums the norm in fp64 and divides the grads by the coefficient's fp32
    reciprocal (graphstep folds the clip into the grad scale its fused update divides by); an int k moves
    torch's coefficient k float32 steps."""

    def clip(module, optimizer):
        scaler = scaler_of(module)
        if scaler is not None:
            scaler.unscale_(optimizer)
        grads = [p.grad for p in module.parameters()]
        if variant is None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm)
        elif variant == "as-graphstep":
            norm = torch.stack([g.double().square().sum() for g in grads]).sum().sqrt().float()
            torch._foreach_div_(grads, torch.reciprocal((max_norm / (norm + 1e-6)).clamp(max=1.0)))
        else:
            norm = torch.nn.utils.get_total_norm(grads)
            coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            for _ in range(abs(variant)):
                coef = torch.nextafter(coef, torch.tensor(2.0 if variant > 0 else 0.0))
            torch._foreach_mul_(grads, coef)

    return clip


def test_lightning_clipping_under_32_true_is_torch_bitwise_and_the_engine_sees_the_clipped_grads():
    # Lightning's gradient_clip_val runs torch's clip_grad_norm_ on the grads before the step: graphstep
    # (clip_grad=0) steps on exactly the grads torch's fused AdamW steps on. The folded norm was computed in
    # backward, before the clip: the step must see the in-place clip through the grads' version counters
    # and report the norm of the clipped grads, not the ~2x larger norm backward left.
    reference, _ = torch_reference("32-true", gradient_clip_val=CLIP)
    module, _ = fit(graphstep_adamw(), "32-true", gradient_clip_val=CLIP)
    assert_params_equal(module, reference)
    opt = module.trainer.optimizers[0]
    clipped_norm = torch.nn.utils.get_total_norm([p.grad for p in module.parameters()])  # the last step's grads
    assert clipped_norm < CLIP * (1 + 1e-5)
    torch.testing.assert_close(opt.result.grad_norm, clipped_norm, rtol=1e-6, atol=0)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_lightning_refuses_its_own_clipping_under_mixed_precision(precision):
    # Lightning's MixedPrecision plugin refuses gradient_clip_val for every optimizer that unscales in its
    # step (_step_supports_amp_scaling: torch's fused AdamW and graphstep), under bf16-mixed as well, where
    # there is no scaler. The clipping owner there is graphstep's clip_grad.
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping because it performs unscaling"):
        fit(graphstep_adamw(), precision, steps=1, gradient_clip_val=CLIP)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_graphsteps_clip_grad_tracks_torchs_unscale_and_clip_grad_norm(precision):
    # graphstep: clip_grad inside the step (the unscale and the clip coefficient folded into the fused
    # update's grad scale, the norm summed in fp64). torch: unscale_ + clip_grad_norm_ + fused AdamW. The
    # arithmetic differs legitimately (another norm summation, a division instead of a multiply); the bound is
    # 10x the largest drift torch's recipe shows against itself under such changes (CLIP_VARIANTS; measured
    # with ATEN_CPU_CAPABILITY default / avx2 / avx512: 2.8e-7 / 2.7e-7 / 2.7e-7 under 32-true, 1.9e-4 /
    # 2.3e-3 / 2.3e-3 under bf16-mixed, 2.8e-4 / 2.3e-4 / 2.3e-4 under 16-mixed; graphstep: 2.9e-7 / 2.7e-7 /
    # 2.7e-7, 1.9e-4 / 1.5e-7 / 1.5e-7, 1.5e-4 / 2.3e-4 / 2.3e-4). Clipping the scaled norm (a bug fixed
    # earlier) drifted 0.23.
    reference, start = torch_reference(precision, clip="recipe")
    calibrated = max(relative_drift(params(torch_reference(precision, clip=("recipe", v))[0]), params(reference),
                                    start) for v in CLIP_VARIANTS)
    module, _ = fit(graphstep_adamw(clip_grad=CLIP), precision)
    assert 0 < calibrated < 1e-2
    assert relative_drift(params(module), params(reference), start) < 10 * calibrated


def test_an_engine_with_its_own_loss_scale_refuses_lightnings_gradscaler():
    # 16-mixed scales the loss with torch's GradScaler; a static loss_scale in the engine would unscale the
    # grads a second time. The step refuses before anything changes, saying which scaler to drop.
    def own_scale(module):
        return gs.get_optimizer(gs.OptimizerConfig(lr=LR, loss_scale=1024.0, kernel="fused", capture="eager"),
                                module)

    with pytest.raises(RuntimeError, match="GradScaler is stepping an optimizer that scales the loss itself"):
        fit(own_scale, "16-mixed", steps=1)
