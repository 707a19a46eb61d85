"""The default kernel's verdict as tests check it.

Tests run ``kernel="auto"`` for real: on their small models it chooses "fused" without compiling (fewer
elements than ``COMPILE_MIN_NUMEL``), as it does for a user's small model. Tests marked ``auto_as_large`` see
their small model judged as a large one (conftest.py sets ``COMPILE_MIN_NUMEL`` to 0), so "auto" probes and
compiles where torch.compile works.
"""

from graphstep.kernels import auto


def assert_compiled_unless_inductor_cannot_compile(choice: "auto.KernelChoice") -> None:
    """``choice``, kernel="auto" resolved where a compile pays, is "compiled"; or "fused" because torch.compile
    raised here (no C++ compiler, an inductor that cannot compile for this CPU: the documented fallback, its
    error in the reason). Never "fused" because the compiled result differed from the reference: a miscompile
    on this machine is a failure, not a fallback."""
    if choice.name == "compiled":
        return
    assert choice.name == "fused" and "torch.compile does not work" in choice.reason, choice
    assert "differs from the reference" not in choice.reason, f"the compiled kernel miscompiles here: {choice}"
