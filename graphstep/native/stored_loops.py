"""The native loops over state stored below fp32 (stored_loops.cpp, loaded by graphstep/native/update_loops.py):
what graphstep/kernels/compiled_stored.py runs instead of its ``torch.compile``d passes on the CPU, bitwise the
same. ``stored_covers`` / ``adam_stored``: the unscaled encodings (bf16 moments, bf16 params with remainders), one
pass; ``scaled_covers`` / ``adam_scaled``: fp16 and fp8 moments and fp16 main params, scaled per piece, two
passes with the scales computed between them.
"""

from __future__ import annotations

import ctypes

import torch

from .update_loops import check_row, stored_library

# compiled_stored.py's encodings the native loop takes (stored_loops.cpp's ``Encoding``), each with the dtypes of
# its tensors: the main params' (f32, or bf16 params with remainders: two int16 tensors), the moments' (f32,
# bf16), the grads' (fp32 or bf16).
_STORED = {"f32": (0, (torch.float32,)), "bf16": (1, (torch.bfloat16,)), "rem": (2, (torch.int16, torch.int16))}
_GRADS = {torch.float32: 0, torch.bfloat16: 1}


def stored_covers(encodings: tuple, stored: tuple, grad: torch.Tensor) -> bool:
    """Whether the native loop can update one part stored with ``encodings`` (main params, exp_avg, exp_avg_sq;
    compiled_stored.py's codes) in ``stored`` (per kind its tensors), reading ``grad``: codes it takes, tensors
    of their dtypes, contiguous, on the CPU, all of one length."""
    main, exp_avg, exp_avg_sq = encodings
    if main not in ("f32", "rem") or {exp_avg, exp_avg_sq} - {"f32", "bf16"} or grad.dtype not in _GRADS:
        return False
    tensors = [grad, *(t for kind in stored for t in kind)]
    dtypes = [grad.dtype, *(d for code in encodings for d in _STORED[code][1])]
    return len(tensors) == len(dtypes) and all(
        t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous() and t.numel() == grad.numel()
        for t, dtype in zip(tensors, dtypes))


def adam_stored(encodings: tuple, stored: tuple, grad: torch.Tensor, coefficients: torch.Tensor) -> None:
    """One part's Adam in place over its stored main params and moments (``stored_covers`` holds for it), from
    one fp32 row of coefficients, with torch's thread count."""
    check_row(coefficients)
    (main, *main_low), (exp_avg,), (exp_avg_sq,) = stored
    codes = [_STORED[code][0] for code in encodings]
    failed = stored_library().graphstep_adam_stored(
        main.data_ptr(), main_low[0].data_ptr() if main_low else None, codes[0], exp_avg.data_ptr(), codes[1],
        exp_avg_sq.data_ptr(), codes[2], grad.data_ptr(), _GRADS[grad.dtype], grad.numel(),
        coefficients.data_ptr(), torch.get_num_threads())
    if failed:
        raise ValueError(f"the native loop takes no encodings {encodings} with {grad.dtype} grads")


# The scaled encodings (stored_loops.cpp's ``ScaledEncoding``) and their dtypes, for ``graphstep_adam_scaled``.
_SCALED = {**_STORED, "f16": (3, (torch.float16,)), "f8": (4, (torch.uint8,))}


def scaled_covers(encodings: tuple, stored: tuple, grad: torch.Tensor, index: tuple, scales: tuple) -> bool:
    """Whether ``adam_scaled`` can run one part stored with ``encodings`` (main params f32 / rem / f16; moments
    f32 / bf16 / f16 / f8) in ``stored``, reading ``grad`` (fp32 or bf16), with the part's ``index`` (per row its
    first piece, second piece, split) and per kind its pieces' ``scales`` (None where unscaled): all on the CPU,
    contiguous, of their dtypes and lengths."""
    main, exp_avg, exp_avg_sq = encodings
    if main not in ("f32", "rem", "f16") or {exp_avg, exp_avg_sq} - {"f32", "bf16", "f16", "f8"} \
            or grad.dtype not in _GRADS or grad.dim() != 2:
        return False
    tensors = [grad, *(t for kind in stored for t in kind)]
    dtypes = [grad.dtype, *(d for code in encodings for d in _SCALED[code][1])]
    first, second, split = index
    rows = grad.shape[0]
    return (len(tensors) == len(dtypes)
            and all(t.dtype == dtype and t.shape == grad.shape for t, dtype in zip(tensors, dtypes))
            and all(t.dtype == torch.int64 and t.shape == (rows,) for t in (first, second))
            and split.dtype == torch.float32 and split.shape == (rows,)
            and all(s is None or s.dtype == torch.float32 and s.dim() == 1 for s in scales)
            and all(t.device.type == "cpu" and t.is_contiguous()
                    for t in (*tensors, *index, *(s for s in scales if s is not None))))


def adam_scaled(pass_: int, encodings: tuple, stored: tuple, grad: torch.Tensor, index: tuple, scales: tuple,
                out: tuple, fp8_values: torch.Tensor, infinite: tuple, coefficients: torch.Tensor) -> None:
    """One pass of one part (``scaled_covers`` holds for it) over its pieces: pass 1 raises ``out[k]`` (per piece,
    for each scaled kind k) to the largest magnitude of the kind's new values, NaN counting 0 and inf
    ``infinite[k]``; pass 2 stores the new values, kind k scaled by ``out[k]`` (per piece, 1 / its new scale).
    ``scales[k]``: per piece, the scale kind k is stored with now; None where unscaled (``out[k]`` None too)."""
    check_row(coefficients)
    (main, *main_low), (exp_avg,), (exp_avg_sq,) = stored
    pointers = (ctypes.c_void_p * 3)(*(t.data_ptr() for t in (main, exp_avg, exp_avg_sq)))
    codes = (ctypes.c_int * 3)(*(_SCALED[code][0] for code in encodings))
    scale_pointers = (ctypes.c_void_p * 3)(*(None if s is None else s.data_ptr() for s in scales))
    out_pointers = (ctypes.c_void_p * 3)(*(None if o is None else o.data_ptr() for o in out))
    infinities = (ctypes.c_float * 3)(*infinite)
    first, second, split = index
    pieces = max((s.numel() for s in scales if s is not None), default=0)
    if first.numel() and (min(first.min(), second.min()) < 0 or max(first.max(), second.max()) >= pieces):
        raise ValueError(f"a row's piece lies outside the {pieces} pieces the scales have")  # the loop indexes them
    failed = stored_library().graphstep_adam_scaled(
        pass_, pointers, main_low[0].data_ptr() if main_low else None, codes, scale_pointers, grad.data_ptr(),
        _GRADS[grad.dtype], grad.shape[0], grad.shape[1], first.data_ptr(), second.data_ptr(), split.data_ptr(),
        pieces, out_pointers, fp8_values.data_ptr(), infinities, coefficients.data_ptr(), torch.get_num_threads())
    if failed:
        raise ValueError(f"the native loop takes no encodings {encodings} with {grad.dtype} grads")
