// graphstep's compiled Adam loop over fp32 views (graphstep/kernels/compiled.py, ``adam_values``) as a plain
// OpenMP loop: the same operations in the same order, each rounded once (no fused multiply-add, an exact square
// root and division), so that it updates bitwise as the torch.compile'd loop and eager torch ops do.
// graphstep/native/update_loops.py calls it through ctypes; it needs no torch headers, so it compiles in under a
// second, and a process that finds it built runs its first step without starting dynamo or inductor. The loops
// over state stored below fp32 are stored_loops.cpp, a library of their own: only a step that stores state so
// compiles them.

#include "adam_element.h"

namespace {

GRAPHSTEP_WIDTHS
void adam_loop(float* __restrict__ param, const float* __restrict__ grad, float* __restrict__ exp_avg,
               float* __restrict__ exp_avg_sq, int64_t n, const float* __restrict__ c, int threads) {
  const Adam adam(c);
#pragma omp parallel for simd num_threads(threads) schedule(static)
  for (int64_t i = 0; i < n; i++) {
    float p = param[i], m = exp_avg[i], v = exp_avg_sq[i];
    adam(grad[i], p, m, v);
    param[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
  }
}

}  // namespace

extern "C" {

// One view's update; a skipped step (``c[KEEP]`` not > 0) writes nothing, which leaves every value bitwise as
// it was, as ``torch.where`` does in adam_values.
void graphstep_adam_fp32(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n,
                         const float* coefficients, int threads) {
  if (!(coefficients[KEEP] > 0)) {
    return;
  }
  adam_loop(param, grad, exp_avg, exp_avg_sq, n, coefficients, threads < 1 ? 1 : threads);
}

}  // extern "C"
