// Weight-only int8 linear for decoding: y[M, N] = x[M, K] @ (q[N, K] * scale[N, K / G])^T, fp32.
//
// Decoding multiplies a few activation rows by every weight, so it is bound by reading the
// weights. This kernel reads each int8 weight once (a quarter of the fp32 bytes) and widens it
// in registers, where the torch-op path first writes a dequantised fp32 copy of the whole
// matrix and reads it back. Rows of the output are split across OpenMP threads; each group
// of G columns is summed in a vector accumulator and scaled once. Built by kernels/builder.py
// (no torch headers; pointers arrive through ctypes) at the best instruction set of the CPU.
#include "cpu_simd.h"

namespace {

#if defined(__AVX512F__)
constexpr const char* kIsa = "avx512";
constexpr int kStep = 16;
inline float dot_group(const float* x, const int8_t* q, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + kStep <= n; k += kStep) {
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), _mm512_loadu_ps(x + k), acc);
  }
  float sum = _mm512_reduce_add_ps(acc);
  for (; k < n; ++k) sum += x[k] * static_cast<float>(q[k]);
  return sum;
}
#elif defined(__AVX2__)
constexpr const char* kIsa = "avx2";
constexpr int kStep = 8;
inline float dot_group(const float* x, const int8_t* q, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + kStep <= n; k += kStep) {
    __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_loadu_ps(x + k), acc);
  }
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  float sum = _mm_cvtss_f32(s);
  for (; k < n; ++k) sum += x[k] * static_cast<float>(q[k]);
  return sum;
}
#else
constexpr const char* kIsa = "scalar";
inline float dot_group(const float* x, const int8_t* q, int64_t n) {
  float sum = 0.f;
  for (int64_t k = 0; k < n; ++k) sum += x[k] * static_cast<float>(q[k]);
  return sum;
}
#endif

}  // namespace

DS_EXPORT const char* ds_int8_linear_isa() { return kIsa; }

// Returns 0, or 1 when the shapes are inconsistent (K not a multiple of the group).
DS_EXPORT int ds_int8_linear(int64_t m, int64_t n, int64_t k, int64_t group, const float* x, const int8_t* q,
                             const float* scales, float* y) {
  if (group <= 0 || k % group != 0) return 1;
  const int64_t groups = k / group;
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < n; ++row) {
    const int8_t* qrow = q + row * k;
    const float* srow = scales + row * groups;
    for (int64_t i = 0; i < m; ++i) {
      const float* xrow = x + i * k;
      float total = 0.f;
      for (int64_t g = 0; g < groups; ++g) total += srow[g] * dot_group(xrow + g * group, qrow + g * group, group);
      y[i * n + row] = total;
    }
  }
  return 0;
}
