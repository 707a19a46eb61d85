"""Checkpoints: the reshardable per-param format and torch.distributed.checkpoint (DCP) save/load.

- ``save(opt, path, model=None)`` / ``load(opt, path, model=None)`` / ``async_save(...)``: DCP, atomic,
  reshardable across data-parallel sizes and bucket layouts; loads copy in place (a captured step stays
  valid) and never unpickle (``dcp.py``).
- ``sharded_state_dict(opt)`` / ``load_sharded_state_dict(opt, sd)``: the format itself (``sharded.py``).
- ``OptimizerState(opt)``: the optimizer as a DCP ``Stateful``; ``get_optimizer_state_dict`` /
  ``set_optimizer_state_dict``: graphstep's counterparts of torch's (``torch_api.py``).

``opt.state_dict()`` (graphstep.checkpoint.state_dict) stays the exact flat format for ``torch.save`` flows.
"""

from .dcp import (CheckpointError, OptimizerState, SafeFileSystemReader, SafeLoadPlanner, async_save, load,
                  read_metadata, save)
from .sharded import FORMAT_VERSION, load_sharded_state_dict, sharded_state_dict
from .torch_api import get_optimizer_state_dict, placed_model_state_dict, set_optimizer_state_dict

__all__ = ["save", "load", "async_save", "read_metadata", "sharded_state_dict", "load_sharded_state_dict",
           "OptimizerState", "SafeFileSystemReader", "SafeLoadPlanner", "CheckpointError", "FORMAT_VERSION",
           "get_optimizer_state_dict", "set_optimizer_state_dict", "placed_model_state_dict"]
