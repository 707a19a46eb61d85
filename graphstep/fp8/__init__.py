"""fp8 primary weights: per-tensor scaling math (``scaling``) and convertible fp8 Linear weights
(``params``); the optimizer requantizes them inside the step (graphstep/step/stages/requantize.py)."""

from .params import Fp8Linear, Fp8Meta, convert, dequantized, is_fp8
from .scaling import (AMAX_COMPUTE_ALGOS, FP8_DTYPES, FP8_MAX, RECIPES, amax, dequantize, fp8_max, quantize,
                      requantize_current, requantize_delayed, scale_from_amax, scale_from_history)

__all__ = ["Fp8Linear", "Fp8Meta", "convert", "dequantized", "is_fp8", "AMAX_COMPUTE_ALGOS", "FP8_DTYPES",
           "FP8_MAX", "RECIPES", "amax", "dequantize", "fp8_max", "quantize", "requantize_current",
           "requantize_delayed", "scale_from_amax", "scale_from_history"]
