// graphstep's compiled Adam loops as plain OpenMP loops: over fp32 views (graphstep/kernels/compiled.py,
// ``adam_values``), and over main params and moments stored in bf16 or as bf16 params with remainders
// (graphstep/kernels/compiled_stored.py, its unscaled encodings). The same operations in the same order, each
// rounded once (no fused multiply-add, an exact square root and division), so that they update bitwise as the
// torch.compile'd loops and eager torch ops do. graphstep/native/update_loops.py calls them through ctypes; they
// need no torch headers, so they compile in well under a second, and a process that finds them built runs its
// first step without starting dynamo or inductor.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

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
    // Python's left-to-right order of adam_values: ``g * g * c`` is ``(g * g) * c``, ``s * m / d`` is ``(s * m) / d``.
    const float g = grad[i] / scale + param[i] * wd;
    const float m = exp_avg[i] * beta1 + g * one_minus_beta1;
    const float v = exp_avg_sq[i] * beta2 + g * g * one_minus_beta2;
    const float denom = std::sqrt(v) / bc2_sqrt + eps;
    param[i] = param[i] * decay - step_size * m / denom;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
  }
}

// How a stored kind is encoded (graphstep/kernels/compiled_stored.py's ``ENCODINGS`` that need no scale).
enum Encoding { F32 = 0, BF16 = 1, REM = 2 };

