"""graphstep's answer to ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` /
``set_optimizer_state_dict``: functions of the same names and call shapes that work on a graphstep
optimizer, in the reshardable format (``sharded.py``).

torch's own functions expect per-param state tensors keyed by param (``optim.state[p]``); graphstep keeps
its state in flat buffers, so torch's versions cannot read or write it and are refused with the way that
works (``ParamState`` below): these, ``gs.checkpoint.get_optimizer_state_dict(model, opt)`` and
``set_optimizer_state_dict``, whose result DCP saves and reshards like any state dict (or
``gs.checkpoint.save`` / ``load``).
"""

from __future__ import annotations

import collections
import sys
from typing import Any

from . import sharded


def _single(optimizers):
    # A graphstep optimizer is known by its sharded state dict: this module sits below the engine and does
    # not import it.
    opts = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    if len(opts) != 1 or not callable(getattr(opts[0], "load_sharded_state_dict", None)):
        raise TypeError("graphstep.checkpoint.get/set_optimizer_state_dict take one graphstep optimizer (from "
                        "gs.get_optimizer); for torch.optim optimizers use torch.distributed.checkpoint's own")
    return opts[0]


def _check_options(options: Any) -> None:
    if options is not None and (getattr(options, "full_state_dict", False) or getattr(options, "cpu_offload",
                                                                                         False)):
        raise ValueError("graphstep's optimizer state dict is always sharded (each rank its own ranges, "
                         "resharded by DCP at load): full_state_dict/cpu_offload are not supported")


def get_optimizer_state_dict(model, optimizers, *, submodules=None, options=None) -> dict:
    """``sharded_state_dict(opt)`` (``model`` is accepted for torch's call shape; the names come from the
    optimizer, which recorded them at ``get_optimizer``)."""
    _check_options(options)
    return sharded.sharded_state_dict(_single(optimizers))


def set_optimizer_state_dict(model, optimizers, optim_state_dict: dict, *, options=None) -> None:
    """``load_sharded_state_dict(opt, optim_state_dict)``: validated, copied in place, params published."""
    _check_options(options)
    sharded.load_sharded_state_dict(_single(optimizers), optim_state_dict)


_TORCH_API = "torch.distributed.checkpoint.state_dict"


class ParamState(collections.defaultdict):
    """The engine's ``Optimizer.state``: torch's per-param mapping (each entry names the shared step count),
    which refuses to serve torch's ``get_state_dict`` / ``set_state_dict`` (and their optimizer-only forms):
    those read and write optimizer state per param, which graphstep keeps in flat buffers, and would fail
    deep inside torch (a bare ``KeyError: 'exp_avg'``). Both first ask whether the state is empty
    (``_init_optim_state``); that question, from that module, gets the way that works instead."""

    def __bool__(self) -> bool:
        if sys._getframe(1).f_globals.get("__name__") == _TORCH_API:
            raise TypeError(
                "graphstep keeps its optimizer state in flat buffers, which torch.distributed.checkpoint."
                "state_dict's get_state_dict / set_state_dict (and get/set_optimizer_state_dict) cannot read or "
                "write. Use gs.checkpoint.get_optimizer_state_dict(model, opt) and "
                "gs.checkpoint.set_optimizer_state_dict(model, opt, state_dict) instead (the same call shapes; DCP "
                "saves and reshards what they return), and torch's get_model_state_dict / set_model_state_dict "
                "for the model")
        return len(self) > 0

    def _refuse_reset(self, *args, **kwargs):
        raise TypeError(STATE_RESET)

    # torch's optimizers start a param's state over when its entry goes; graphstep's lives in flat buffers.
    __delitem__ = clear = pop = popitem = _refuse_reset


STATE_RESET = ("graphstep keeps the optimizer state in flat buffers, not in opt.state (which holds each param's "
                "step count only): removing or replacing its entries would reset nothing. To start the state over, "
                "build a new optimizer; to restore one, load a state dict")
