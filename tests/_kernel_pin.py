"""Tests run ``kernel="auto"`` as "fused", unless a test is marked ``default_kernel``.

The default kernel is "auto": "compiled" where torch.compile works (graphstep/kernels/auto.py). Compiling
costs seconds per process and per layout, and most tests build many small optimizers to check something
other than the update math, several in spawned ranks: resolved to "compiled" everywhere, the suite would
pay a compile in every one of them. So ``kernel="auto"`` means "fused" here — torch's fused kernels, the
bitwise oracle those tests compare with — and the tests of the default itself (marked
``@pytest.mark.default_kernel``) see the real choice. conftest.py pins it around each test; spawned ranks
(tests/distributed/_harness.py) pin it at start.
"""

from graphstep.kernels import auto

_real_choose = auto.choose


def _auto_as_fused(configured, device, **options):
    if configured == "auto":
        return auto.KernelChoice("fused", "tests pin kernel='auto' to 'fused' (tests/_kernel_pin.py)")
    return _real_choose(configured, device, **options)


def pin_auto_to_fused(setattr_=setattr) -> None:
    """Make ``kernel="auto"`` choose "fused" (``setattr_``: pytest's ``monkeypatch.setattr`` to undo it)."""
    setattr_(auto, "choose", _auto_as_fused)


def assert_compiled_unless_inductor_cannot_compile(choice: "auto.KernelChoice") -> None:
    """``choice``, kernel="auto" resolved where a compile pays, is "compiled"; or "fused" because torch.compile
    raised here (no C++ compiler, an inductor that cannot compile for this CPU: the documented fallback, its
    error in the reason). Never "fused" because the compiled result differed from the reference: a miscompile
    on this machine is a failure, not a fallback."""
    if choice.name == "compiled":
        return
    assert choice.name == "fused" and "torch.compile does not work" in choice.reason, choice
    assert "differs from the reference" not in choice.reason, f"the compiled kernel miscompiles here: {choice}"
