// Shared by the CPU optimizer kernels (cpu_adam.cpp, cpu_lion.cpp, cpu_adagrad.cpp): dtype
// codes, fp32 <-> bf16/fp16 conversions that round as torch does, a small SIMD wrapper for
// the instruction set the file is compiled for, and the multi-tensor parallel driver.
//
// No torch headers (see cpu_adam.cpp). Everything here is internal to one library; only
// functions marked DS_EXPORT are visible to ctypes.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include <omp.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// The C entry points: default visibility stated, never inferred. (A hidden entry point
// is exactly what broke the CUDA op once: nm on the object still lists it as "T".)
#define DS_EXPORT extern "C" __attribute__((visibility("default")))

namespace ds {

enum : int32_t { kF32 = 0, kBF16 = 1, kF16 = 2, kNone = -1 };

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even (as torch does)
  return static_cast<uint16_t>(u >> 16);
}

inline float f16_to_f32(uint16_t h) {
  _Float16 x;
  std::memcpy(&x, &h, 2);
  return static_cast<float>(x);
}

inline uint16_t f32_to_f16(float f) {
  _Float16 x = static_cast<_Float16>(f);
  uint16_t h;
  std::memcpy(&h, &x, 2);
  return h;
}

template <int GD>
inline float load_grad_scalar(const void* g, int64_t i) {
  if (GD == kF32) return static_cast<const float*>(g)[i];
  const uint16_t h = static_cast<const uint16_t*>(g)[i];
  return GD == kBF16 ? bf16_to_f32(h) : f16_to_f32(h);
}

template <int OD>
inline void store_out_scalar(void* out, int64_t i, float x) {
  if (OD == kBF16) static_cast<uint16_t*>(out)[i] = f32_to_bf16(x);
  if (OD == kF16) static_cast<uint16_t*>(out)[i] = f32_to_f16(x);
}

// step * sign(c) as torch.sign gives it: +-step, 0 for +-0, and NaN stays NaN.
inline float signed_step(float c, float step) {
  if (c > 0.0f) return step;
  if (c < 0.0f) return -step;
  return c == 0.0f ? 0.0f : c;
}

#if defined(__AVX512F__)
// 16 lanes. Half-precision loads widen 16 values from one 256-bit load.
struct Simd {
  using F = __m512;
  static constexpr int kWidth = 16;
  static F load(const float* x) { return _mm512_loadu_ps(x); }
  static void store(float* x, F a) { _mm512_storeu_ps(x, a); }
  static F set1(float a) { return _mm512_set1_ps(a); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  static F neg(F a) { return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32(INT32_MIN))); }
  // step * sign(c) with torch.sign's conventions: 0 for +-0, NaN for NaN (signed_step below).
  static F signed_step(F c, F step) {
    const __m512 zero = _mm512_setzero_ps();
    __m512 r = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(c, zero, _CMP_GT_OQ), step);
    r = _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask(c, zero, _CMP_LT_OQ), neg(step));
    return _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask(c, c, _CMP_UNORD_Q), c);
  }
  template <int GD>
  static F load_grad(const void* g, int64_t i) {
    if (GD == kF32) return _mm512_loadu_ps(static_cast<const float*>(g) + i);
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(g) + i));
    if (GD == kF16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  template <int OD>
  static void store_out(void* out, int64_t i, F x) {
    __m256i* dst = reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i);
    if (OD == kF16) {
      _mm256_storeu_si256(dst, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    } else if (OD == kBF16) {
      const __m512i u = _mm512_castps_si512(x);
      const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
      __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
      r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
      _mm256_storeu_si256(dst, _mm512_cvtepi32_epi16(r));
    }
  }
};
constexpr const char* kIsa = "avx512";
#elif defined(__AVX2__)
// 8 lanes; needs F16C for the fp16 conversions (every AVX2 CPU has it).
struct Simd {
  using F = __m256;
  static constexpr int kWidth = 8;
  static F load(const float* x) { return _mm256_loadu_ps(x); }
  static void store(float* x, F a) { _mm256_storeu_ps(x, a); }
  static F set1(float a) { return _mm256_set1_ps(a); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F neg(F a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.0f)); }
  static F signed_step(F c, F step) {
    const __m256 zero = _mm256_setzero_ps();
    __m256 r = _mm256_and_ps(_mm256_cmp_ps(c, zero, _CMP_GT_OQ), step);
    r = _mm256_blendv_ps(r, neg(step), _mm256_cmp_ps(c, zero, _CMP_LT_OQ));
    return _mm256_blendv_ps(r, c, _mm256_cmp_ps(c, c, _CMP_UNORD_Q));
  }
  template <int GD>
  static F load_grad(const void* g, int64_t i) {
    if (GD == kF32) return _mm256_loadu_ps(static_cast<const float*>(g) + i);
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(g) + i));
    if (GD == kF16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  template <int OD>
  static void store_out(void* out, int64_t i, F x) {
    __m128i* dst = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i);
    if (OD == kF16) {
      _mm_storeu_si128(dst, _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    } else if (OD == kBF16) {
      const __m256i u = _mm256_castps_si256(x);
      const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
      __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
      const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
      r = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc0)), nan));
      // packus works within 128-bit lanes; the permute gathers the two low halves.
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
      _mm_storeu_si128(dst, _mm256_castsi256_si128(packed));
    }
  }
};
constexpr const char* kIsa = "avx2";
#else
constexpr const char* kIsa = "scalar";
#endif


