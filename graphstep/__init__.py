"""graphstep: the whole optimizer step over static flat buffers, replayable as one graph.

See README.md for the training loop and docs/design.md for the data flow and the laws.
"""

from . import checkpoint, fp8, qk_clip
from .plan.layout import Layout, ParamSpec, plan_layout
from .plan.overrides import (NamedPredicate, ParamGroupOverride, ParamKey, check_config_overrides_consistency,
                              get_mup_config_overrides, get_standard_config_overrides)
from .checkpoint import CheckpointError
from .config import OptimizerConfig
from .engine import GraphstepOptimizer, StepResult
from .factory import get_optimizer
from .kernels.muon import QKVSplit
from .parallel.collectives import CollectiveError
from .qk_clip import HeadLayout
from .run.debug import NanOrigin, StepReport
from .scheduler import ParamScheduler
from .step.scaler import ConstantLossScaler, DynamicLossScaler, scaler_from_config
from .wrap import CapturedOptimizer, wrap

__all__ = [
    "OptimizerConfig",
    "GraphstepOptimizer",
    "StepResult",
    "StepReport",
    "NanOrigin",
    "get_optimizer",
    "CollectiveError",
    "CheckpointError",
    "wrap",
    "CapturedOptimizer",
    "Layout",
    "ParamSpec",
    "plan_layout",
    "NamedPredicate",
    "ParamGroupOverride",
    "ParamKey",
    "check_config_overrides_consistency",
    "get_mup_config_overrides",
    "get_standard_config_overrides",
    "ConstantLossScaler",
    "DynamicLossScaler",
    "scaler_from_config",
    "ParamScheduler",
    "QKVSplit",
    "HeadLayout",
    "qk_clip",
    "fp8",
]