inline float from_bits(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

inline uint32_t to_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

// fp32 to bf16 as torch's vectorized CPU cast does: round to nearest even, every NaN 0xFFFF (torch's scalar cast
// and inductor's pass store 0x7FC0; all read back as NaN). Branch-free, so that the loop vectorizes.
inline uint16_t to_bf16(float value) {
  const uint32_t bits = to_bits(value);
  const uint32_t nan = 0u - static_cast<uint32_t>(value != value);
  return static_cast<uint16_t>(((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) | nan);
}

// What a kind's tensor holds: fp32 values, or 16-bit patterns (bf16 values, a bf16 param's bits, a low half).
template <int CODE>
using Stored = std::conditional_t<CODE == F32, float, uint16_t>;

template <int CODE>
inline float load(const Stored<CODE>* data, const uint16_t* low, int64_t i) {
  if constexpr (CODE == F32) {
    return data[i];
  } else if constexpr (CODE == BF16) {
    return from_bits(uint32_t{data[i]} << 16);
  } else {  // REM: the bf16 param's bits and the low half that precision.RemainderMain keeps
    const uint32_t low_half = low[i];
    const uint32_t high_half = (data[i] - (low_half >> 15)) & 0xFFFF;
    return from_bits((high_half << 16) | low_half);
  }
}

template <int CODE>
inline void store(Stored<CODE>* data, uint16_t* low, int64_t i, float value) {
  if constexpr (CODE == F32) {
    data[i] = value;
  } else if constexpr (CODE == BF16) {
    data[i] = to_bf16(value);
  } else {  // REM: the high half rounded by the low half's top bit, so the bf16 param is the nearest
    const uint32_t bits = to_bits(value);
    const uint32_t low_half = bits & 0xFFFF;
    data[i] = static_cast<uint16_t>(((bits >> 16) + (low_half >> 15)) & 0xFFFF);
    low[i] = static_cast<uint16_t>(low_half);
  }
}

// compiled_stored.py's ``_new_values`` and ``_encode`` for unscaled encodings: decode, adam_values' arithmetic,
// the skip selected (a skipped step, ``KEEP`` false, stores the decoded old values again, as torch.where there
// does), encode.
template <int MAIN, int EXP_AVG, int EXP_AVG_SQ, int GRAD, bool KEEP_NEW>
GRAPHSTEP_WIDTHS void stored_loop(void* main_data, void* main_low_data, void* exp_avg_data, void* exp_avg_sq_data,
                                  const void* grad_data, int64_t n, const float* __restrict__ c, int threads) {
  auto* __restrict__ main = static_cast<Stored<MAIN>*>(main_data);
  auto* __restrict__ main_low = static_cast<uint16_t*>(main_low_data);
  auto* __restrict__ exp_avg = static_cast<Stored<EXP_AVG>*>(exp_avg_data);
  auto* __restrict__ exp_avg_sq = static_cast<Stored<EXP_AVG_SQ>*>(exp_avg_sq_data);
  const auto* __restrict__ grad = static_cast<const Stored<GRAD>*>(grad_data);
  const float decay = c[DECAY], wd = c[WD], beta1 = c[BETA1], one_minus_beta1 = c[ONE_MINUS_BETA1];
  const float beta2 = c[BETA2], one_minus_beta2 = c[ONE_MINUS_BETA2], bc2_sqrt = c[BC2_SQRT], eps = c[EPS];
  const float step_size = c[STEP_SIZE], scale = c[SCALE];
#pragma omp parallel for simd num_threads(threads) schedule(static)
  for (int64_t i = 0; i < n; i++) {
    const float param = load<MAIN>(main, main_low, i);
    const float m_old = load<EXP_AVG>(exp_avg, nullptr, i);
    const float v_old = load<EXP_AVG_SQ>(exp_avg_sq, nullptr, i);
    const float g = load<GRAD>(grad, nullptr, i) / scale + param * wd;
    const float m = m_old * beta1 + g * one_minus_beta1;
    const float v = v_old * beta2 + g * g * one_minus_beta2;
    const float denom = std::sqrt(v) / bc2_sqrt + eps;
    const float new_param = param * decay - step_size * m / denom;
    store<MAIN>(main, main_low, i, KEEP_NEW ? new_param : param);
    store<EXP_AVG>(exp_avg, nullptr, i, KEEP_NEW ? m : m_old);
    store<EXP_AVG_SQ>(exp_avg_sq, nullptr, i, KEEP_NEW ? v : v_old);
  }
}

using StoredLoop = void (*)(void*, void*, void*, void*, const void*, int64_t, const float*, int);

template <int MAIN, int EXP_AVG, int EXP_AVG_SQ, int GRAD>
StoredLoop pick_keep(bool keep) {
  return keep ? stored_loop<MAIN, EXP_AVG, EXP_AVG_SQ, GRAD, true>
              : stored_loop<MAIN, EXP_AVG, EXP_AVG_SQ, GRAD, false>;
}

template <int MAIN, int EXP_AVG, int EXP_AVG_SQ>
StoredLoop pick_grad(int grad, bool keep) {
  return grad == F32 ? pick_keep<MAIN, EXP_AVG, EXP_AVG_SQ, F32>(keep)
                     : pick_keep<MAIN, EXP_AVG, EXP_AVG_SQ, BF16>(keep);
}

template <int MAIN, int EXP_AVG>
StoredLoop pick_exp_avg_sq(int exp_avg_sq, int grad, bool keep) {
  return exp_avg_sq == F32 ? pick_grad<MAIN, EXP_AVG, F32>(grad, keep) : pick_grad<MAIN, EXP_AVG, BF16>(grad, keep);
}

template <int MAIN>
StoredLoop pick_exp_avg(int exp_avg, int exp_avg_sq, int grad, bool keep) {
  return exp_avg == F32 ? pick_exp_avg_sq<MAIN, F32>(exp_avg_sq, grad, keep)
                        : pick_exp_avg_sq<MAIN, BF16>(exp_avg_sq, grad, keep);
}

}  // namespace

extern "C" {

// One part's Adam over main params, moments and grads each in one of its encodings: main F32 or REM (``main``
// the bf16 params' bits, ``main_low`` the low halves), moments F32 or BF16, grads F32 or BF16. Returns 0, or -1
// for an encoding it does not take (nothing is written then).
int graphstep_adam_stored(void* main, void* main_low, int main_code, void* exp_avg, int exp_avg_code,
                          void* exp_avg_sq, int exp_avg_sq_code, const void* grad, int grad_code, int64_t n,
                          const float* coefficients, int threads) {
  const auto valid = [](int code, bool remainder) {
    return code == F32 || code == BF16 || (remainder && code == REM);
  };
  if (main_code == BF16 || !valid(main_code, true) || !valid(exp_avg_code, false) ||
      !valid(exp_avg_sq_code, false) || !valid(grad_code, false)) {
    return -1;
  }
  const bool keep = coefficients[KEEP] > 0;
  const StoredLoop loop = main_code == F32 ? pick_exp_avg<F32>(exp_avg_code, exp_avg_sq_code, grad_code, keep)
                                           : pick_exp_avg<REM>(exp_avg_code, exp_avg_sq_code, grad_code, keep);
  loop(main, main_low, exp_avg, exp_avg_sq, grad, n, coefficients, threads < 1 ? 1 : threads);
  return 0;
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
