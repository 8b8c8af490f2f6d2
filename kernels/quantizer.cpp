// Block quantization for ZeRO++ (qwZ, qgZ) on the CPU: symmetric int8/int4 blocks with one
// float32 scale each, and their dequantization. The arithmetic is specified, and tested bit
// for bit, by kernels/quantize_ref.py (DeepSpeed 0.19.8's quantizer written out in torch):
//
//   per block of E elements:  amax = max |x|;  scale = 2^bits / (2 * amax)  (1 when amax is 0)
//                              q = clamp(rint(x * scale));  kept = 1 / scale
//   dequantized:               dtype(float(q) * kept)
//
// Every float operation above is one IEEE operation (the build passes -ffp-contract=off, and
// rint/cvtps round to nearest even under the default MXCSR), so the SIMD and scalar paths of
// every instruction set give the reference's bits. A block holding an inf or a NaN keeps
// q = 0 and a NaN scale (see quantize_ref.py for why); a block too small for its scale to be
// finite (amax below about 3.8e-37) keeps q = 0 and a zero scale. int4 packs two values a byte, the
// first of a pair in the high nibble.
//
// No torch header (see cpu_adam.cpp); quantizer_op.cpp is the torch op around these entry points.
#include "cpu_simd.h"

#include <algorithm>
#include <limits>

namespace ds {
namespace quant {

template <int XD>
inline float load(const void* x, int64_t i) {
  return load_grad_scalar<XD>(x, i);
}

// max |x| over [b, e) of x, and whether any element was NaN (max() would drop it).
template <int XD>
inline float abs_max(const void* x, int64_t b, int64_t e, bool* nan) {
  float m = 0.0f;
  bool seen_nan = false;
  int64_t i = b;
#if defined(__AVX512F__) || defined(__AVX2__)
  using S = Simd;
  auto vm = S::set1(0.0f);
#if defined(__AVX512F__)
  __mmask16 un = 0;
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  for (; i + S::kWidth <= e; i += S::kWidth) {
    const auto v = S::template load_grad<XD>(x, i);
    un |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    vm = S::max(vm, _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), abs_mask)));
  }
  seen_nan = un != 0;
  m = _mm512_reduce_max_ps(vm);
#else
  __m256 un = _mm256_setzero_ps();
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (; i + S::kWidth <= e; i += S::kWidth) {
    const auto v = S::template load_grad<XD>(x, i);
    un = _mm256_or_ps(un, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    vm = S::max(vm, _mm256_and_ps(v, abs_mask));
  }
  seen_nan = _mm256_movemask_ps(un) != 0;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vm);
  for (float l : lanes) m = std::max(m, l);
#endif
#endif
  for (; i < e; ++i) {
    const float v = load<XD>(x, i);
    if (v != v) seen_nan = true;
    m = std::max(m, std::fabs(v));
  }
  *nan = seen_nan;
  return m;
}

inline int32_t round_clamp(float v, int32_t lo, int32_t hi) {
  const float r = std::nearbyint(v);  // nearest, ties to even (the default rounding mode)
  if (r < static_cast<float>(lo)) return lo;
  if (r > static_cast<float>(hi)) return hi;
  return static_cast<int32_t>(r);
}

// One block: elements [b, b + e) of x into its bytes at q (int8: e bytes, int4: e/2) and
// its kept scale.
template <int XD, int BITS>
void quantize_block(const void* x, int64_t b, int64_t e, int8_t* q, float* kept) {
  constexpr int32_t lo = -(1 << (BITS - 1)), hi = (1 << (BITS - 1)) - 1;
  bool nan = false;
  const float amax = abs_max<XD>(x, b, b + e, &nan);
  if (nan || !std::isfinite(amax)) {
    std::memset(q, 0, static_cast<size_t>(BITS == 8 ? e : e / 2));
    *kept = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  const float scale = amax == 0.0f ? 1.0f : static_cast<float>(1 << BITS) / (2.0f * amax);
  if (std::isinf(scale)) {  // amax below ~3.8e-37 (fp32 input only): the block is zeros
    std::memset(q, 0, static_cast<size_t>(BITS == 8 ? e : e / 2));
    *kept = 0.0f;
    return;
  }
  *kept = 1.0f / scale;
  int64_t i = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
  using S = Simd;
  const auto vs = S::set1(scale);
  alignas(64) int32_t lanes[S::kWidth];
  for (; i + S::kWidth <= e; i += S::kWidth) {
    const auto p = S::mul(S::template load_grad<XD>(x, b + i), vs);
#if defined(__AVX512F__)
    __m512i r = _mm512_cvtps_epi32(p);  // rounds to nearest even
    r = _mm512_min_epi32(_mm512_max_epi32(r, _mm512_set1_epi32(lo)), _mm512_set1_epi32(hi));
    if (BITS == 8) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtepi32_epi8(r));
      continue;
    }
    _mm512_store_si512(reinterpret_cast<__m512i*>(lanes), r);
#else
    __m256i r = _mm256_cvtps_epi32(p);
    r = _mm256_min_epi32(_mm256_max_epi32(r, _mm256_set1_epi32(lo)), _mm256_set1_epi32(hi));
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), r);
#endif
    for (int k = 0; k < S::kWidth; k += 2) {
      if (BITS == 8) {
        q[i + k] = static_cast<int8_t>(lanes[k]);
        q[i + k + 1] = static_cast<int8_t>(lanes[k + 1]);
      } else {
        q[(i + k) / 2] = static_cast<int8_t>(((lanes[k] & 0xF) << 4) | (lanes[k + 1] & 0xF));
      }
    }
  }
