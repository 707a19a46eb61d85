// What graphstep's native Adam loops share (update_loops.cpp over fp32 views, stored_loops.cpp over state
// stored below fp32): the coefficient row's layout, the widths each loop is compiled for, and Adam's arithmetic
// for one element, so that every loop rounds alike. Both libraries' cache keys include this file
// (graphstep/native/update_loops.py).

#pragma once

#include <cmath>
#include <cstdint>

namespace {

// Positions in the coefficient row (graphstep/kernels/compiled.py, ``_DECAY`` ... ``_KEEP``).
enum Coefficient { DECAY, WD, BETA1, ONE_MINUS_BETA1, BETA2, ONE_MINUS_BETA2, BC2_SQRT, EPS, STEP_SIZE, SCALE, KEEP };

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// One build for every x86 machine: the loop is compiled for each width and the widest the CPU has is picked
// when the library loads. The arithmetic, and so every bit of the result, is the same at each width.
#define GRAPHSTEP_WIDTHS __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define GRAPHSTEP_WIDTHS
#endif

// adam_values' arithmetic for one element, in Python's left-to-right order (``g * g * c`` is ``(g * g) * c``,
// ``s * m / d`` is ``(s * m) / d``): every loop below runs it, so they all round alike.
struct Adam {
  float decay, wd, beta1, one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps, step_size, scale;

  explicit Adam(const float* c)
      : decay(c[DECAY]), wd(c[WD]), beta1(c[BETA1]), one_minus_beta1(c[ONE_MINUS_BETA1]), beta2(c[BETA2]),
        one_minus_beta2(c[ONE_MINUS_BETA2]), bc2_sqrt(c[BC2_SQRT]), eps(c[EPS]), step_size(c[STEP_SIZE]),
        scale(c[SCALE]) {}

  // The new (param, exp_avg, exp_avg_sq) into ``param``, ``m``, ``v``, from the old ones and the grad.
  __attribute__((always_inline)) inline void operator()(float grad, float& param, float& m, float& v) const {
    moments(grad, param, m, v);
    const float denom = std::sqrt(v) / bc2_sqrt + eps;
    param = param * decay - step_size * m / denom;
  }

  // The new moments alone (the old ``param`` still read: coupled weight decay adds it to the grad).
  __attribute__((always_inline)) inline void moments(float grad, float param, float& m, float& v) const {
    const float g = grad / scale + param * wd;
    m = m * beta1 + g * one_minus_beta1;
    v = v * beta2 + g * g * one_minus_beta2;
  }
};

}  // namespace
