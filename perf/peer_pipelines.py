"""The pipelines perf/bench_peers.py times: graphstep's default step and the optimizer steps users write when
they compile instead of capture, each as a ``bench_core.Pipeline`` over the same ``bench_core.Inputs``.

Every row runs AdamW with the same hyperparameters (``bench_core``: lr 3e-4, betas (0.9, 0.95), eps 1e-8, weight
decay 0.1 on matrices and none on biases and 1-D params: two param groups) and, where it clips, a global-norm
clip at 1.0, over fp32 params whose grads are restored, untimed, before every step.

- ``graphstep``: ``gs.get_optimizer`` with the default config (clip 1.0, the norm folded into backward, kernel
  "auto", capture "auto"). The grads are copied in, with no backward, so the step reads them for the norm itself;
- ``torch-fused-clip``: ``clip_grad_norm_(foreach=True)`` + ``AdamW(fused=True)``;
- ``torch-compiled-clip`` / ``torch-compiled``: torch's compiled-optimizer recipe (the lr of every group a
  tensor, so a schedule never recompiles; ``torch.compile`` around a function that calls ``opt.step()``),
  with ``clip_grad_norm_`` inside the compiled function and without it;
- ``heavyball-clip`` / ``heavyball``: heavyball's ``AdamW`` (its own compiled kernels, its default compile
  mode) with ``gradient_clipping=global_l2norm_clip`` and without. heavyball clips each param group by that
  group's norm, not by one norm over all groups; and it sets every ``.grad`` to None after its step, so its
  refill binds them again;
- ``floor``: ``torch._fused_adamw_`` once over one flat buffer of the same bytes (``bench_core.build_fused_floor``).

The torch and heavyball rows bind their ``.grad`` to views of one shared grad buffer (each row's refill
restores it before that row's step): at GPT-2 small this saves 0.5 GB per row.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's graphstep, not an installed one
from graphstep.app import bench_core as core  # noqa: E402

CLIPPED = {"graphstep": True, "torch-fused-clip": True, "torch-compiled-clip": True, "torch-compiled": False,
           "heavyball-clip": True, "heavyball": False, "floor": False}


class SharedGrads:
    """One grad buffer for the peer rows: views of it are every row's ``.grad``; ``refill`` restores it."""

    def __init__(self, inputs: core.Inputs):
        self.inputs = inputs
        self.flat = inputs.grad_flat.clone()
        self.views = inputs.views(self.flat)

    def bind(self, params: list) -> Callable[[], None]:
        """Each param's ``.grad`` a view of the shared buffer; the refill that restores the values (and the
        binding, for an optimizer that drops the grads after its step)."""
        def refill() -> None:
            self.flat.copy_(self.inputs.grad_flat)
            for p, g in zip(params, self.views):
                if p.grad is not g:
                    p.grad = g
        refill()
        return refill


def build_graphstep(inputs: core.Inputs, grads: SharedGrads) -> core.Pipeline:
    """graphstep's default config over a fresh model of the shape set; its grads copied into its own buffer."""
    import graphstep as gs

    params = inputs.new_params()
    config = gs.OptimizerConfig(optimizer="adam", lr=core.LR, weight_decay=core.WEIGHT_DECAY,
                                adam_beta1=core.BETAS[0], adam_beta2=core.BETAS[1], adam_eps=core.EPS)
    opt = gs.get_optimizer(config, inputs.module(params))
    main_grads = [p.main_grad for p in params]
    sources = inputs.views(inputs.grad_flat)
    choice = opt.kernel_choice
    return core.Pipeline(opt.step, lambda: torch._foreach_copy_(main_grads, sources), opt,
                         f"kernel={choice.name} ({choice.reason})")


def _lr_tensor_groups(inputs: core.Inputs, params: list) -> list[dict]:
    groups = inputs.decay_groups(params)
    for group in groups:
        group["lr"] = torch.tensor(core.LR)  # the recipe: a tensor lr, so a schedule's change never recompiles
    return groups


def build_torch_fused_clip(inputs: core.Inputs, grads: SharedGrads) -> core.Pipeline:
    params = inputs.new_params()
    refill = grads.bind(params)
    opt = torch.optim.AdamW(inputs.decay_groups(params), lr=core.LR, betas=core.BETAS, eps=core.EPS, fused=True)

    def step():
        torch.nn.utils.clip_grad_norm_(params, core.CLIP, foreach=True)
        opt.step()
    return core.Pipeline(step, refill, opt)