#endif
  for (; i < e; i += 2) {  // e is even for int4 (checked by the op)
    const int32_t a = round_clamp(load<XD>(x, b + i) * scale, lo, hi);
    if (BITS == 8) {
      q[i] = static_cast<int8_t>(a);
      if (i + 1 < e) q[i + 1] = static_cast<int8_t>(round_clamp(load<XD>(x, b + i + 1) * scale, lo, hi));
    } else {
      const int32_t c = round_clamp(load<XD>(x, b + i + 1) * scale, lo, hi);
      q[i / 2] = static_cast<int8_t>(((a & 0xF) << 4) | (c & 0xF));
    }
  }
}

template <int OD>
inline void store(void* out, int64_t i, float v) {
  if (OD == kF32) {
    static_cast<float*>(out)[i] = v;
  } else {
    store_out_scalar<OD>(out, i, v);
  }
}

// One block of q (e values) times its kept scale, into out[b, b + e) in dtype OD.
template <int OD, int BITS>
void dequantize_block(const int8_t* q, float kept, int64_t b, int64_t e, void* out) {
  int64_t i = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
  if (BITS == 8) {
    using S = Simd;
    const auto vk = S::set1(kept);
    for (; i + S::kWidth <= e; i += S::kWidth) {
#if defined(__AVX512F__)
      const auto v = S::mul(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                                reinterpret_cast<const __m128i*>(q + i)))), vk);
#else
      const auto v = S::mul(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                                reinterpret_cast<const __m128i*>(q + i)))), vk);
#endif
      if (OD == kF32) {
        S::store(static_cast<float*>(out) + b + i, v);
      } else {
        S::template store_out<OD>(out, b + i, v);
      }
    }
  }
#endif
  for (; i < e; ++i) {
    int32_t v;
    if (BITS == 8) {
      v = q[i];
    } else {
      const int32_t byte = q[i / 2];  // sign-extended
      v = (i % 2 == 0) ? (byte >> 4) : (((byte & 0xF) ^ 8) - 8);
    }
    store<OD>(out, b + i, static_cast<float>(v) * kept);
  }
}

// Blocks [0, groups) split over the threads in contiguous runs.
template <typename Fn>
void for_blocks(int64_t groups, int64_t n, int num_threads, Fn&& fn) {
  int threads = num_threads < 1 ? 1 : num_threads;
  if (n < kMinParallel || groups < 2) threads = 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t g = 0; g < groups; ++g) fn(g);
}

template <int XD, int BITS>
void quantize_all(const void* x, int64_t n, int64_t groups, int8_t* q, float* scales, int threads) {
  const int64_t e = n / groups;
  const int64_t qe = BITS == 8 ? e : e / 2;
  for_blocks(groups, n, threads, [&](int64_t g) { quantize_block<XD, BITS>(x, g * e, e, q + g * qe, scales + g); });
}

template <int OD, int BITS>
void dequantize_all(const int8_t* q, const float* scales, int64_t n, int64_t groups, void* out, int threads) {
  const int64_t e = n / groups;
  const int64_t qe = BITS == 8 ? e : e / 2;
  for_blocks(groups, n, threads, [&](int64_t g) { dequantize_block<OD, BITS>(q + g * qe, scales[g], g * e, e, out); });
}

}  // namespace quant
}  // namespace ds

DS_EXPORT const char* ds_quant_isa() { return ds::kIsa; }

// x: n elements of dtype code x_dtype (0 fp32, 1 bf16, 2 fp16) in `groups` blocks (n % groups == 0,
// and an even block size for 4 bits) -> q (n or n/2 bytes) and scales (groups floats).
// Returns 0, or -1 for an unknown dtype or bit width (the op checks sizes before calling).
DS_EXPORT int ds_quantize(const void* x, int32_t x_dtype, int64_t n, int64_t groups, int32_t bits, int8_t* q,
                          float* scales, int32_t num_threads) {
  using namespace ds;
  using namespace ds::quant;
  if (bits != 4 && bits != 8) return -1;
  const bool b8 = bits == 8;
  switch (x_dtype) {
    case kF32: b8 ? quantize_all<kF32, 8>(x, n, groups, q, scales, num_threads)
                  : quantize_all<kF32, 4>(x, n, groups, q, scales, num_threads); return 0;
    case kBF16: b8 ? quantize_all<kBF16, 8>(x, n, groups, q, scales, num_threads)
                   : quantize_all<kBF16, 4>(x, n, groups, q, scales, num_threads); return 0;
    case kF16: b8 ? quantize_all<kF16, 8>(x, n, groups, q, scales, num_threads)
                  : quantize_all<kF16, 4>(x, n, groups, q, scales, num_threads); return 0;
    default: return -1;
  }
}

// q and scales as ds_quantize wrote them -> n elements of dtype code out_dtype at out.
DS_EXPORT int ds_dequantize(const int8_t* q, const float* scales, int64_t n, int64_t groups, int32_t bits, void* out,
                            int32_t out_dtype, int32_t num_threads) {
  using namespace ds;
  using namespace ds::quant;
  if (bits != 4 && bits != 8) return -1;
  const bool b8 = bits == 8;
  switch (out_dtype) {
    case kF32: b8 ? dequantize_all<kF32, 8>(q, scales, n, groups, out, num_threads)
                  : dequantize_all<kF32, 4>(q, scales, n, groups, out, num_threads); return 0;
    case kBF16: b8 ? dequantize_all<kBF16, 8>(q, scales, n, groups, out, num_threads)
                   : dequantize_all<kBF16, 4>(q, scales, n, groups, out, num_threads); return 0;
    case kF16: b8 ? dequantize_all<kF16, 8>(q, scales, n, groups, out, num_threads)
                  : dequantize_all<kF16, 4>(q, scales, n, groups, out, num_threads); return 0;
    default: return -1;
  }
}
