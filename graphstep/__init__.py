"""graphstep: the whole optimizer step over static flat buffers, replayable as one graph.

See README.md for the training loop and docs/design.md for the data flow and the laws. ``__all__`` is the user
API; the internals (the layout planner ``graphstep.plan.layout``, ``graphstep.step.scaler.scaler_from_config``,
...) are imported from their modules.
"""

from . import checkpoint, fp8, qk_clip
from .plan.overrides import (NamedPredicate, ParamGroupOverride, ParamKey, check_config_overrides_consistency,
                              get_mup_config_overrides, get_standard_config_overrides)
from .checkpoint import CheckpointError
from .config import AdamOptions, AdEMAMixOptions, LionOptions, MuonOptions, OptimizerConfig, SGDOptions
from .engine import GraphstepOptimizer
from .factory import get_optimizer
from .iteration import Iteration, IterationResult
from .kernels.muon import QKVSplit
from .parallel.collectives import CollectiveError
from .qk_clip import HeadLayout
from .run.debug import NanOrigin, StepReport
from .run.result import StepResult
from .scheduler import ParamScheduler
from .step.scaler import ConstantLossScaler, DynamicLossScaler
from .wrap import CapturedOptimizer, wrap

__all__ = [
    # Building and stepping an optimizer
    "OptimizerConfig",
    "AdamOptions",
    "SGDOptions",
    "LionOptions",
    "MuonOptions",
    "AdEMAMixOptions",
    "get_optimizer",
    "GraphstepOptimizer",
    "StepResult",
    "StepReport",
    "NanOrigin",
    "wrap",
    "CapturedOptimizer",
    "ConstantLossScaler",
    "DynamicLossScaler",
    "ParamScheduler",
    # The whole training iteration as one graph
    "Iteration",
    "IterationResult",
    # Megatron-Core's param-group overrides
    "NamedPredicate",
    "ParamGroupOverride",
    "ParamKey",
    "check_config_overrides_consistency",
    "get_mup_config_overrides",
    "get_standard_config_overrides",
    # Marks on the model: a fused QKV weight's rows (Muon), attention heads (QK-clip)
    "QKVSplit",
    "HeadLayout",
    # Errors
    "CollectiveError",
    "CheckpointError",
    # Submodules
    "checkpoint",
    "qk_clip",
    "fp8",
]
