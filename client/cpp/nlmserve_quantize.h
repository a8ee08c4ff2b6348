// nlmserve quantised rows: the forms a scoring table's position and output rows are stored in
// (float32, fp16, int8), how the scorer reads each, and the error each form allows.
//
// The contract (the local scorer's, nlmserve_tables.h, for its rows):
//   Forms     The position and output rows, nearly all of the tables, are float32 as the
//             model holds them, or, mapped from a tables file written with `nlmserve
//             export-tables --quantize` (Arrays::quantization), fp16 (IEEE half; half the
//             bytes) or int8 (a signed byte per value and a float scale per row, value =
//             scale * q, scale = the row's largest |value| / 127; a quarter of the bytes).
//             Score reads them as floats. Its scores then differ from float32's by at most
//             the file's bound (TablesFileInfo::error_bound, in nats, nlmserve_tables_file.h),
//             plus float rounding (float32's bound is 0: the same floats as fetched tables):
//               E = max_w ( A * |O_w| + R * |O~_w - O_w| )        a class output
//               E = L * max_k ( A * |O_k| + R * |O~_k - O_k| )    a tree (k: its nodes)
//             in Euclidean norms of rows, with P_j, O the float32 position and output rows,
//             P~_j, O~ the rows Score reads, A = sum_j max_w |P~_j[w] - P_j[w]| (each position
//             table's largest row error), R = sqrt(D) after tanh, else sum_j max_w |P~_j[w]|
//             (a bound on |r~|), L the most steps of a code. Why: the context sum moves by at
//             most A (triangle inequality), and so does r (tanh and relu move no component by
//             more than its input); r~.O~ - r.O = (r~ - r).O + r~.(O~ - O) (Cauchy-Schwarz on
//             each); log sigmoid and log-sum-exp move by no more than their arguments. It is
//             a worst case: on held-out text the errors are far smaller (docs/interfaces.md).
//             The bias, the features' tables and a tree's paths are never quantised. The
//             Python owner of the bound is nlmserve.lm.quantize; tests score the golden
//             fixture's rows in each form against it, in Python and here.
// Header only, C++11, no gRPC or protobuf (CMake target nlmserve::nlmserve_scorer).
#ifndef NLMSERVE_QUANTIZE_H
#define NLMSERVE_QUANTIZE_H

#include <cstddef>
#include <cstdint>
#include <cstring>

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#define NLMSERVE_AVX2_KERNELS 1
#include <immintrin.h>
#endif

namespace nlmserve {

// How the position and output rows are stored (the tables file's quantisation field, in
// this order; the contract above gives the error each allows).
enum class Quantization { kNone = 0, kFp16 = 1, kInt8 = 2 };

// "none", "fp16", "int8": export-tables' --quantize names.
inline const char *QuantizationName(Quantization q) {
  return q == Quantization::kFp16 ? "fp16" : q == Quantization::kInt8 ? "int8" : "none";
}

// An IEEE half (binary16) as a float, for the values a tables file stores as fp16: finite
// and never subnormal (the writer makes those 0). Its exponent and mantissa bits, moved to a
// float's place, times 2^112 re-bias the exponent (an exact product); then its sign.
inline float HalfToFloat(uint16_t h) {
  const uint32_t magnitude = static_cast<uint32_t>(h & 0x7fffu) << 13;
  float f;
  std::memcpy(&f, &magnitude, sizeof(f));
  f *= 5.192296858534828e33f;  // 2^112
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  bits |= static_cast<uint32_t>(h & 0x8000u) << 16;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// a . float(b) over n values, with eight partial sums, so that the compiler can keep them in
// one vector register (a single running sum is a dependency chain it may not reorder);
// `one(b[d])` is the exact float of one value. The portable loop of every form.
template <class V, class One>
inline float PortableDot(const float *a, const V *b, std::size_t n, One one) {
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  std::size_t d = 0;
  for (; d + 8 <= n; d += 8) {
    for (std::size_t k = 0; k < 8; ++k) acc[k] += a[d + k] * one(b[d + k]);
  }
  float s = 0.f;
  for (; d < n; ++d) s += a[d] * one(b[d]);
  for (std::size_t k = 0; k < 8; ++k) s += acc[k];
  return s;
}

inline float SameFloat(float v) { return v; }

// a . b over n floats.
inline float DotProduct(const float *a, const float *b, std::size_t n) { return PortableDot(a, b, n, SameFloat); }

// How Score reads a row of position or output values in each form: Copy and Add put a row
// (times its scale) into a vector, Dot is its dot product with one. FloatRows does what
// the float32 tables always did, in the same order, so their scores stay the same floats.
// On x86-64 CPUs with AVX2 and F16C (checked once, at run time: the build itself assumes only
// x86-64's SSE2), the dot products and sums below take eight values per instruction. They
// make the same floats as the portable loops: each value converted exactly (int8 and fp16
// are exact in a float), the same eight partial sums added in the same order, and no fused
// multiply-add (none is enabled; one would round once where the loops round twice), so a
// score does not depend on the CPU that computed it (nlmserve_unit_test checks it bit for bit).
#ifdef NLMSERVE_AVX2_KERNELS
inline bool HasAvx2() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0 && __builtin_cpu_supports("f16c") != 0;
  }();
  return has;
}