def build_torch_compiled(inputs: core.Inputs, grads: SharedGrads, *, clip: bool) -> core.Pipeline:
    """torch's compiled-optimizer recipe: ``torch.compile`` around a function calling ``opt.step()`` (default
    AdamW implementation, the lr a tensor), with ``clip_grad_norm_`` inside the compiled function or not."""
    params = inputs.new_params()
    refill = grads.bind(params)
    opt = torch.optim.AdamW(_lr_tensor_groups(inputs, params), lr=torch.tensor(core.LR), betas=core.BETAS,
                            eps=core.EPS)

    @torch.compile(fullgraph=False)
    def step():
        if clip:
            torch.nn.utils.clip_grad_norm_(params, core.CLIP, foreach=True)
        opt.step()
    return core.Pipeline(step, refill, opt, "clip_grad_norm_ inside the compiled function" if clip else "")


def heavyball_problem() -> str | None:
    """Why heavyball's rows cannot run in this interpreter, or None."""
    try:
        import heavyball  # noqa: F401
        from heavyball import utils  # noqa: F401
    except Exception as error:  # not installed, or it does not import with this torch
        return (f"heavyball does not import here ({type(error).__name__}: {str(error)[:160]}); "
                "pip install heavyball (it needs opt-einsum and numpy >= 2.3.4)")
    return None


def heavyball_version() -> str:
    from importlib import metadata
    try:
        return metadata.version("heavyball")
    except metadata.PackageNotFoundError:
        return "unknown version"


def build_heavyball(inputs: core.Inputs, grads: SharedGrads, *, clip: bool) -> core.Pipeline:
    """heavyball's AdamW with its defaults but the bench's hyperparameters; global-norm clipping (per group)."""
    problem = heavyball_problem()
    if problem:
        raise RuntimeError(problem)
    import heavyball
    from heavyball import utils

    params = inputs.new_params()
    refill = grads.bind(params)
    clipping = {"gradient_clipping": utils.global_l2norm_clip} if clip else {}
    opt = heavyball.AdamW(inputs.decay_groups(params), lr=core.LR, betas=core.BETAS, eps=core.EPS, **clipping)
    return core.Pipeline(opt.step, refill, opt, f"heavyball {heavyball_version()}, compile mode "
                                                f"{utils.compile_mode}" + (", clip per param group" if clip else ""))


def build_floor(inputs: core.Inputs, grads: SharedGrads) -> core.Pipeline:
    return core.build_fused_floor(inputs)


BUILDERS: dict[str, Callable[[core.Inputs, SharedGrads], core.Pipeline]] = {
    "graphstep": build_graphstep,
    "torch-fused-clip": build_torch_fused_clip,
    "torch-compiled-clip": lambda i, g: build_torch_compiled(i, g, clip=True),
    "torch-compiled": lambda i, g: build_torch_compiled(i, g, clip=False),
    "heavyball-clip": lambda i, g: build_heavyball(i, g, clip=True),
    "heavyball": lambda i, g: build_heavyball(i, g, clip=False),
    "floor": build_floor,
}

LABELS = {
    "graphstep": "graphstep, default config (clip 1.0; grads copied in, so the step reads them for the norm)",
    "torch-fused-clip": "torch clip_grad_norm_ + AdamW(fused=True)",
    "torch-compiled-clip": "torch.compile(clip_grad_norm_ + AdamW.step), lr a tensor",
    "torch-compiled": "torch.compile(AdamW.step), lr a tensor, no clip",
    "heavyball-clip": "heavyball AdamW, global_l2norm_clip",
    "heavyball": "heavyball AdamW, no clip",
    "floor": "torch._fused_adamw_, one flat buffer (floor, no clip)",
}


def start(row: str, inputs: core.Inputs, grads: SharedGrads) -> tuple[core.Pipeline, float, float]:
    """Build ``row`` and run its first step (where the compiled rows compile): the pipeline, and the seconds
    its build and its first step took."""
    t0 = time.perf_counter()
    with torch.no_grad():
        pipeline = BUILDERS[row](inputs, grads)
    build_s = time.perf_counter() - t0
    if pipeline.refill is not None:
        pipeline.refill()
    t0 = time.perf_counter()
    with torch.no_grad():
        pipeline.step()
    return pipeline, build_s, time.perf_counter() - t0
