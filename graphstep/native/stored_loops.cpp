// graphstep's compiled Adam passes over main params and moments stored below fp32
// (graphstep/kernels/compiled_stored.py) as plain OpenMP loops: bf16 moments and bf16 params with remainders in
// one pass, fp16 and fp8 moments and fp16 main params (scaled per piece) in its two. The same operations in the
// same order as those passes (adam_element.h's arithmetic between a decode and an encode), so that they store
// the same bytes. graphstep/native/update_loops.py calls them through ctypes.

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#endif

#include "adam_element.h"

namespace {

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

// ``yes`` where ``condition``, else ``no``: as a mask, not a branch, so that GCC vectorizes the loops below.
inline uint32_t pick(bool condition, uint32_t yes, uint32_t no) {
  return no ^ ((yes ^ no) & (0u - static_cast<uint32_t>(condition)));
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
  const Adam adam(c);
#pragma omp parallel for simd num_threads(threads) schedule(static)
  for (int64_t i = 0; i < n; i++) {
    const float param = load<MAIN>(main, main_low, i);
    const float m_old = load<EXP_AVG>(exp_avg, nullptr, i);
    const float v_old = load<EXP_AVG_SQ>(exp_avg_sq, nullptr, i);
    float new_param = param, m = m_old, v = v_old;
    adam(load<GRAD>(grad, nullptr, i), new_param, m, v);
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

// ---- scaled kinds (fp16 / fp8 moments, fp16 main params): compiled_stored.py's two passes ---------------------

// Encodings beyond the unscaled ones (compiled_stored.py's "f16", "f8"): stored scaled by a per-piece scale.
enum ScaledEncoding { F16 = 3, F8 = 4 };

// fp32 to float8_e4m3fn as torch's CPU cast does here: round to nearest even, every magnitude from 448 up
// (and inf) saturated to 448, NaN 0x7F with its sign. Branch-free, so that a block of them vectorizes.
inline uint8_t to_e4m3(float value) {
  const uint32_t bits = to_bits(value);
  const uint32_t sign = (bits >> 24) & 0x80;
  const uint32_t magnitude = bits & 0x7FFFFFFF;
  // Below 2^-6 (subnormal in e4m3): the sum with 2^-5 * 2^3 ... rounds the value to a multiple of 2^-9 in fp32's
  // own rounding, and the low bits are then the e4m3 subnormal's.
  const uint32_t denormal_base = 141u << 23;
  const uint32_t subnormal = to_bits(from_bits(magnitude) + from_bits(denormal_base)) - denormal_base;
  const uint32_t odd = (magnitude >> 20) & 1;
  const uint32_t normal = (magnitude + (static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFF + odd) >> 20;
  uint32_t out = pick(magnitude < (121u << 23), subnormal, normal);
  out = pick(magnitude >= 0x43E00000u, 0x7E, out);  // 448 and above, inf too
  out = pick(magnitude > 0x7F800000u, 0x7F, out);   // NaN
  return static_cast<uint8_t>(out | sign);
}

// fp16 bits to fp32, exactly: in integer arithmetic, so that a block of them vectorizes on every target.
inline float from_f16(uint16_t half) {
  const uint32_t sign = static_cast<uint32_t>(half & 0x8000) << 16;
  const uint32_t exponent = (half >> 10) & 0x1F, mantissa = half & 0x3FF;
  const uint32_t normal = sign | ((exponent + 112) << 23) | (mantissa << 13);
  const uint32_t special = sign | 0x7F800000u | (mantissa << 13);  // inf, NaN
  const uint32_t subnormal = sign | to_bits(static_cast<float>(mantissa) * 0x1p-24f);  // exact: m < 2^10
  return from_bits(pick(exponent == 0, subnormal, pick(exponent == 31, special, normal)));
}

// fp32 to fp16 bits as torch's cast does: round to nearest even, inf from 65520 up, NaN 0x7E00 with its sign.
inline uint16_t to_f16(float value) {
  const uint32_t bits = to_bits(value);
  const uint32_t sign = (bits >> 16) & 0x8000;
  const uint32_t magnitude = bits & 0x7FFFFFFF;
  // Normal: the exponent rebiased, the mantissa rounded to 10 bits (a carry into the exponent is right).
  const uint32_t normal = (magnitude - 0x38000000u + 0xFFF + ((magnitude >> 13) & 1)) >> 13;
  // Below 2^-14: in units of 2^-24, rounded by fp32's own addition to 0.5 (whose ulp is 2^-24).
  const uint32_t subnormal = to_bits(from_bits(magnitude) + 0.5f) - to_bits(0.5f);
  uint32_t out = pick(magnitude < 0x38800000u, subnormal, normal);
  out = pick(magnitude >= 0x477FF000u, 0x7C00, out);  // rounds to 65536 or more: inf
  out = pick(magnitude > 0x7F800000u, 0x7E00, out);   // NaN
  return static_cast<uint16_t>(out | sign);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// The CPU's own fp16 conversions (F16C: round to nearest even, as torch's vectorized cast uses them), eight at a
// time, where it has them; the integer versions above for the rest. The same bits either way, but for a NaN's.
__attribute__((target("avx2,f16c"))) void from_f16_block_f16c(const uint16_t* in, int64_t n, float scale,
                                                              float* out) {
  const __m256 by = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 values = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i)));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(values, by));
  }
  for (; i < n; i++) out[i] = from_f16(in[i]) * scale;
}

