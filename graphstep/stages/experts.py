"""The expert domain's stages (graphstep/experts.py): the dense stages' factories over the expert context,
named ``expert_<stage>``, plus the averaging an unsharded expert domain needs.

With an expert data-parallel size of 1 (as many expert-parallel ranks as data-parallel ones) no
reduce-scatter runs for the experts, but their grads still average over the full data-parallel size
(experts.py, rule 1): ``local_average`` multiplies them by 1/dp in place, the one pass the reduce stage
would have spent on its received shard. The grads the user reads after the step are then the averaged
ones, as with the reduce-scatter's pre-scaled fp16 buckets.
"""

from __future__ import annotations

import dataclasses

from . import Stage


def named(stage: Stage) -> Stage:
    """``stage`` renamed ``expert_<name>``, so profiler ranges and the debugger's table tell the domains apart."""
    return dataclasses.replace(stage, name=f"expert_{stage.name}")


def local_average(ctx) -> Stage:
    """Expert grads times 1/dp, in place, when the expert domain is not sharded (no reduce-scatter)."""
    grads = list(ctx.buffers.grad_shard)  # the grad buffers themselves at an expert data-parallel size of 1
    inv_dp = 1.0 / ctx.average_over
    folded = ctx.folded

    def apply() -> None:
        for unit, grad in enumerate(grads):
            grad.mul_(inv_dp)
            if folded is not None:  # fold_grad_norm: its sum of squares while it is hot
                folded.fold(unit)

    return Stage("expert_average", apply)


def reduce_or_average(ctx) -> Stage:
    """The expert domain's first stage: its reduce-scatter, or the local average without one."""
    from . import reduce

    return named(reduce.build(ctx)) if ctx.layout.dp_size > 1 else local_average(ctx)
