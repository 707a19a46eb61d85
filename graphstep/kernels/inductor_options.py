"""The inductor options graphstep's compiled kernels are compiled with, and the checks on them.

The update's own options (``COMPILE_OPTIONS``), and on the CPU the vector width inductor generates code for,
named so that inductor's on-disk cache keeps the code of each width apart (``vector_width_option``).
"""

from __future__ import annotations


COMPILE_OPTIONS = {"size_asserts": False, "cpp.dynamic_threads": True}
"""The inductor options of every compiled update (why each: graphstep/kernels/compiled.py, ``_compiled``);
``compile_options`` adds the CPU's vector width."""


def compile_options(device_type: str) -> dict:
    """``COMPILE_OPTIONS`` for a compile on ``device_type``, with its ``vector_width_option``."""
    return {**COMPILE_OPTIONS, **vector_width_option(device_type)}


def vector_width_option(device_type: str) -> dict:
    """On the CPU, ``cpp.simdlen`` set to the vector width inductor generates code for in this process
    (``cpu_vector_isa``), the width it would pick anyway; nothing elsewhere. Every CPU compile of graphstep's
    needs it among its options.

    Why name it: inductor's on-disk cache of compiled graphs keys an entry by the graph and the inductor
    options, not by the vector instruction set its C++ was generated for, and compiles a hit's C++ for the
    instruction set of the process that loads it. A process with another width than the one that filled
    the cache (``ATEN_CPU_CAPABILITY=avx2`` on an AVX-512 machine, or a cache shared between machines) then
    ran loops stepping 16 floats over vectors of 8, so half of every row was never updated, and under
    ``ATEN_CPU_CAPABILITY=default`` the C++ did not compile. With the width among the options, each width
    has its own cache entries."""
    if device_type != "cpu":
        return {}
    return {"cpp.simdlen": cpu_vector_isa().bit_width()}


def cpu_vector_isa():
    """The vector instruction set inductor generates CPU code for in this process (its ``pick_vec_isa``:
    the widest the CPU has, or the one ``ATEN_CPU_CAPABILITY`` names; bit width 0 for none)."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    return pick_vec_isa()


def missing_compile_options(options: dict) -> list[str]:
    """The keys of ``options`` this torch's inductor does not know (it would raise at the first compiled
    call, i.e. in the first step); empty where it knows them all."""
    try:
        from torch._inductor import config as inductor_config
        known = inductor_config.get_config_copy()
    except Exception as error:  # no inductor in this build
        return [f"{key} (inductor unavailable: {type(error).__name__})" for key in options]
    return [key for key in options if key not in known]
