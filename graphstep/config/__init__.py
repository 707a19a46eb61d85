"""OptimizerConfig: every knob of the optimizer step (validated in one place, config/validation.py).

Field names follow Megatron-Core's ``OptimizerConfig`` where one exists, so a Megatron user can carry a
config over; graphstep's own fields (``capture``, ``kernel``, ...) are marked as such. The dataclass is
frozen: a config is a value, and anything that changes while training (lr, weight decay, betas) changes in
the optimizer's ``param_groups``, not here.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..families import family_name, implied_by
from .unknown_fields import refusing_unknown_fields
from .validation import KERNELS, MAX_LOSS_SCALE, MIN_LOSS_SCALE, validate


@dataclass(frozen=True)
class OptimizerConfig:
    # ---- general -------------------------------------------------------------------------------------
    optimizer: str = "adam"
    """Update rule: "adam" (Adam/AdamW, see ``decoupled_weight_decay``), "sgd" (with momentum), "lion",
    "muon" (2-D hidden matrices; the other params go to ``muon_scalar_optimizer``) or "ademamix": a
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
    """Adam only: True applies decay to the params directly (AdamW), False adds it to the gradient (L2)."""

    # ---- Adam / SGD ----------------------------------------------------------------------------------
    adam_beta1: float = 0.9
    """Adam's first-moment decay, in [0, 1)."""

    adam_beta2: float = 0.999
    """Adam's second-moment decay, in [0, 1)."""

    adam_eps: float = 1e-8
    """Adam's denominator term, at least 2**-126 (the smallest normal float32: the update adds it in float32)."""

    sgd_momentum: float = 0.9
    """SGD momentum in [0, 1); 0 turns the momentum buffer off (no state is allocated)."""

    sgd_nesterov: bool = False
    """SGD: use Nesterov momentum (needs ``sgd_momentum`` > 0)."""

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

    overlap_param_gather_with_optimizer_step: bool = False
    """Megatron-Core's: start the first bucket's param all-gather inside its optimizer step. graphstep's
    gathers are part of the captured step (or deferred to forward pre-hooks with ``overlap_param_gather``):
    True is refused."""

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

    use_torch_optimizer_for_cpu_offload: bool = False
    """Megatron-Core's choice of host optimizer: graphstep's host update always runs torch's fused CPU
    kernels, so both values do the same."""

    offload_optimizer_states: bool = False
    """Megatron-Core's: move all optimizer state to the host between steps. Not offered (keep part of it
    there for good with ``optimizer_cpu_offload``): True is refused."""

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

    kernel: str = "auto"
    """graphstep's own: update math. "auto" (default): "compiled" where ``torch.compile`` works on the device
    (found out once per process at build, compile time logged), else "fused" with a one-line warning; see
    graphstep/kernels/auto.py. "fused": torch's fused multi-tensor kernels (lr is a device tensor; betas,
    eps and weight decay are floats baked into a capture and guarded; a clipped or loss-scaled step also
    writes the grads back; bitwise equal to torch.optim's fused step). "compiled": ``torch.compile``d
    loops, one call per group, every hyperparameter a device tensor, the grads only read: the fastest full
    step, after a compile of a few seconds on first use (needs a C++ compiler on the CPU, Triton on a GPU).
    "reference": plain tensor ops with every hyperparameter a device tensor (the test oracle; slower)."""

    # ---- Muon, Lion and QK-clip (Megatron-Core's names and defaults) ----------------------------------------
    muon_momentum: float = 0.95
    """Muon's EMA momentum μ in [0, 1): ``m = μ·m + (1 − μ)·g``; the initial ``momentum`` of Muon groups
    (live: a schedule may change it every step)."""

    muon_nesterov: bool = False
    """Muon: update with ``(1 − μ)·g + μ·m`` instead of ``m`` (the canonical name: Megatron-Core's newest)."""

    muon_use_nesterov: Optional[bool] = None
    """Megatron-Core 0.16.1's name of ``muon_nesterov``: given, it sets ``muon_nesterov`` (and reads None
    afterwards, so ``replace`` and equality see one field)."""

    muon_num_ns_steps: int = 5
    """Newton–Schulz iterations per step (a multiple of 5 for "quintic", at least 8 for "polar_express")."""

    muon_coefficient_type: str = "quintic"
    """Newton–Schulz coefficients: "quintic" (five tuples, cycled), "simple" or "polar_express"."""

    muon_scale_mode: str = "spectral"
    """Update scale of an (r, c) matrix: "spectral" √max(r, c), "shape_scaling" √max(1, r/c) or
    "unit_rms_norm" √(r/c)."""

    muon_extra_scale_factor: float = 1.0
    """Extra factor on Muon's update (0.2 ≈ AdamW's update RMS)."""

    muon_fp32_matmul_prec: str = "medium"
    """Newton–Schulz matmuls: "medium" in bf16 after normalising; "high" / "highest" in fp32."""

    muon_split_qkv: bool = True
    """Orthogonalise fused QKV weights (params with ``qkv_split``) as separate Q, K and V matrices."""

    muon_scalar_optimizer: str = "adam"
    """With ``optimizer="muon"``: the family of the params Muon does not take (not 2-D, embedding/output,
    ``use_muon=False``): "adam" or "lion" ("adamw" is read as "adam")."""

    muon_tp_mode: str = "blockwise"
    """Muon on a matrix split over the tensor-parallel group (``tensor_model_parallel``, ``partition_dim``):
    "blockwise" (Megatron-Core's default) orthogonalises each slice alone, "duplicated" all-gathers it and
    orthogonalises the whole matrix on every TP rank, "distributed" runs Newton–Schulz on the slices with
    its Gram matrices all-reduced over the group. The update scale uses the whole matrix's shape in every
    mode."""

    soap_shampoo_beta: float = 0.95
    """Megatron-Core's, for its "soap" optimizer, which graphstep does not offer: accepted, no effect."""

    soap_precondition_frequency: int = 1
    """As ``soap_shampoo_beta``: accepted, no effect."""

    soap_use_kl_shampoo: bool = True
    """As ``soap_shampoo_beta``: accepted, no effect."""

    adaptive_muon_moment2_method: str = "adamuon"
    """Megatron-Core's, for its "adaptive_muon" optimizer, which graphstep does not offer: accepted, no
    effect."""

    adaptive_muon_beta2: float = 0.95
    """As ``adaptive_muon_moment2_method``: accepted, no effect."""

    adaptive_muon_eps: float = 1e-8
    """As ``adaptive_muon_moment2_method``: accepted, no effect."""

    lion_beta1: float = 0.95
    """Lion's interpolation β1 in [0, 1) (the sign of ``β1·m + (1 − β1)·g`` is the update)."""

    lion_beta2: float = 0.98
    """Lion's momentum decay β2 in [0, 1)."""

    ademamix_beta3: float = 0.9999
    """AdEMAMix's slow-EMA decay β3 in [0, 1); the initial ``beta3`` of AdEMAMix groups (live: the paper's
    warm-up schedules it). Its β1, β2 and ε are ``adam_beta1``, ``adam_beta2``, ``adam_eps``."""

    ademamix_alpha: float = 5.0
    """AdEMAMix's slow-EMA weight α >= 0 (0: AdamW); the initial ``alpha`` of AdEMAMix groups (live)."""

    qk_clip: bool = False
    """After each step, shrink W_q / W_k of registered attention layers whose max logit exceeded
    ``qk_clip_threshold`` (graphstep.qk_clip.register; MuonClip)."""

    qk_clip_threshold: float = 100.0
    """QK-clip's τ > 0: the largest attention logit a clipped layer may produce on the same inputs."""

    qk_clip_alpha: float = 0.5
    """QK-clip's α in (0, 1): W_q rows scale by η^α, W_k rows by η^(1−α)."""

    # ---- fp8 primary weights (graphstep.fp8) ---------------------------------------------------------
    reuse_grad_buf_for_mxfp8_param_ag: bool = False
    """Megatron-Core's, for mxfp8 weights, which graphstep does not offer: True is refused."""

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

    # ---- Megatron-Core's logging, accepted and without effect here ----------------------------------
    barrier_with_L1_time: bool = False
    """Megatron-Core's timers: no effect (graphstep's step reports through ``StepResult`` and NVTX ranges)."""

    timers: Optional[Callable] = None
    """Megatron-Core's timers: no effect."""

    config_logger_dir: str = ""
    """Megatron-Core's config dump directory: no effect."""

    def __post_init__(self) -> None:
        # Megatron-Core's spellings of graphstep fields, folded into them so one field holds each setting.
        if self.muon_use_nesterov is not None:
            if not isinstance(self.muon_use_nesterov, bool):
                raise ValueError(f"OptimizerConfig.muon_use_nesterov={self.muon_use_nesterov!r}: must be a bool "
                                 "(True or False) or None")
            object.__setattr__(self, "muon_nesterov", self.muon_use_nesterov)
            object.__setattr__(self, "muon_use_nesterov", None)
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
        for field in ("optimizer", "muon_scalar_optimizer"):
            object.__setattr__(self, field, family_name(getattr(self, field), self, field))
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


# A misspelled field is a TypeError naming the closest fields, from the constructor and from replace.
OptimizerConfig.__init__ = refusing_unknown_fields(OptimizerConfig, "graphstep/config/__init__.py")
