"""QK-clip (Kimi K2's MuonClip, Megatron-Core's ``qk_clip``): its math, the layer registration and the step's stage.

After the optimizer step, every attention layer whose largest pre-softmax logit S_g exceeded the threshold τ gets
the rows of query group g in W_q scaled by η_g^α and its key rows in W_k by η_g^(1−α), η_g = τ / S_g: logits are
bilinear in W_q and W_k, so the same inputs would now give at most τ; V is untouched. Unlike Megatron's
``clip_qk``, η is selected with ``torch.where`` and the scaling applied unconditionally (a factor of exactly 1
leaves a weight bitwise unchanged): no host sync, so it runs inside a captured step. A group whose max is ≤ 0,
±inf or NaN keeps η = 1 (Megatron's ``clamp(τ/S, max=1) ** α`` gives NaN for S < 0).

The model declares its attention layers (``register``) and records their logits in forward (``record``). With
``OptimizerConfig.qk_clip=True`` the stage (``build_stage``) runs after the update and before the copy-back,
skipped step or not, as in Megatron-Core. The public side, ``graphstep.qk_clip``, re-exports this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from ..kernels.muon import QKVSplit
from .stages import Stage

Scalar = Union[float, torch.Tensor]


@dataclass(frozen=True)
class HeadLayout:
    """Where each head's rows are in W_q / W_k (or the fused QKV weight).

    Separate weights: W_q has ``num_heads·head_dim`` rows, head h at rows [h·head_dim, (h+1)·head_dim),
    heads of query group g contiguous (g = h // heads_per_group); W_k has ``num_kv_groups·head_dim``
    rows. Fused (Megatron's ``linear_qkv``): ``num_kv_groups`` blocks of (heads_per_group + 2)·head_dim
    rows, each [the group's query heads, its key, its value].
    """

    num_heads: int
    num_kv_groups: int
    head_dim: int
    fused_qkv: bool = False

    def __post_init__(self):
        if self.num_heads % self.num_kv_groups:
            raise ValueError(f"{self}: num_heads must be a multiple of num_kv_groups (grouped-query attention)")

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_groups

    @property
    def q_rows_per_group(self) -> int:
        return self.heads_per_group * self.head_dim

    @property
    def fused_rows_per_group(self) -> int:
        return self.q_rows_per_group + 2 * self.head_dim


def reset(buffer: torch.Tensor) -> None:
    """Start a new step's running max: every head at -inf (nothing recorded)."""
    buffer.fill_(float("-inf"))


def record_max_logits(buffer: torch.Tensor, logits: torch.Tensor, *, head_dim: int = 1) -> None:
    """Fold this micro-batch's per-head max logit into ``buffer`` (num_heads,), in place, detached.

    ``logits`` are the masked, scaled pre-softmax scores with heads along ``head_dim`` (e.g. (b, h, s_q,
    s_kv)), or already per-head maxima of shape (num_heads,) such as Transformer Engine's
    ``return_max_logit`` output. No host sync: the max stays on the device.
    """
    logits = logits.detach()
    if logits.dim() > 1:
        logits = logits.movedim(head_dim, 0).flatten(1).amax(dim=1)
    if logits.shape != buffer.shape:
        raise ValueError(f"record_max_logits: {tuple(logits.shape)} per-head maxima for a buffer of "
                         f"{tuple(buffer.shape)}; pass head_dim= for the axis that holds the heads")
    torch.maximum(buffer, logits.to(buffer.dtype), out=buffer)


def clip_factors(max_logits: torch.Tensor, layout: HeadLayout, threshold: Scalar,
                 alpha: Scalar) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query group (η^α, η^(1−α)) with η = τ / S_g where τ < S_g < inf, else exactly 1.

    ``max_logits`` (num_heads,): per-head maxima; S_g is the max over the group's heads (GQA shares one
    key between them). Dividing by ``where(over, S_g, τ)`` keeps every intermediate finite. A non-finite
    S_g (an overflowed score, typically on a step that is skipped anyway) leaves the group unscaled:
    τ / inf = 0 would zero W_q and W_k for good.

    An unclipped group's factors are selected as 1.0, not computed: torch divides a Python float by a
    tensor as τ · (1/τ), which is 0.99999994 for 40 of the τ in 1..300, and its power would move the
    rows of a group that Megatron-Core leaves bitwise unchanged.
    """
    if max_logits.shape != (layout.num_heads,):
        raise ValueError(f"clip_factors: max_logits of shape {tuple(max_logits.shape)}, expected "
                         f"({layout.num_heads},) for {layout}")
    group_max = max_logits.float().view(layout.num_kv_groups, layout.heads_per_group).amax(dim=1)
    over = (group_max > threshold) & torch.isfinite(group_max)
    eta = threshold / torch.where(over, group_max, threshold)
    return torch.where(over, eta ** alpha, 1.0), torch.where(over, eta ** (1 - alpha), 1.0)


def clip_qk_(layout: HeadLayout, q_factor: torch.Tensor, k_factor: torch.Tensor, *,
             qkv: Optional[torch.Tensor] = None, q: Optional[torch.Tensor] = None,
             k: Optional[torch.Tensor] = None) -> None:
    """Scale a fused ``qkv`` weight, or separate ``q`` and ``k`` weights (2-D, rows first), in place."""
    separate = q is not None or k is not None
    if (qkv is not None) == separate or (separate and (q is None or k is None)):
        raise ValueError("clip_qk_: pass qkv= (fused QKV weight) or both q= and k= (separate weights)")
    groups, hd = layout.num_kv_groups, layout.head_dim
    if qkv is not None:
        if not layout.fused_qkv:
            raise ValueError(f"clip_qk_: qkv= given for {layout}, which declares separate weights")
        blocks = _grouped(qkv, groups, layout.fused_rows_per_group, "qkv")
        blocks[:, :layout.q_rows_per_group].mul_(q_factor[:, None, None])
        blocks[:, layout.q_rows_per_group:layout.q_rows_per_group + hd].mul_(k_factor[:, None, None])
        return
    if layout.fused_qkv:
        raise ValueError(f"clip_qk_: q=/k= given for {layout}, which declares a fused QKV weight")
    _grouped(q, groups, layout.q_rows_per_group, "q").mul_(q_factor[:, None, None])
    _grouped(k, groups, hd, "k").mul_(k_factor[:, None, None])


def _grouped(weight: torch.Tensor, groups: int, rows_per_group: int, name: str) -> torch.Tensor:
    if weight.dim() != 2 or weight.size(0) != groups * rows_per_group:
        raise ValueError(f"clip_qk_: {name} weight of shape {tuple(weight.shape)}, expected "
                         f"({groups * rows_per_group}, hidden) for this head layout")
    return weight.view(groups, rows_per_group, weight.size(1))


def row_factors(layout: HeadLayout, q_factor: torch.Tensor, k_factor: torch.Tensor) -> dict[str, torch.Tensor]:
    """The factor of every row: {"qkv": (rows,)} for a fused weight, {"q": ..., "k": ...} otherwise."""
    hd = layout.head_dim
    q_rows = q_factor.repeat_interleave(layout.q_rows_per_group)
    k_rows = k_factor.repeat_interleave(hd)
    if not layout.fused_qkv:
        return {"q": q_rows, "k": k_rows}
    ones = torch.ones(layout.num_kv_groups, hd, dtype=q_factor.dtype, device=q_factor.device)
    per_group = torch.cat((q_rows.view(layout.num_kv_groups, -1), k_rows.view(layout.num_kv_groups, hd), ones), dim=1)
    return {"qkv": per_group.flatten()}


def shard_row_index(start: int, numel: int, cols: int, device=None) -> torch.Tensor:
    """Row of each element of a flat shard holding elements [start, start+numel) of a (rows, cols) weight.

    Built once at layout time (a static int64 tensor), so the step gathers factors without host work.
    """
    return torch.div(torch.arange(start, start + numel, device=device), cols, rounding_mode="floor")


def scale_flat_rows_(shard: torch.Tensor, factors: torch.Tensor, row_index: torch.Tensor) -> None:
    """``shard[i] *= factors[row_index[i]]`` in place (a 1-D shard of a weight; see ``shard_row_index``)."""
    shard.mul_(factors.index_select(0, row_index))


# ---- registration: how the engine finds the layers to clip ---------------------------------------------
BUFFER_NAME = "qk_clip_max_logits"
_TAG = "_graphstep_qk_clip"


@dataclass(frozen=True, eq=False)
class Registration:
    """One attention layer: its module (which holds the max-logit buffer), head layout and weights."""

    module: torch.nn.Module
    layout: HeadLayout
    weights: tuple[tuple[str, torch.nn.Parameter], ...]  # ("q", W_q), ("k", W_k) or ("qkv", W_qkv)

    @property
    def max_logits(self) -> torch.Tensor:
        """The module's current per-head running max (the engine makes it a view of one static buffer)."""
        return getattr(self.module, BUFFER_NAME)


def register(module: torch.nn.Module, *, layout: HeadLayout, q: Optional[torch.nn.Parameter] = None,
             k: Optional[torch.nn.Parameter] = None, qkv: Optional[torch.nn.Parameter] = None) -> None:
    """Declare ``module`` an attention layer for QK-clip, with a max-logit buffer (num_heads,) at -inf.

    Record into it with ``record(module, logits)`` only: at build the engine moves every layer's buffer
    into one static tensor (one all-reduce for all layers) and points the module's attribute at its
    slice, so a reference to the buffer taken before the build would no longer be read (and, as for the
    params, move or cast the model before ``get_optimizer``, not after).

    Give ``q`` and ``k`` (separate weights, ``layout.fused_qkv=False``) or ``qkv`` (Megatron's grouped
    fused weight, ``layout.fused_qkv=True``), 2-D with rows first (``nn.Linear.weight``). A fused weight
    without a ``qkv_split`` gets one from the layout, so Muon's ``muon_split_qkv`` orthogonalises its Q, K
    and V apart. Register before ``get_optimizer``: the engine finds registrations at build. Biases are
    not scaled (as in Megatron-Core): with a Q/K bias the clipped max is no longer exactly τ.
    """
    separate = q is not None or k is not None
    if (qkv is not None) == separate or (separate and (q is None or k is None)):
        raise ValueError("qk_clip.register: pass qkv= (fused QKV weight) or both q= and k= (separate weights)")
    if layout.fused_qkv != (qkv is not None):
        wanted = "a fused QKV weight; pass qkv=" if layout.fused_qkv else "separate QKV weights; pass q= and k="
        raise ValueError(f"qk_clip.register: {layout} declares {wanted}")
    weights = (("qkv", qkv),) if qkv is not None else (("q", q), ("k", k))
    rows = {"qkv": layout.num_kv_groups * layout.fused_rows_per_group, "q": layout.num_heads * layout.head_dim,
            "k": layout.num_kv_groups * layout.head_dim}
    for kind, weight in weights:
        if not isinstance(weight, torch.nn.Parameter) or weight.dim() != 2 or weight.size(0) != rows[kind]:
            raise ValueError(f"qk_clip.register: {kind}= must be a 2-D nn.Parameter with {rows[kind]} rows for "
                             f"{layout}, got {type(weight).__name__} of shape {tuple(weight.shape)}")
        other = getattr(weight, _TAG, None)
        if other is not None and other.module is not module:
            raise ValueError(f"qk_clip.register: the {kind} weight is already registered with another module")
    if qkv is not None and getattr(qkv, "qkv_split", None) is None:
        qkv.qkv_split = QKVSplit(layout.num_kv_groups, layout.q_rows_per_group, layout.head_dim, layout.head_dim)
    registration = Registration(module, layout, weights)
    for _, weight in weights:
        setattr(weight, _TAG, registration)
    buffer = torch.full((layout.num_heads,), float("-inf"), device=weights[0][1].device)
    module.register_buffer(BUFFER_NAME, buffer, persistent=False)


class NotRegisteredError(ValueError):
    """``record`` on a module that ``register`` never saw (it has no max-logit buffer to record into)."""


def record(module: torch.nn.Module, logits: torch.Tensor, *, head_dim: int = 1) -> None:
    """``record_max_logits`` into ``module``'s registered buffer, in training mode only (eval forwards do
    not count towards the next step's clip). Raises ``NotRegisteredError`` for a module never registered,
    in eval mode too: the mistake is the same."""
    buffer = getattr(module, BUFFER_NAME, None)  # nn.Module raises a bare AttributeError without a default
    if buffer is None:
        raise NotRegisteredError(
            f"qk_clip.record: {type(module).__name__} is not registered for QK-clip, so it has no max-logit "
            f"buffer: call graphstep.qk_clip.register(module, layout=HeadLayout(...), q=W_q, k=W_k) (or qkv=W_qkv) "
            "once, when the model is built and before get_optimizer")
    if module.training:
        record_max_logits(buffer, logits, head_dim=head_dim)


def registrations(params) -> list[Registration]:
    """The registrations whose weights are among ``params``, in the order of their first weight there."""
    found: dict[int, Registration] = {}
    for p in params:
        registration = getattr(p, _TAG, None)
        if registration is not None:
            found.setdefault(id(registration), registration)
    return list(found.values())


# ---- the stage: after the update, before the copy-back ---------------------------------------------------------
def _main_param_targets(ctx, registration: Registration) -> list:
    """(kind, 2-D view or flat slice, row index or None) per registered weight this rank holds fp32 main params
    of: a (rows, cols) view when the rank holds the whole weight, else a flat slice and its element -> row index
    (the distributed optimizer's shards cut weights anywhere)."""
    index = {id(p): i for i, p in enumerate(ctx.buffers.params)}
    owned = {r.param: r for r in ctx.layout.owned_ranges(ctx.rank)}
    targets = []
    for kind, weight in registration.weights:
        if id(weight) not in index:
            raise ValueError(f"qk_clip: the {kind} weight registered for {type(registration.module).__name__} is not "
                             "trained by this optimizer (frozen, or in another model chunk); register trained "
                             "weights only")
        place = ctx.layout.params[index[id(weight)]]
        mine = owned.get(place.index)
        if mine is None:
            continue  # another rank holds all of it
        size = mine.param_end - mine.param_start
        flat = ctx.buffers.main_range(place.buffer, mine.shard_start, size)
        rows, cols = place.shape
        if size == rows * cols:
            targets.append((kind, flat.view(rows, cols), None))
        else:
            targets.append((kind, flat, shard_row_index(mine.param_start, size, cols, device=flat.device)))
    return targets


def build_stage(ctx) -> Stage:
    """QK-clip inside the step. At build, the registered layers among the params this optimizer trains get their
    max-logit buffers made views of one static tensor (one MAX all-reduce covers every layer). Each step: that
    all-reduce over the data-parallel group, per layer ``clip_factors`` (τ and α: the config's, fixed for the
    optimizer's life), this rank's main-param rows of W_q and W_k scaled, and every buffer back to -inf for the
    next step's forwards. The copy-back (and the all-gather) carries the scaled main params to the model."""
    found = registrations(ctx.buffers.params)
    if not found:
        raise ValueError("OptimizerConfig.qk_clip=True but no attention layer of the model is registered: call "
                         "graphstep.qk_clip.register(attention_module, layout=HeadLayout(...), q=..., k=...) (or "
                         "qkv=...) for each layer before get_optimizer, and graphstep.qk_clip.record(module, "
                         "scores) in its forward")
    device = ctx.buffers.main_shard[0].device
    total = sum(r.layout.num_heads for r in found)
    maxima = torch.full((total,), float("-inf"), device=device)
    layers, offset = [], 0
    for registration in found:
        heads = registration.layout.num_heads
        view = maxima[offset:offset + heads]
        view.copy_(registration.max_logits)  # keep what forwards recorded before the build
        setattr(registration.module, BUFFER_NAME, view)  # record() now writes into the static tensor
        layers.append((registration.layout, view, _main_param_targets(ctx, registration)))
        offset += heads
    threshold, alpha, comm = ctx.config.qk_clip_threshold, ctx.config.qk_clip_alpha, ctx.comm

    def apply() -> None:
        comm.all_reduce_max(maxima, "qk-clip max-logit all-reduce")
        for layout, view, targets in layers:
            q_factor, k_factor = clip_factors(view, layout, threshold, alpha)
            factors = row_factors(layout, q_factor, k_factor)
            for kind, target, row_index in targets:
                if row_index is None:
                    target.mul_(factors[kind][:, None])
                else:
                    scale_flat_rows_(target, factors[kind], row_index)
        reset(maxima)

    return Stage("qk_clip", apply)
