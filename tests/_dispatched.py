"""``DispatchedOps``: the operators a block of code sends to the dispatcher, by name."""

from torch.utils._python_dispatch import TorchDispatchMode


class DispatchedOps(TorchDispatchMode):
    """The names of the operators dispatched inside it (``str(op)``, e.g. "graphstep.compiled_adam_.default")."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))