// Run-time dtype codes -> Span<grad dtype, copy-out dtype>::run, instantiated for every
// pair (nullptr for an unknown code). Each op defines its Span template once.
template <template <int, int> class Span, int GD>
auto pick_out(int32_t out_dtype) -> decltype(&Span<GD, kNone>::run) {
  switch (out_dtype) {
    case kNone: return &Span<GD, kNone>::run;
    case kBF16: return &Span<GD, kBF16>::run;
    case kF16: return &Span<GD, kF16>::run;
    default: return nullptr;
  }
}

template <template <int, int> class Span>
auto pick_span(int32_t grad_dtype, int32_t out_dtype) -> decltype(&Span<kF32, kNone>::run) {
  switch (grad_dtype) {
    case kF32: return pick_out<Span, kF32>(out_dtype);
    case kBF16: return pick_out<Span, kBF16>(out_dtype);
    case kF16: return pick_out<Span, kF16>(out_dtype);
    default: return nullptr;
  }
}

// Below this many elements a parallel region costs more than it saves.
constexpr int64_t kMinParallel = 1 << 15;
// Thread boundaries fall on whole cache lines of fp32 (and of bf16 output) data.
constexpr int64_t kAlign = 64;

// All elements of all `n` tensors are split into one contiguous range per thread, so 200
// small tensors cost one parallel region, not 200. fn(t, begin, end) runs a span of tensor t.
// (Threads taking 1 MiB chunks in turn instead was tried: on the loaded 2-core VM it measured
// 0.8-0.97x of these fixed ranges in three of four paired runs, so it is not used.)
template <typename Fn>
void for_each_span(int64_t n, const int64_t* numels, int num_threads, Fn&& fn) {
  int64_t total = 0;
  for (int64_t t = 0; t < n; ++t) total += numels[t];
  if (total == 0) return;
  int threads = num_threads < 1 ? 1 : num_threads;
  if (total < kMinParallel) threads = 1;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    const int nt = omp_get_num_threads();
    const int tid = omp_get_thread_num();
    const int64_t per = (total / nt + kAlign - 1) / kAlign * kAlign;
    int64_t lo = per * tid, hi = per * (tid + 1);
    if (hi > total) hi = total;
    int64_t base = 0;  // global index of tensor t's first element
    for (int64_t t = 0; t < n && base < hi; base += numels[t], ++t) {
      const int64_t b = lo > base ? lo - base : 0;
      const int64_t e = hi - base < numels[t] ? hi - base : numels[t];
      if (b < e) fn(t, b, e);
    }
  }
}

}  // namespace ds