__attribute__((target("avx2,f16c"))) void to_f16_block_f16c(const float* in, int64_t n, float inverse,
                                                            uint16_t* out) {
  const __m256 by = _mm256_set1_ps(inverse);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 values = _mm256_mul_ps(_mm256_loadu_ps(in + i), by);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_cvtps_ph(values, _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < n; i++) out[i] = to_f16(in[i] * inverse);
}

const bool has_f16c = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
#else
constexpr bool has_f16c = false;
inline void from_f16_block_f16c(const uint16_t*, int64_t, float, float*) {}
inline void to_f16_block_f16c(const float*, int64_t, float, uint16_t*) {}
#endif

constexpr int64_t BLOCK = 256;

// One kind of a part: its tensor (``low``: a remainder's low halves), its encoding, and per piece its scale
// (scaled encodings only).
struct Kind {
  void* data;
  uint16_t* low;
  int code;
  const float* scales;
};

// ``n`` values of a kind from element ``at``, as compiled_stored.py's ``_decode`` (``scale``: the piece's).
GRAPHSTEP_WIDTHS void decode(const Kind& kind, int64_t at, int64_t n, float scale, const float* fp8_values,
                             float* __restrict__ out) {
  switch (kind.code) {
    case F32: {
      const float* data = static_cast<const float*>(kind.data) + at;
      for (int64_t i = 0; i < n; i++) out[i] = data[i];
      break;
    }
    case BF16: {
      const uint16_t* data = static_cast<const uint16_t*>(kind.data) + at;
      for (int64_t i = 0; i < n; i++) out[i] = from_bits(uint32_t{data[i]} << 16);
      break;
    }
    case REM: {
      const uint16_t* data = static_cast<const uint16_t*>(kind.data) + at;
      for (int64_t i = 0; i < n; i++) out[i] = load<REM>(data, kind.low + at, i);
      break;
    }
    case F16: {
      const uint16_t* data = static_cast<const uint16_t*>(kind.data) + at;
      if (has_f16c) {
        from_f16_block_f16c(data, n, scale, out);
      } else {
        for (int64_t i = 0; i < n; i++) out[i] = from_f16(data[i]) * scale;
      }
      break;
    }
    default: {  // F8: through the table of each byte's value (infinities for the NaN bytes)
      const uint8_t* data = static_cast<const uint8_t*>(kind.data) + at;
      for (int64_t i = 0; i < n; i++) out[i] = fp8_values[data[i]] * scale;
    }
  }
}

