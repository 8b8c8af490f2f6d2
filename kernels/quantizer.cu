// ZeRO++'s block quantizer on CUDA: the same maths as quantizer.cpp and quantize_ref.py (the
// specification), one IEEE operation at a time:
//
//   per block of E elements:  amax = max |x|;  scale = 2^bits / (2 * amax)  (1 when amax is 0)
//                              q = clamp(rint(x * scale));  kept = 1 / scale
//   dequantized:               dtype(float(q) * kept)
//
// The divisions and products are written as __fdiv_rn/__fmul_rn so that a build with
// --use_fast_math (DeepSpeed builds its own quantizer that way) still rounds them exactly;
// __float2int_rn rounds ties to even. A block holding an inf or a NaN keeps q = 0 and a NaN
// scale; a block whose scale overflows keeps q = 0 and a zero scale (quantize_ref.py says why).
//
// Quantize: one thread block per quantization block (E is at most a few ten thousand);
// the threads reduce amax through shared memory, thread 0 writes the scale, then every
// thread quantizes a stride of the block. Dequantize: one thread per output byte.
// No torch header (see fused_adam.cu); quantizer_cuda_op.cpp is the torch op.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#define DS_EXPORT extern "C" __attribute__((visibility("default")))

namespace ds_quant {

enum : int { kF32 = 0, kBF16 = 1, kF16 = 2 };
constexpr int kThreads = 256;

__device__ __forceinline__ float load(const float* x, int64_t i) { return x[i]; }
__device__ __forceinline__ float load(const __nv_bfloat16* x, int64_t i) { return __bfloat162float(x[i]); }
__device__ __forceinline__ float load(const __half* x, int64_t i) { return __half2float(x[i]); }

__device__ __forceinline__ void store(float* o, int64_t i, float v) { o[i] = v; }
__device__ __forceinline__ void store(__nv_bfloat16* o, int64_t i, float v) { o[i] = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store(__half* o, int64_t i, float v) { o[i] = __float2half_rn(v); }

template <int BITS>
__device__ __forceinline__ int32_t quant(float v, float scale) {
  constexpr int32_t lo = -(1 << (BITS - 1)), hi = (1 << (BITS - 1)) - 1;
  const int32_t r = __float2int_rn(__fmul_rn(v, scale));
  return r < lo ? lo : (r > hi ? hi : r);
}

template <typename T, int BITS>
__global__ void __launch_bounds__(kThreads) quantize_kernel(const T* __restrict__ x, int64_t e,
                                                            int8_t* __restrict__ q, float* __restrict__ scales) {
  __shared__ float s_max[kThreads];
  __shared__ int s_nan[kThreads];
  __shared__ float s_scale;
  __shared__ int s_mode;  // 0: quantize with s_scale; 1: the block is zeros
  const int tid = threadIdx.x;
  const int64_t g = blockIdx.x;
  const T* xg = x + g * e;
  float m = 0.0f;
  int nan = 0;
  for (int64_t i = tid; i < e; i += kThreads) {
    const float v = load(xg, i);
    nan |= (v != v);
    m = fmaxf(m, fabsf(v));  // fmaxf drops a NaN: it is counted in `nan` instead
  }
  s_max[tid] = m;
  s_nan[tid] = nan;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (tid < s) {
      s_max[tid] = fmaxf(s_max[tid], s_max[tid + s]);
      s_nan[tid] |= s_nan[tid + s];
    }
    __syncthreads();
  }
  if (tid == 0) {
    const float amax = s_max[0];
    if (s_nan[0] || isinf(amax)) {
      s_mode = 1;
      scales[g] = __int_as_float(0x7fc00000);  // NaN: the block dequantizes to NaN
    } else {
      const float scale = amax == 0.0f ? 1.0f : __fdiv_rn(static_cast<float>(1 << BITS), __fmul_rn(2.0f, amax));
      if (isinf(scale)) {
        s_mode = 1;
        scales[g] = 0.0f;
      } else {
        s_mode = 0;
        s_scale = scale;
        scales[g] = __fdiv_rn(1.0f, scale);
      }
    }
  }
  __syncthreads();
  const bool zeros = s_mode != 0;
  const float scale = s_scale;
  if (BITS == 8) {
    int8_t* qg = q + g * e;
    for (int64_t i = tid; i < e; i += kThreads) qg[i] = zeros ? 0 : static_cast<int8_t>(quant<8>(load(xg, i), scale));
  } else {
    int8_t* qg = q + g * (e / 2);
    for (int64_t p = tid; p < e / 2; p += kThreads) {
      if (zeros) {
        qg[p] = 0;
      } else {
        const int32_t a = quant<4>(load(xg, 2 * p), scale), b = quant<4>(load(xg, 2 * p + 1), scale);
        qg[p] = static_cast<int8_t>(((a & 0xF) << 4) | (b & 0xF));  // first of the pair in the high nibble
      }
    }
  }
}

template <typename T, int BITS>
__global__ void __launch_bounds__(kThreads) dequantize_kernel(const int8_t* __restrict__ q,
                                                              const float* __restrict__ scales, int64_t e,
                                                              int64_t bytes, T* __restrict__ out) {
  for (int64_t b = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; b < bytes;
       b += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int32_t byte = q[b];  // sign-extended
    if (BITS == 8) {
      store(out, b, __fmul_rn(static_cast<float>(byte), scales[b / e]));
    } else {
      const float kept = scales[(2 * b) / e];  // e is even: both nibbles are in one block
      store(out, 2 * b, __fmul_rn(static_cast<float>(byte >> 4), kept));
      store(out, 2 * b + 1, __fmul_rn(static_cast<float>(((byte & 0xF) ^ 8) - 8), kept));
    }
  }
}

template <typename T>
int launch_quantize(const void* x, int64_t n, int64_t groups, int bits, int8_t* q, float* scales, cudaStream_t s) {
  const int64_t e = n / groups;
  const unsigned int grid = static_cast<unsigned int>(groups);
  if (bits == 8) {
    quantize_kernel<T, 8><<<grid, kThreads, 0, s>>>(static_cast<const T*>(x), e, q, scales);
  } else {
    quantize_kernel<T, 4><<<grid, kThreads, 0, s>>>(static_cast<const T*>(x), e, q, scales);
  }
  return static_cast<int>(cudaGetLastError());
}

template <typename T>
int launch_dequantize(const int8_t* q, const float* scales, int64_t n, int64_t groups, int bits, void* out,
                      cudaStream_t s) {
  const int64_t e = n / groups;
  const int64_t bytes = bits == 8 ? n : n / 2;
  const int64_t want = (bytes + kThreads - 1) / kThreads;
  const unsigned int grid = static_cast<unsigned int>(want < 65535 ? want : 65535);
  if (bits == 8) {
    dequantize_kernel<T, 8><<<grid, kThreads, 0, s>>>(q, scales, e, bytes, static_cast<T*>(out));
  } else {
    dequantize_kernel<T, 4><<<grid, kThreads, 0, s>>>(q, scales, e, bytes, static_cast<T*>(out));
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace ds_quant

using namespace ds_quant;

// Returns 0, -1 for an unknown dtype or bit width, or the cudaError_t of the launch. The op
// (quantizer_cuda_op.cpp) has checked the sizes: n % groups == 0, an even block for 4 bits.
DS_EXPORT int ds_quant_cuda_quantize(const void* x, int dtype, int64_t n, int64_t groups, int bits, int8_t* q,
                                     float* scales, void* stream) {
  if (bits != 4 && bits != 8) return -1;
  if (n == 0) return 0;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case kF32: return launch_quantize<float>(x, n, groups, bits, q, scales, s);
    case kBF16: return launch_quantize<__nv_bfloat16>(x, n, groups, bits, q, scales, s);
    case kF16: return launch_quantize<__half>(x, n, groups, bits, q, scales, s);
    default: return -1;
  }
}

DS_EXPORT int ds_quant_cuda_dequantize(const int8_t* q, const float* scales, int64_t n, int64_t groups, int bits,
                                       void* out, int dtype, void* stream) {
  if (bits != 4 && bits != 8) return -1;
  if (n == 0) return 0;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case kF32: return launch_dequantize<float>(q, scales, n, groups, bits, out, s);
    case kBF16: return launch_dequantize<__nv_bfloat16>(q, scales, n, groups, bits, out, s);
    case kF16: return launch_dequantize<__half>(q, scales, n, groups, bits, out, s);
    default: return -1;
  }
}

DS_EXPORT const char* ds_quant_cuda_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}
