// CPU Adam/AdamW over flat fp32 master parameters, one pass per element.
//
// Why no torch headers: <torch/extension.h> turns a 200-line kernel into a 20-second
// compile. The op takes raw pointers through a C ABI (called via ctypes, which drops
// the GIL), so this translation unit needs only the standard library, OpenMP and the
// SIMD intrinsics. The Python side (cpu_adam.py) checks dtypes, sizes and contiguity
// before any pointer reaches this file.
//
// The instruction set is fixed at compile time (-mavx512f..., -mavx2, or neither); the
// builder keys its cache on it, so a binary is only loaded on a CPU that can run it.
// Every element is loaded once and stored once per step: the gradient is widened to fp32
// in registers and the optional bf16/fp16 copy of the new parameter is written in the
// same pass, which is what keeps the step at the memory-bandwidth bound.
#include <cmath>
#include <cstdint>
#include <cstring>

#include <omp.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

enum : int32_t { kF32 = 0, kBF16 = 1, kF16 = 2, kNone = -1 };

// Mirrors AdamHyper in cpu_adam.py; the bias corrections are folded in on the Python
// side (in double) so the inner loop does one sqrt and one division:
//   p -= step_size * m / (sqrt(v)/bc2 + eps)  ==  p -= (step_size*bc2) * m / (sqrt(v) + eps*bc2)
struct AdamHyper {
  float beta1_complement;  // 1 - beta1 (exp_avg is a lerp towards the gradient)
  float beta2;
  float beta2_complement;  // 1 - beta2
  float eps_scaled;        // eps * sqrt(1 - beta2^step)
  float step_scaled;       // lr / (1 - beta1^step) * sqrt(1 - beta2^step)
  float weight_decay;      // L2 coefficient added to the gradient (Adam mode)
  float decay_factor;      // 1 - lr*weight_decay applied to the parameter (AdamW mode)
  int32_t decoupled;       // 1: AdamW, 0: Adam with L2 in the gradient
  int32_t amsgrad;
  int32_t maximize;
};

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

