"""OptimizerConfig: every knob of the optimizer step (validated in one place, config/validation.py).

The step's shared fields are declared here; each optimizer family's own options are a frozen dataclass in its
module (``MuonOptions`` in graphstep/families/muon.py), held here by one field per family:
``OptimizerConfig(optimizer="muon", muon=MuonOptions(momentum=0.9))``. Field names follow Megatron-Core's
``OptimizerConfig`` where one exists; its flat names (``muon_momentum=0.9``) and the fields graphstep accepts
without effect pass through one adapter, config/megatron.py. graphstep's own fields (``capture``, ``kernel``,
...) are marked as such. Every field, its default and meaning: ``graphstep config --list`` (config/reference.py).
The dataclass is frozen: a config is a value, and anything that changes while training (lr, weight decay,
betas) changes in the optimizer's ``param_groups``, not here.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch

from ..families import family_name, implied_by
from ..families.adam import AdamOptions
from ..families.ademamix import AdEMAMixOptions
from ..families.lion import LionOptions
from ..families.muon import MuonOptions
from ..families.sgd import SGDOptions
from .megatron import accepted_names, accepting_megatron_names
from .unknown_fields import refusing_unknown_fields
from .validation import KERNELS, MAX_LOSS_SCALE, MIN_LOSS_SCALE, validate

__all__ = ["AdEMAMixOptions", "AdamOptions", "LionOptions", "MuonOptions", "OptimizerConfig", "SGDOptions"]


@dataclass(frozen=True)
class OptimizerConfig:
    # ---- general -------------------------------------------------------------------------------------
    optimizer: str = "adam"
    """Update rule: "adam" (Adam/AdamW, see ``decoupled_weight_decay``), "sgd" (with momentum), "lion",
    "muon" (2-D hidden matrices; the other params go to ``muon.scalar_optimizer``) or "ademamix": a
    registered family, graphstep/families/. "adamw" is accepted and read as "adam" (whose weight decay is
    decoupled by default: AdamW), refused with ``decoupled_weight_decay=False``; "dist_muon" (Megatron-LM's
    name) is read as "muon" with ``use_layer_wise_distributed_optimizer=True``."""

    lr: float = 1e-3
    """Peak learning rate; the initial ``lr`` of every param group without an override. (Megatron-Core's
    default is None, which its training scripts always replace; graphstep's is torch.optim's, so a config
    without one builds.)"""

    min_lr: Optional[float] = None
    """Floor of graphstep's LR schedules (``graphstep.scheduler``); None means 0."""

    decoupled_lr: Optional[float] = None
    """Learning rate for params marked ``is_embedding_or_output_parameter`` (standard overrides)."""

    decoupled_min_lr: Optional[float] = None
    """Schedule floor for the ``decoupled_lr`` params; None means ``min_lr``."""

    weight_decay: float = 0.01
    """Weight-decay coefficient; per group it is multiplied by the group's ``wd_mult``."""

    apply_wd_to_qk_layernorm: bool = False
    """Standard overrides: True gives the params of ``q_layernorm`` / ``k_layernorm`` modules weight decay
    although they are 1-D (Megatron-Core's rule)."""

    decoupled_weight_decay: bool = True
    """Adam and Muon: True applies decay to the params directly (AdamW), False adds it to the gradient (L2).
    AdEMAMix needs True; SGD adds it to the gradient and Lion decays the params directly, whatever it says."""

    # ---- each family's own options (a dataclass in its module, graphstep/families/) ---------------------
    adam: AdamOptions = AdamOptions()
    """Adam's β1, β2 and ε (``adam_beta1``, ``adam_beta2``, ``adam_eps``); AdEMAMix reads them too."""

    sgd: SGDOptions = SGDOptions()
    """SGD's momentum and Nesterov switch (``sgd_momentum``, ``sgd_nesterov``)."""

    lion: LionOptions = LionOptions()
    """Lion's β1 and β2 (``lion_beta1``, ``lion_beta2``)."""

    muon: MuonOptions = MuonOptions()
    """Muon's momentum, Newton–Schulz, scaling, QKV, scalar-optimizer and tensor-parallel options (``muon_*``)."""

    ademamix: AdEMAMixOptions = AdEMAMixOptions()
    """AdEMAMix's slow EMA, β3 and α (``ademamix_beta3``, ``ademamix_alpha``)."""

    # ---- precision -----------------------------------------------------------------------------------
    fp16: bool = False
    """Model params in float16 with fp32 main params; turns on dynamic loss scaling unless ``loss_scale``."""

    bf16: bool = False
    """Model params in bfloat16 with fp32 main params; no loss scaling unless ``loss_scale`` is set."""

    params_dtype: Optional[torch.dtype] = None
    """dtype of the model params in ``param_flat``. None: bfloat16 with ``bf16``, float16 with ``fp16``,
    else the model's own dtype. float32 with ``bf16`` / ``fp16`` is Megatron-Core's reading (its default:
    the weights are initialised in fp32 and trained in the half dtype): the half dtype. A model built in
    fp32 is cast once at build; its fp32 values seed the main params, so nothing is lost to the cast."""

    main_params_dtype: torch.dtype = torch.float32
    """dtype of the main params: float32, float64 (graphstep's own), or with ``use_precision_aware_optimizer``
    and half params float16 (stored scaled per param as TE's FusedAdam stores fp16 master weights; the update
    computes in fp32: graphstep/state/precision.py)."""

    main_grads_dtype: torch.dtype = torch.float32
    """dtype grads of half params accumulate and are reduced in: float32 (a main-grad buffer beside the
    params) or the params' own half dtype (``grad_flat`` directly; the update reads them cast to fp32).
    Megatron-Core allows the half dtype only with ``use_precision_aware_optimizer``; graphstep with or
    without it."""

    use_precision_aware_optimizer: bool = False
    """Allow Adam's state and main params below fp32: ``exp_avg_dtype``, ``exp_avg_sq_dtype``,
    ``main_params_dtype=float16`` and ``store_param_remainders`` take effect only with it (Adam only, as in
    Megatron-Core; graphstep/state/precision.py). Unlike Megatron-Core it needs no distributed optimizer."""

    store_param_remainders: bool = True
    """With ``use_precision_aware_optimizer``, bf16 params and fp32 main params: keep only the low 16 bits of
    each fp32 main param (the bf16 param holds the rest, rounded as TE rounds it), exactly, in 2 B per param
    instead of 4."""

    exp_avg_dtype: torch.dtype = torch.float32
    """Storage dtype of Adam's ``exp_avg`` with ``use_precision_aware_optimizer``: float32, bfloat16,
    float16 or fp8 (``torch.uint8``, Megatron-Core's spelling, or ``torch.float8_e4m3fn``); float16 and
    fp8 are stored scaled per param (graphstep/state/precision.py). The update reads and writes it in fp32."""

    exp_avg_sq_dtype: torch.dtype = torch.float32
    """Storage dtype of Adam's ``exp_avg_sq``, as ``exp_avg_dtype``."""

    # ---- loss scaling --------------------------------------------------------------------------------
    loss_scale: Optional[float] = None
    """A constant loss scale. None: dynamic scaling when ``fp16``, no scaling otherwise."""

    initial_loss_scale: float = 2.0**32
    """Dynamic scaling: the scale it starts from."""

    min_loss_scale: float = 1.0
    """Dynamic scaling: the scale never backs off below this."""

    loss_scale_window: int = 1000
    """Dynamic scaling: clean steps in a row before the scale doubles (the growth interval). An integral float
    (Megatron-Core's command line gives 1000.0) is taken as that integer."""

    hysteresis: int = 2
    """Dynamic scaling: non-finite steps tolerated before the scale backs off."""

    # ---- gradient pipeline ---------------------------------------------------------------------------
    clip_grad: float = 1.0
    """Global L2 grad-norm clip threshold; 0 turns clipping off (the norm is still reported)."""

    grad_norm_skip_threshold: float = math.inf
    """Skip the step (decided on device) when the grad norm exceeds this."""

    fold_grad_norm: bool = True
    """graphstep's own: compute each grad's sum of squares where the grad becomes final (one rank: in
    backward, a unit of rows at a time, by the hook of the unit's last param to arrive, for units of large
    params; several: as each bucket's reduce-scatter lands), so the step reads the grads once, in the
    update (graphstep/step/folded_sums.py). On by default: the
    step then costs about the bare update, and backward + step no more than with the norm in the step (the
    README's Performance section has the figures). A grad changed
    in place after backward is refolded before the step (its buffer's version counter moved on); a write that
    bypasses the counter (``p.grad.data``) is not seen (``debug_step()`` warns). Run earlier micro-batches
    under ``opt.no_sync()`` to fold only in the last. False: the step's norm stage reads the grads itself.
    The two give bitwise the same step."""

    log_num_zeros_in_grad: bool = False
    """Count zero grad elements on device into ``StepResult.num_zeros``."""

    # ---- distributed ---------------------------------------------------------------------------------
    use_distributed_optimizer: bool = False
    """Shard fp32 main params and optimizer state across the data-parallel ranks (ZeRO-1/2 style)."""

    use_layer_wise_distributed_optimizer: bool = False
    """Megatron-Core's switch for sharding Muon layer-wise (whole matrices per rank): graphstep does that
    for Muon's matrices whenever ``use_distributed_optimizer`` is on, so True means the same as
    ``use_distributed_optimizer=True`` (and needs ``optimizer="muon"``)."""

    bucket_size: Optional[int] = None
    """Elements per communication bucket; None means max(40M, 1M x data-parallel size)."""

    overlap_grad_reduce: bool = False
    """Start each bucket's reduce-scatter from backward hooks as soon as its grads are complete."""

    overlap_param_gather: bool = False
    """Defer each bucket's param all-gather to a forward pre-hook of the next iteration."""

    distributed_timeout_s: float = 300.0
    """graphstep's own: with gloo, a collective of the step that has not finished after this many seconds
    raises, naming it; it also bounds the ranks' host-side agreement (gloo) on every backend. NCCL
    collectives run on the caller's groups, under their own timeout (README, "Capture on GPUs")."""

    # ---- hybrid CPU offload (Megatron-Core's names; graphstep.offload) --------------------------------
    optimizer_cpu_offload: bool = False
    """Keep the fp32 main params, optimizer state and update of a fraction of the params on the host CPU
    (``optimizer_offload_fraction``); the rest, and the grad norm, clip and loss scale of all, stay in
    the captured device step."""

    optimizer_offload_fraction: float = 0.0
    """With ``optimizer_cpu_offload``: the fraction in [0, 1] of this rank's optimizer elements whose
    update runs on the host. Whole params are taken from the end of the rank's shard backwards (the last
    buffer first, in it the last bucket, which holds the model's first layers) while the count is below
    the fraction, so it may overshoot by one param (Megatron-Core's rule)."""

    overlap_cpu_optimizer_d2h_h2d: bool = False
    """With ``optimizer_cpu_offload``: update the host params chunk by chunk on a worker thread, copying
    each chunk back while the next is updated; the next forward waits only for the chunks its modules use."""

    pin_cpu_grads: bool = True
    """Page-lock the host grad buffers (asynchronous D2H copies); ignored where torch has no accelerator.
    False needs ``capture="eager"``: the grads' D2H copy is inside the device step, and a capture cannot
    contain a blocking copy into pageable memory."""

    pin_cpu_params: bool = True
    """Page-lock the host main-param and staging buffers (asynchronous H2D copies); ignored where torch
    has no accelerator."""

    # ---- capture (graphstep's own) -------------------------------------------------------------------
    capture: str = "auto"
    """"graph": capture the step after the warm-up (CUDA graph on CUDA, the replay backend on CPU) and
    raise if it cannot be captured. "auto": capture on CUDA when the step passes the capture check, else
    run eagerly and say why once. "eager": the debugging mode, stage by stage."""

    capture_warmup_steps: int = 3
    """Eager steps before capture (lets lazily built state and allocator pools settle)."""

    capture_invalidation: str = "recapture"
    """What a replay does when the captured step went stale (params replaced, group added, state loaded by
    replacing tensors, a baked hyperparameter changed): "recapture" it, or "raise"."""

    optimizer_cuda_graph: bool = False
    """Megatron-Core's switch for capturing the step: True means ``capture="graph"`` (an explicit
    ``capture="eager"`` with it is refused); False leaves ``capture`` to decide."""

    param_checks: str = "every_step"
    """graphstep's own: when the checks that read every param run (each param's data and grad still the flat
    buffers' views, each ``requires_grad`` as at the build, FSDP2's bindings). "every_step" (default): before
    every step, host time in proportion to the params (the README's Performance section has the figures).
    "on_request": before the first step and the step after each ``opt.check_params()``; between those a param
    replaced (``p.data = ...``), a grad replaced or set to None (``model.zero_grad()``: use ``opt.zero_grad()``)
    and a param frozen or unfrozen go unseen: the step updates and reads the flat buffers, not the new tensors,
    and a frozen param goes on being stepped. Call ``opt.check_params()`` after any of those. Every other
    check, and the watch of writes into bf16/fp16 params, runs every step either way."""

    kernel: str = "auto"
    """graphstep's own: update math. "auto" (default): "compiled" where ``torch.compile`` works on the device
    (found out once per process at build, compile time logged), else "fused" with a one-line warning; see
    graphstep/kernels/auto.py. "fused": torch's fused multi-tensor kernels (lr is a device tensor; betas,
    eps and weight decay are floats baked into a capture and guarded; a clipped or loss-scaled step also
    writes the grads back; bitwise equal to torch.optim's fused step). "compiled": ``torch.compile``d
    loops, one call per group, every hyperparameter a device tensor, the grads only read: the fastest full
    step, after a compile of a few seconds on first use (needs a C++ compiler on the CPU, Triton on a GPU).
    "reference": plain tensor ops with every hyperparameter a device tensor (the test oracle; slower)."""

    # ---- QK-clip (graphstep.qk_clip) -----------------------------------------------------------------
    qk_clip: bool = False
    """After each step, shrink W_q / W_k of registered attention layers whose max logit exceeded
    ``qk_clip_threshold`` (graphstep.qk_clip.register; MuonClip)."""

    qk_clip_threshold: float = 100.0
    """QK-clip's τ > 0: the largest attention logit a clipped layer may produce on the same inputs."""

    qk_clip_alpha: float = 0.5
    """QK-clip's α in (0, 1): W_q rows scale by η^α, W_k rows by η^(1−α)."""

    # ---- fp8 primary weights (graphstep.fp8) ---------------------------------------------------------
    fp8_recipe: Optional[str] = None
    """How the step requantizes fp8 weights (made by ``graphstep.fp8.convert``) after the update: None (the
    model has no fp8 weights), "tensorwise" (current scaling: the scale from the new values' amax) or
    "delayed" (cast with the previous scale, the next from the amax history). Megatron-Core's name."""

    fp8_margin: int = 0
    """fp8 scale = fp8_max / amax / 2**fp8_margin (Megatron-Core's ``fp8_margin``)."""

    fp8_amax_history_len: int = 1
    """Delayed recipe: how many past amaxes the next scale is computed from."""

    fp8_amax_compute_algo: str = "most_recent"
    """Delayed recipe: the next scale from the history's "max" or its "most_recent" amax."""

    def __post_init__(self) -> None:
        # Megatron-Core annotates loss_scale_window as a float and its command line parses it so (1000.0).
        if isinstance(self.loss_scale_window, float) and self.loss_scale_window.is_integer():
            object.__setattr__(self, "loss_scale_window", int(self.loss_scale_window))
        if self.optimizer_cuda_graph is True and self.capture == "auto":
            object.__setattr__(self, "capture", "graph")
        implied = implied_by(self.optimizer)  # Megatron-LM's "dist_muon": Muon, sharded layer-wise
        if implied is not None:
            family, setting, value = implied
            object.__setattr__(self, "optimizer", family)
            object.__setattr__(self, setting, value)
        if self.use_layer_wise_distributed_optimizer is True:
            object.__setattr__(self, "use_distributed_optimizer", True)
        # Other spellings of a family ("adamw"): the family's own name, so everything downstream sees one.
        object.__setattr__(self, "optimizer", family_name(self.optimizer, self, "optimizer"))
        if isinstance(self.muon, MuonOptions):  # another type is refused by validate, naming the field
            scalar = family_name(self.muon.scalar_optimizer, self, "muon_scalar_optimizer")
            if scalar != self.muon.scalar_optimizer:
                object.__setattr__(self, "muon", dataclasses.replace(self.muon, scalar_optimizer=scalar))
        validate(self)

    def replace(self, **changes) -> "OptimizerConfig":
        """A copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)

    @property
    def model_dtype(self) -> Optional[torch.dtype]:
        """The dtype params are cast to at build, or None to keep the model's own."""
        if self.params_dtype is not None and not (self.params_dtype == torch.float32 and (self.bf16 or self.fp16)):
            return self.params_dtype
        if self.bf16:
            return torch.bfloat16
        if self.fp16:
            return torch.float16
        return None

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.loss_scale is None and self.fp16


# The constructor (and so replace and dataclasses.replace) first maps Megatron-Core's flat names onto the fields
# (config/megatron.py), then refuses a misspelled keyword with the closest names, flat ones included. The
# families' options classes get the same "did you mean": they are this config's fields.
_REFERENCE = "`graphstep config --list`, or graphstep/config/__init__.py and the family modules"
OptimizerConfig.__init__ = accepting_megatron_names(
    OptimizerConfig, refusing_unknown_fields(OptimizerConfig, _REFERENCE, also=accepted_names(OptimizerConfig)))
for _options in (AdamOptions, SGDOptions, LionOptions, MuonOptions, AdEMAMixOptions):
    _options.__init__ = refusing_unknown_fields(_options, _REFERENCE)
