"""The whole training iteration (forward and backward of every micro-batch, the optimizer step) as one graph:
``graphstep.Iteration`` (iteration.py); its static inputs per signature (inputs.py), what it watches on the
model (model_watch.py), and the optimizer's parts it runs (engine_parts.py)."""
from .iteration import Iteration, IterationResult

__all__ = ["Iteration", "IterationResult"]