// ``n`` values into a kind from element ``at``, as ``_encode`` (``inverse``: 1 / the piece's new scale).
GRAPHSTEP_WIDTHS void encode(const Kind& kind, int64_t at, int64_t n, float inverse,
                             const float* __restrict__ values) {
  switch (kind.code) {
    case F32: {
      float* data = static_cast<float*>(kind.data) + at;
      for (int64_t i = 0; i < n; i++) data[i] = values[i];
      break;
    }
    case BF16: {
      uint16_t* data = static_cast<uint16_t*>(kind.data) + at;
      for (int64_t i = 0; i < n; i++) data[i] = to_bf16(values[i]);
      break;
    }
    case REM: {
      uint16_t* data = static_cast<uint16_t*>(kind.data) + at;
      for (int64_t i = 0; i < n; i++) store<REM>(data, kind.low + at, i, values[i]);
      break;
    }
    case F16: {
      uint16_t* data = static_cast<uint16_t*>(kind.data) + at;
      if (has_f16c) {
        to_f16_block_f16c(values, n, inverse, data);
      } else {
        for (int64_t i = 0; i < n; i++) data[i] = to_f16(values[i] * inverse);
      }
      break;
    }
    default: {  // F8: an infinite value's byte is the NaN byte of its sign, one above the saturated 448
      uint8_t* data = static_cast<uint8_t*>(kind.data) + at;
      for (int64_t i = 0; i < n; i++) {
        const uint8_t infinite = (to_bits(values[i]) & 0x7FFFFFFF) == 0x7F800000u;
        data[i] = to_e4m3(values[i] * inverse) | infinite;
      }
    }
  }
}

// The largest of ``_magnitudes`` over ``n`` values, from ``so_far``: NaN counts 0, inf ``infinite``. As fp32
// bits, which order non-negative values as the values do.
GRAPHSTEP_WIDTHS uint32_t largest_magnitude(const float* __restrict__ values, int64_t n, float infinite,
                                            uint32_t so_far) {
  for (int64_t i = 0; i < n; i++) {
    const uint32_t magnitude = to_bits(values[i]) & 0x7FFFFFFF;  // as fp32 bits: ordered as the values are
    const uint32_t counted =
        pick(magnitude == 0x7F800000u, to_bits(infinite), pick(magnitude > 0x7F800000u, 0, magnitude));
    so_far = std::max(so_far, counted);
  }
  return so_far;
}

struct ScaledCall {
  Kind kinds[3];  // main params, exp_avg, exp_avg_sq
  const void* grad;
  int grad_code;
  int64_t rows, width;
  const int64_t* first;  // per row, the piece of its elements left of ``split``, and of those right of it
  const int64_t* second;
  const float* split;
  int64_t pieces;
  const float* fp8_values;
  const float* infinite;  // per kind, the magnitude an infinite value counts as
};

// Every row's pieces (at most two: left and right of its split) in blocks; ``block(piece, at, n)`` runs each.
template <typename Block>
void for_each_block(const ScaledCall& call, Block&& block) {
#pragma omp for schedule(static)
  for (int64_t r = 0; r < call.rows; r++) {
    const float split = call.split[r];
    const int64_t cut = split <= 0 ? 0 : split >= call.width ? call.width : static_cast<int64_t>(std::ceil(split));
    const int64_t ends[2][2] = {{0, cut}, {cut, call.width}};
    const int64_t pieces[2] = {call.first[r], call.second[r]};
    for (int side = 0; side < 2; side++) {
      for (int64_t at = ends[side][0]; at < ends[side][1]; at += BLOCK) {
        const int64_t n = std::min(BLOCK, ends[side][1] - at);
        block(pieces[side], r * call.width + at, n);
      }
    }
  }
}