// One element; also the tail of the vector loops, so both paths share the same math.
template <int GD, int OD>
inline void adam_scalar(const AdamHyper& h, int64_t i, float* p, const void* g, float* m, float* v,
                        float* vmax, void* out) {
  float param = p[i];
  float grad = load_grad_scalar<GD>(g, i);
  if (h.maximize) grad = -grad;
  if (h.decoupled) {
    param *= h.decay_factor;
  } else {
    grad = std::fma(h.weight_decay, param, grad);
  }
  float mi = m[i];
  mi = std::fma(h.beta1_complement, grad - mi, mi);
  float vi = std::fma(h.beta2, v[i], h.beta2_complement * grad * grad);
  float denom_src = vi;
  if (h.amsgrad) {
    denom_src = vi > vmax[i] ? vi : vmax[i];
    vmax[i] = denom_src;
  }
  const float denom = std::sqrt(denom_src) + h.eps_scaled;
  param -= h.step_scaled * mi / denom;
  p[i] = param;
  m[i] = mi;
  v[i] = vi;
  store_out_scalar<OD>(out, i, param);
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

// Software prefetch distance in elements (2 KiB of fp32 ahead on each stream): with
// four read streams per thread the hardware prefetcher alone left ~10% of bandwidth unused
// at 100M parameters (A/B measured on the 2-core dev VM).
#ifndef DS_PREFETCH
#define DS_PREFETCH 512
#endif

template <int GD, int OD>
void adam_span(const AdamHyper& h, int64_t begin, int64_t end, float* p, const void* g, float* m,
               float* v, float* vmax, void* out) {
  int64_t i = begin;
#if defined(__AVX512F__) || defined(__AVX2__)
  using S = Simd;
  const auto b1c = S::set1(h.beta1_complement), b2 = S::set1(h.beta2), b2c = S::set1(h.beta2_complement);
  const auto eps = S::set1(h.eps_scaled), step = S::set1(h.step_scaled);
  const auto wd = S::set1(h.weight_decay), decay = S::set1(h.decay_factor);
  for (; i + S::kWidth <= end; i += S::kWidth) {
#if DS_PREFETCH > 0
    _mm_prefetch(reinterpret_cast<const char*>(p + i + DS_PREFETCH), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(m + i + DS_PREFETCH), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(v + i + DS_PREFETCH), _MM_HINT_T0);
    _mm_prefetch(static_cast<const char*>(g) + (i + DS_PREFETCH) * (GD == kF32 ? 4 : 2), _MM_HINT_T0);
#endif
    auto param = S::load(p + i);
    auto grad = S::template load_grad<GD>(g, i);
    if (h.maximize) grad = S::neg(grad);
    if (h.decoupled) {
      param = S::mul(param, decay);
    } else {
      grad = S::fma(wd, param, grad);
    }
    auto mi = S::load(m + i);
    mi = S::fma(b1c, S::sub(grad, mi), mi);
    const auto vi = S::fma(b2, S::load(v + i), S::mul(S::mul(b2c, grad), grad));
    auto denom_src = vi;
    if (h.amsgrad) {
      denom_src = S::max(vi, S::load(vmax + i));
      S::store(vmax + i, denom_src);
    }
    const auto denom = S::add(S::sqrt(denom_src), eps);
    param = S::sub(param, S::div(S::mul(step, mi), denom));
    S::store(p + i, param);
    S::store(m + i, mi);
    S::store(v + i, vi);
    if (OD != kNone) S::template store_out<OD>(out, i, param);
  }
#endif
  for (; i < end; ++i) adam_scalar<GD, OD>(h, i, p, g, m, v, vmax, out);
}

using SpanFn = void (*)(const AdamHyper&, int64_t, int64_t, float*, const void*, float*, float*, float*, void*);

template <int GD>
SpanFn pick_out(int32_t out_dtype) {
  switch (out_dtype) {
    case kNone: return adam_span<GD, kNone>;
    case kBF16: return adam_span<GD, kBF16>;
    case kF16: return adam_span<GD, kF16>;
    default: return nullptr;
  }
}

SpanFn pick(int32_t grad_dtype, int32_t out_dtype) {
  switch (grad_dtype) {
    case kF32: return pick_out<kF32>(out_dtype);
    case kBF16: return pick_out<kBF16>(out_dtype);
    case kF16: return pick_out<kF16>(out_dtype);
    default: return nullptr;
  }
}

// Below this many elements a parallel region costs more than it saves.
constexpr int64_t kMinParallel = 1 << 15;
// Thread boundaries fall on whole cache lines of fp32 (and of bf16 output) data.
constexpr int64_t kAlign = 64;

}  // namespace

extern "C" {

const char* ds_cpu_adam_isa() { return kIsa; }

// Steps `n` tensors; tensor t has numels[t] elements at params[t], grads[t], ... All
// elements of all tensors are split into one contiguous range per thread, so 200 small
// tensors cost one parallel region, not 200. Returns 0, or -1 for an unknown dtype.
int ds_cpu_adam_step(int64_t n, const int64_t* numels, float* const* params, void* const* grads,
                     float* const* exp_avgs, float* const* exp_avg_sqs, float* const* max_exp_avg_sqs,
                     void* const* outs, int32_t grad_dtype, int32_t out_dtype, const AdamHyper* hyper,
                     int32_t num_threads) {
  const SpanFn fn = pick(grad_dtype, out_dtype);
  if (fn == nullptr) return -1;
  int64_t total = 0;
  for (int64_t t = 0; t < n; ++t) total += numels[t];
  if (total == 0) return 0;
  const AdamHyper h = *hyper;
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
      if (b >= e) continue;
      fn(h, b, e, params[t], grads[t], exp_avgs[t], exp_avg_sqs[t],
         max_exp_avg_sqs ? max_exp_avg_sqs[t] : nullptr, outs ? outs[t] : nullptr);
    }
  }
  return 0;
}

}  // extern "C"
