"""QK-clip's public side, ``gs.qk_clip``: declare the attention layers (``register``), record their logits in
forward (``record``), and the capturable math for use outside the engine. A re-export of graphstep/step/qk_clip.py,
which owns QK-clip: its math, the registration and the step's stage."""

from .step.qk_clip import (BUFFER_NAME, HeadLayout, NotRegisteredError, Registration, clip_factors, clip_qk_,
                           record, record_max_logits, register, registrations, reset, row_factors, scale_flat_rows_,
                           shard_row_index)

__all__ = ["BUFFER_NAME", "HeadLayout", "NotRegisteredError", "Registration", "clip_factors", "clip_qk_", "record",
           "record_max_logits", "register", "registrations", "reset", "row_factors", "scale_flat_rows_",
           "shard_row_index"]
