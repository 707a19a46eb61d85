// graphstep's compiled Adam loop over fp32 views (graphstep/kernels/compiled.py, ``adam_values``) as a plain
// OpenMP loop: the same operations in the same order, each rounded once (no fused multiply-add, an exact square
// root and division), so that it updates bitwise as the torch.compile'd loop and eager torch ops do. Also the
// grad norm's rows (graphstep/kernels/row_norms.py), which every fp32 step on the CPU reads.
// graphstep/native/update_loops.py calls it through ctypes; it needs no torch headers, so it compiles in under a
// second, and a process that finds it built runs its first step without starting dynamo or inductor. The loops
// over state stored below fp32 are stored_loops.cpp, a library of their own: only a step that stores state so
// compiles them.

#include <algorithm>

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

// Rows of the grads' norm are summed in ``LANES`` lanes, each a fixed sequence of squares, then the lanes in
// order: one order of operations at every vector width and thread count. Four rows at a time per thread, so that
// each thread reads four streams: a read alone is slower here than a read and a write, one stream per thread.
constexpr int64_t LANES = 16;
constexpr int64_t ROWS_AT_ONCE = 4;

GRAPHSTEP_WIDTHS
void row_norms(const float* __restrict__ rows, int64_t count, int64_t length, float* __restrict__ out,
               int threads) {
  const int64_t groups = (count + ROWS_AT_ONCE - 1) / ROWS_AT_ONCE;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t group = 0; group < groups; group++) {
    const int64_t first = group * ROWS_AT_ONCE;
    const int64_t here = std::min(ROWS_AT_ONCE, count - first);
    float sums[ROWS_AT_ONCE][LANES] = {};
    for (int64_t at = 0; at < length; at += LANES) {
      for (int64_t r = 0; r < here; r++) {
        const float* values = rows + (first + r) * length + at;
#pragma omp simd
        for (int64_t lane = 0; lane < LANES; lane++) sums[r][lane] += values[lane] * values[lane];
      }
    }
    for (int64_t r = 0; r < here; r++) {
      float total = 0.0f;
      for (int64_t lane = 0; lane < LANES; lane++) total += sums[r][lane];
      out[first + r] = std::sqrt(total);
    }
  }
}

}  // namespace

extern "C" {

// The fp32 norm of each of ``count`` rows of ``length`` fp32 elements (a multiple of ``LANES``) into ``out``.
void graphstep_row_norms(const float* rows, int64_t count, int64_t length, float* out, int threads) {
  row_norms(rows, count, length, out, threads < 1 ? 1 : threads);
}

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
