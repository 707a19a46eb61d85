"""``adam_groups`` for a kernels module whose ``adam`` runs one param group per call (fused, reference)."""


def one_call_per_group(adam):
    """``adam_groups`` (the entry point graphstep/families/adam.py calls) as one ``adam`` call per group, in
    order."""

    def adam_groups(groups, **step_wide) -> None:
        for params, grads, exp_avgs, exp_avg_sqs, hyper in groups:
            adam(params, grads, exp_avgs, exp_avg_sqs, **hyper, **step_wide)

    return adam_groups