#define NLMSERVE_AVX2 __attribute__((target("avx2,f16c")))
NLMSERVE_AVX2 inline __m256 Load8(const float *p) { return _mm256_loadu_ps(p); }
NLMSERVE_AVX2 inline __m256 Load8(const uint16_t *p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
}
NLMSERVE_AVX2 inline __m256 Load8(const int8_t *p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(p))));
}

// a . float(b) over n values with eight partial sums (DotProduct's order); `one(b[d])` is
// the exact float of one value, for the last n % 8.
template <class V, class One>
NLMSERVE_AVX2 inline float DotAvx2(const float *a, const V *b, std::size_t n, One one) {
  __m256 acc = _mm256_setzero_ps();
  std::size_t d = 0;
  for (; d + 8 <= n; d += 8) acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(a + d), Load8(b + d)));
  float s = 0.f;
  for (; d < n; ++d) s += a[d] * one(b[d]);
  float lanes[8];
  _mm256_storeu_ps(lanes, acc);
  for (std::size_t k = 0; k < 8; ++k) s += lanes[k];
  return s;
}

// to[d] = sum[d] + scale * float(p[d]) (the product skipped when `scaled` is false, as the
// float and fp16 loops have none); `to` may be `sum` (in place).
template <class V, class One>
NLMSERVE_AVX2 inline void AddAvx2(float *to, const float *sum, const V *p, float scale, bool scaled,
                                  std::size_t n, One one) {
  const __m256 factor = _mm256_set1_ps(scale);
  std::size_t d = 0;
  for (; d + 8 <= n; d += 8) {
    const __m256 v = scaled ? _mm256_mul_ps(factor, Load8(p + d)) : Load8(p + d);
    _mm256_storeu_ps(to + d, _mm256_add_ps(_mm256_loadu_ps(sum + d), v));
  }
  for (; d < n; ++d) to[d] = sum[d] + (scaled ? scale * one(p[d]) : one(p[d]));
}
#undef NLMSERVE_AVX2

inline float DotProductAvx2(const float *a, const float *b, std::size_t n) {
  return DotAvx2(a, b, n, SameFloat);
}
#endif

struct FloatRows {
  typedef float Value;
  static void Copy(float *to, const float *p, float, std::size_t dim) {
    for (std::size_t d = 0; d < dim; ++d) to[d] = p[d];
  }
  static void Add(float *to, const float *sum, const float *p, float, std::size_t dim) {
#ifdef NLMSERVE_AVX2_KERNELS
    if (HasAvx2()) return AddAvx2(to, sum, p, 1.f, false, dim, SameFloat);
#endif
    for (std::size_t d = 0; d < dim; ++d) to[d] = sum[d] + p[d];
  }
  static float Dot(const float *r, const float *row, float, std::size_t dim) {
#ifdef NLMSERVE_AVX2_KERNELS
    if (HasAvx2()) return DotProductAvx2(r, row, dim);
#endif
    return DotProduct(r, row, dim);
  }
};
struct HalfRows {
  typedef uint16_t Value;
  static void Copy(float *to, const uint16_t *p, float, std::size_t dim) {
    for (std::size_t d = 0; d < dim; ++d) to[d] = HalfToFloat(p[d]);
  }
  static void Add(float *to, const float *sum, const uint16_t *p, float, std::size_t dim) {
#ifdef NLMSERVE_AVX2_KERNELS
    if (HasAvx2()) return AddAvx2(to, sum, p, 1.f, false, dim, HalfToFloat);
#endif
    for (std::size_t d = 0; d < dim; ++d) to[d] = sum[d] + HalfToFloat(p[d]);
  }
  static float Dot(const float *r, const uint16_t *row, float, std::size_t dim) {
#ifdef NLMSERVE_AVX2_KERNELS
    if (HasAvx2()) return DotAvx2(r, row, dim, HalfToFloat);
#endif
    return PortableDot(r, row, dim, HalfToFloat);
  }
};
struct Int8Rows {
  typedef int8_t Value;
  static float ToFloat(int8_t v) { return static_cast<float>(v); }
  static void Copy(float *to, const int8_t *p, float scale, std::size_t dim) {
    for (std::size_t d = 0; d < dim; ++d) to[d] = scale * static_cast<float>(p[d]);
  }
  static void Add(float *to, const float *sum, const int8_t *p, float scale, std::size_t dim) {
#ifdef NLMSERVE_AVX2_KERNELS
    if (HasAvx2()) return AddAvx2(to, sum, p, scale, true, dim, ToFloat);
#endif
    for (std::size_t d = 0; d < dim; ++d) to[d] = sum[d] + scale * static_cast<float>(p[d]);
  }
  // The row's scale applied once, to the sum.
  static float Dot(const float *r, const int8_t *row, float scale, std::size_t dim) {
#ifdef NLMSERVE_AVX2_KERNELS
    if (HasAvx2()) return DotAvx2(r, row, dim, ToFloat) * scale;
#endif
    return PortableDot(r, row, dim, ToFloat) * scale;
  }
};

}  // namespace nlmserve

#endif  // NLMSERVE_QUANTIZE_H