// One block's new values of the three kinds (the skip selected), from the stored ones and the grads; without
// ``with_param``, the moments' alone (``values[0]`` is then left as it was): all the first pass needs where
// the main params are not scaled, and the costliest part of the update left out.
GRAPHSTEP_WIDTHS void new_values(const ScaledCall& call, int64_t piece, int64_t at, int64_t n, const float* c,
                                 bool with_param, float (*values)[BLOCK]) {
  float grad[BLOCK], old[3][BLOCK];
  for (int k = 0; k < 3; k++) {
    const Kind& kind = call.kinds[k];
    decode(kind, at, n, kind.scales != nullptr ? kind.scales[piece] : 1.0f, call.fp8_values, old[k]);
  }
  decode(Kind{const_cast<void*>(call.grad), nullptr, call.grad_code, nullptr}, at, n, 1.0f, nullptr, grad);
  const Adam adam(c);
  const bool keep = c[KEEP] > 0;
  if (!with_param) {
    for (int64_t i = 0; i < n; i++) {
      float m = old[1][i], v = old[2][i];
      adam.moments(grad[i], old[0][i], m, v);
      values[1][i] = keep ? m : old[1][i];
      values[2][i] = keep ? v : old[2][i];
    }
    return;
  }
  for (int64_t i = 0; i < n; i++) {
    float p = old[0][i], m = old[1][i], v = old[2][i];
    adam(grad[i], p, m, v);
    values[0][i] = keep ? p : old[0][i];
    values[1][i] = keep ? m : old[1][i];
    values[2][i] = keep ? v : old[2][i];
  }
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


// A part's pass over kinds of which some are scaled (``scales`` of a kind non-null): ``pass`` 1 writes into
// ``out[k]`` (per piece, zeros at first) the largest magnitude of kind k's new values (``_new_scales``); pass 2
// stores the new values, kind k scaled by ``out[k]`` (per piece, 1 / its new scale; ``_store``). ``codes``:
// main params F32, REM or F16; moments F32, BF16, F16 or F8; grads F32 or BF16. Returns 0, or -1 for an
// encoding it does not take (nothing is written then).
int graphstep_adam_scaled(int pass, void* const* data, uint16_t* main_low, const int* codes,
                          const float* const* scales, const void* grad, int grad_code, int64_t rows, int64_t width,
                          const int64_t* first, const int64_t* second, const float* split, int64_t pieces,
                          float* const* out, const float* fp8_values, const float* infinite,
                          const float* coefficients, int threads) {
  const bool main_ok = codes[0] == F32 || codes[0] == REM || codes[0] == F16;
  const auto moment_ok = [](int code) { return code == F32 || code == BF16 || code == F16 || code == F8; };
  if (!main_ok || !moment_ok(codes[1]) || !moment_ok(codes[2]) || (grad_code != F32 && grad_code != BF16) ||
      (pass != 1 && pass != 2)) {
    return -1;
  }
  ScaledCall call{{}, grad, grad_code, rows, width, first, second, split, pieces, fp8_values, infinite};
  for (int k = 0; k < 3; k++) {
    call.kinds[k] = Kind{data[k], k == 0 ? main_low : nullptr, codes[k], scales[k]};
  }
#pragma omp parallel num_threads(threads < 1 ? 1 : threads)
  {
    float values[3][BLOCK];
    if (pass == 1) {
      std::vector<uint32_t> largest(3 * pieces, 0);  // this thread's, merged below (a max: any order is exact)
      const bool main_scaled = out[0] != nullptr;
      for_each_block(call, [&](int64_t piece, int64_t at, int64_t n) {
        new_values(call, piece, at, n, coefficients, main_scaled, values);
        for (int k = 0; k < 3; k++) {
          if (out[k] != nullptr) {
            uint32_t& so_far = largest[k * pieces + piece];
            so_far = largest_magnitude(values[k], n, infinite[k], so_far);
          }
        }
      });
#pragma omp critical
      for (int k = 0; k < 3; k++) {
        for (int64_t p = 0; out[k] != nullptr && p < pieces; p++) {
          out[k][p] = std::max(out[k][p], from_bits(largest[k * pieces + p]));
        }
      }
    } else {
      for_each_block(call, [&](int64_t piece, int64_t at, int64_t n) {
        new_values(call, piece, at, n, coefficients, true, values);
        for (int k = 0; k < 3; k++) {
          encode(call.kinds[k], at, n, out[k] != nullptr ? out[k][piece] : 1.0f, values[k]);
        }
      });
    }
  }
  return 0;
}

// float8_e4m3fn bytes of ``n`` values, as the scaled pass stores them (before its infinity mark), and the fp16
// casts both ways: what the tests check against torch's casts over every exponent.
void graphstep_to_e4m3(const float* values, uint8_t* out, int64_t n) {
  for (int64_t i = 0; i < n; i++) out[i] = to_e4m3(values[i]);
}

void graphstep_to_f16(const float* values, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; i++) out[i] = to_f16(values[i]);
}

void graphstep_from_f16(const uint16_t* halves, float* out, int64_t n) {
  for (int64_t i = 0; i < n; i++) out[i] = from_f16(halves[i]);
}

}  // extern "C"
