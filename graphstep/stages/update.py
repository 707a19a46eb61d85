"""The fused update on the main params, skip folded in; and the copy back into the model params.

One kernel call per param group, over that group's segments of this rank's shard (a few large views:
one per bucket, see layout.py). The step count advances by ``1 - found_inf`` before the kernel, so a
skipped step leaves it, like the params and the state, bitwise unchanged.

The kernel is given the grad scale only when it can differ from 1 (a loss scaler, or a clip threshold
above 0): torch's fused kernels write the divided grads back whenever they get one, 4 more bytes per
param that an unclipped, unscaled step need not pay. Whether it is given is a host choice a capture
bakes in; ``baked_choices`` reports it so a captured step is recaptured when it flips.
"""

import torch

from . import Stage

# Where each kernel argument comes from: (argument, hyperparameter field).
_ADAM_FIELDS = (("lr", "lr"), ("beta1", "beta1"), ("beta2", "beta2"), ("weight_decay", "weight_decay"),
                ("eps", "eps"))
_SGD_FIELDS = (("lr", "lr"), ("weight_decay", "weight_decay"), ("momentum", "momentum"))


def used_fields(optimizer: str) -> tuple[str, ...]:
    """The hyperparameter fields the update of ``optimizer`` reads."""
    return tuple(field for _, field in (_ADAM_FIELDS if optimizer == "adam" else _SGD_FIELDS))


def uses_grad_scale(ctx) -> bool:
    """Whether this step's grad scale may differ from 1 (host values only: no device read)."""
    return ctx.scaler is not None or ctx.hyper.host_value("clip_grad") > 0


def baked_choices(ctx) -> tuple:
    """The host choices the update makes per step, as ``(group, name, value)`` like ``baked_values``."""
    return ((None, "grad scale passed to the kernel", uses_grad_scale(ctx)),)


def build(ctx) -> Stage:
    buffers, hyper, kernels, t = ctx.buffers, ctx.hyper, ctx.kernels, ctx.tensors
    is_adam = ctx.config.optimizer == "adam"
    fields = _ADAM_FIELDS if is_adam else _SGD_FIELDS

    # The grads the kernel reads must have the main params' dtype; half grads get an fp32 scratch copy.
    main_dtype = ctx.config.main_params_dtype
    grad_sources = buffers.grad_shard
    needs_cast = [g.dtype != main_dtype for g in grad_sources]
    kernel_grads = [torch.empty_like(g, dtype=main_dtype) if cast else g
                    for g, cast in zip(grad_sources, needs_cast)]

    calls = []  # (group, params, grads, state lists)
    segments = ctx.layout.segments(ctx.rank)
    for group in range(ctx.layout.num_groups):
        mine = [s for s in segments if s.group == group]
        if not mine:
            continue  # this rank owns nothing of the group
        params = buffers.segment_views(buffers.main_shard, mine, flat=False)
        grads = buffers.segment_views(kernel_grads, mine, flat=False)
        state = {name: buffers.segment_views(tensors, mine, flat=False) for name, tensors in buffers.state.items()}
        calls.append((group, params, grads, state))

    def hyperparameters(group: int) -> dict:
        # Live fields are device tensors; the others are the floats of the last refresh (baked if captured).
        return {arg: hyper.tensor(field, group) if field in kernels.LIVE_FIELDS else hyper.host_value(field, group)
                for arg, field in fields}

    def apply() -> None:
        for source, target, cast in zip(grad_sources, kernel_grads, needs_cast):
            if cast:
                target.copy_(source)
        t.step.add_(1.0 - t.found_inf)
        grad_scale = t.grad_scale if uses_grad_scale(ctx) else None
        for group, params, grads, state in calls:
            if is_adam:
                kernels.adam(params, grads, state["exp_avg"], state["exp_avg_sq"], step=t.step,
                             decoupled=ctx.config.decoupled_weight_decay, grad_scale=grad_scale,
                             found_inf=t.found_inf, **hyperparameters(group))
            else:
                kernels.sgd(params, grads, state.get("momentum_buffer", []), nesterov=ctx.config.sgd_nesterov,
                            grad_scale=grad_scale, found_inf=t.found_inf, **hyperparameters(group))

    return Stage("update", apply)


def build_copy_back(ctx) -> Stage:
    """Copy the updated main params into the model dtype (a skipped step copies unchanged values)."""
    pairs = _copy_back_pairs(ctx)

    def apply() -> None:
        for param_part, main_part in pairs:
            param_part.copy_(main_part)

    return Stage("copy_back", apply)


def _copy_back_pairs(ctx) -> list:
    """(model-param view, main-param view) pairs the update copies into the model dtype.

    Nothing for buffers whose main params are the params. One copy of the whole buffer with one rank;
    with several, each bucket's owned shard (the gather stage then all-gathers the rest).
    """
    buffers, layout = ctx.buffers, ctx.layout
    pairs = []
    for b, buf in enumerate(layout.buffers):
        if buffers.main_is_param[b]:
            continue
        if layout.dp_size == 1:
            pairs.append((buffers.param_flat[b], buffers.main_shard[b]))
            continue
        for index in buf.buckets:
            bucket = layout.buckets[index]
            lo, hi = bucket.shard_range(ctx.rank)
            pairs.append((buffers.param_flat[b][lo:hi],
                          buffers.main_shard[b][bucket.shard_offset:bucket.shard_offset + bucket.shard_numel]))
    return pairs
