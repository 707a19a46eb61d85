"""StepContext: everything a stage factory builds from, typed, in one object."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Optional, Union

if TYPE_CHECKING:  # annotations only: the context module imports nothing at run time
    from ...plan.layout import Layout
    from ...config import OptimizerConfig
    from ...families import Family
    from ...parallel.collectives import Collectives
    from ...state.buffers import StaticBuffers
    from ...state.hyperparams import HyperParams
    from ..folded_sums import ParamSums, ShardSums
    from ..scaler import ConstantLossScaler, DynamicLossScaler
    from ..torch_amp import TorchGradScaler
    from . import StepTensors


@dataclass(frozen=True)
class StepContext:
    config: "OptimizerConfig"
    layout: "Layout"
    buffers: "StaticBuffers"
    hyper: "HyperParams"
    kernels: ModuleType  # one of graphstep.kernels' implementations (fused, compiled, reference)
    families: tuple["Family", ...]  # per param group: the optimizer family that updates it
    tensors: "StepTensors"
    scaler: Optional[Union["ConstantLossScaler", "DynamicLossScaler"]]
    comm: "Collectives"
    rank: int
    compile_scalars: bool = False
    """Run each stage's scalar math as one compiled graph (graphstep/step/compiled_scalar_math.py): on a GPU whose update
    runs the compiled kernel (``compiled_scalar_math.wanted``)."""
    average_over: Optional[int] = None
    """The data-parallel size the reduce stage averages grads by; None: the layout's own. An expert domain
    (graphstep/plan/experts.py) sums over the expert data-parallel group but averages by the full one."""
    torch_amp: Optional["TorchGradScaler"] = None
    """torch's GradScaler's side of the step (graphstep/step/torch_amp.py): whether the grads come loss-scaled by it;
    None where no GradScaler can step (``graphstep.wrap``'s engine)."""
    folded: Optional[Union["ParamSums", "ShardSums"]] = None
    """With ``fold_grad_norm``: the domain's folded sums of squares (graphstep.step.folded_sums), which the reduce
    (or local-average) stage fills and the norm stage adds up; None otherwise."""
