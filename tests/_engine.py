"""``make_engine(model, **config)``: the one engine builder of the tests.

A graphstep optimizer for ``model`` built from ``OptimizerConfig(**config)``, with the config's own
defaults except ``capture``, which defaults to "eager": a test captures the step when it checks capture
(and says so), not by default. Files whose checks need another default (unclipped, to compare with
torch.optim) bind it once with ``functools.partial`` and say why.
"""

import graphstep as gs


def make_engine(model, **config):
    config.setdefault("capture", "eager")
    return gs.get_optimizer(gs.OptimizerConfig(**config), model)
