// graphstep's compiled Adam loop (graphstep/kernels/compiled.py, ``_adam_loop``) over fp32 views, as a plain
// OpenMP loop: the same operations in the same order, each rounded once (no fused multiply-add, an exact
// square root and division), so that it updates bitwise as the torch.compile'd loop and eager torch ops do.
// graphstep/native/update_loops.py calls it through ctypes; it needs no torch headers, so it compiles in well
// under a second, and a process that finds it built runs its first step without starting dynamo or inductor.

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

GRAPHSTEP_WIDTHS
void adam_loop(float* __restrict__ param, const float* __restrict__ grad, float* __restrict__ exp_avg,
               float* __restrict__ exp_avg_sq, int64_t n, const float* __restrict__ c, int threads) {
  const float decay = c[DECAY], wd = c[WD], beta1 = c[BETA1], one_minus_beta1 = c[ONE_MINUS_BETA1];
  const float beta2 = c[BETA2], one_minus_beta2 = c[ONE_MINUS_BETA2], bc2_sqrt = c[BC2_SQRT], eps = c[EPS];
  const float step_size = c[STEP_SIZE], scale = c[SCALE];
#pragma omp parallel for simd num_threads(threads) schedule(static)
  for (int64_t i = 0; i < n; i++) {
    // Python's left-to-right order of _adam_loop: ``g * g * c`` is ``(g * g) * c``, ``s * m / d`` is ``(s * m) / d``.
    const float g = grad[i] / scale + param[i] * wd;
    const float m = exp_avg[i] * beta1 + g * one_minus_beta1;
    const float v = exp_avg_sq[i] * beta2 + g * g * one_minus_beta2;
    const float denom = std::sqrt(v) / bc2_sqrt + eps;
    param[i] = param[i] * decay - step_size * m / denom;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
  }
}

}  // namespace

extern "C" {

// One view's update; a skipped step (``c[KEEP]`` not > 0) writes nothing, which leaves every value bitwise as
// it was, as ``torch.where`` does in _adam_loop.
void graphstep_adam_fp32(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n,
                         const float* coefficients, int threads) {
  if (!(coefficients[KEEP] > 0)) {
    return;
  }
  adam_loop(param, grad, exp_avg, exp_avg_sq, n, coefficients, threads < 1 ? 1 : threads);
}

}  // extern "C"
