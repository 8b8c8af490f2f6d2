// Multi-tensor Adam/AdamW for CUDA: one launch steps every tensor of a parameter group.
//
// Like cpu_adam.cpp this file includes no torch headers (nvcc over <torch/extension.h>
// takes minutes and trips over host-compiler/CUDA version pairs). Its torch op,
// fused_adam_op.cpp (compiled into the same library by torch.utils.cpp_extension), checks
// the tensors, writes the table of their raw pointers and calls the C entry points below
// with torch's current stream.
//
// Per launch: block b finds its tensor by binary search over the table's chunk offsets,
// reads that tensor's step count from device memory, and updates one chunk. Gradients are
// unscaled in registers (grad / *grad_scale) and the whole update is skipped when
// *found_inf is set, so AMP needs no host synchronisation. The last block to finish
// (atomic counter) increments every tensor's step count: all blocks have read the old
// count by then, and a skipped step leaves the counts alone, as torch does.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

// The C entry points: default visibility stated, never inferred. They once came out
// HIDDEN because their signature named a type from an anonymous namespace (Hyper): the
// object still listed them in `nm -g` as "T", the linked library did not export them, and
// ctypes said "undefined symbol". Hence a named namespace below, this macro, and a CI test
// that reads the exports of the library the builder links.
#define DS_EXPORT extern "C" __attribute__((visibility("default")))

namespace ds_fused {

enum : int { kF32 = 0, kBF16 = 1, kF16 = 2 };
constexpr int kThreads = 512;

// One row of the table fused_adam_op.cpp builds (8 x int64, same order).
struct Entry {
  int64_t param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step, numel, chunk_begin;
};

// Mirrors FusedHyper in fused_adam_op.cpp.
struct Hyper {
  float lr, beta1, beta2, eps, weight_decay;
  int32_t decoupled, amsgrad, maximize, bias_correction;
};

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ int find_tensor(const Entry* table, int n, int64_t chunk_id) {
  int lo = 0, hi = n - 1;  // last entry whose first chunk is <= chunk_id
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (table[mid].chunk_begin <= chunk_id) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// The last block to arrive bumps every step count (unless the step was skipped) and
// re-arms the counter for the next launch.
__device__ __forceinline__ void finish(const Entry* table, int n, unsigned int* done, bool skipped) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(done, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  if (!skipped) {
    for (int t = threadIdx.x; t < n; t += blockDim.x) *reinterpret_cast<float*>(table[t].step) += 1.0f;
  }
  if (threadIdx.x == 0) *done = 0u;
}

template <typename P, typename G>
__global__ void __launch_bounds__(kThreads) adam_kernel(const Entry* __restrict__ table, int n, int64_t chunk,
                                                        Hyper h, const float* grad_scale, const float* found_inf,
                                                        unsigned int* done) {
  __shared__ int tensor;
  __shared__ bool skipped;
  if (threadIdx.x == 0) {
    tensor = find_tensor(table, n, blockIdx.x);
    skipped = found_inf != nullptr && *found_inf != 0.0f;
  }
  __syncthreads();
  if (!skipped) {
    const Entry e = table[tensor];
    const double step = static_cast<double>(*reinterpret_cast<const float*>(e.step)) + 1.0;
    const float bc1 = h.bias_correction ? static_cast<float>(1.0 - pow(static_cast<double>(h.beta1), step)) : 1.0f;
    const float bc2_sqrt =
        h.bias_correction ? static_cast<float>(sqrt(1.0 - pow(static_cast<double>(h.beta2), step))) : 1.0f;
    const float step_size = h.lr / bc1;
    const float decay = h.decoupled ? 1.0f - h.lr * h.weight_decay : 1.0f;
    const float scale = grad_scale != nullptr ? *grad_scale : 1.0f;
    P* p = reinterpret_cast<P*>(e.param);
    const G* g = reinterpret_cast<const G*>(e.grad);
    float* m = reinterpret_cast<float*>(e.exp_avg);
    float* v = reinterpret_cast<float*>(e.exp_avg_sq);
    float* vmax = reinterpret_cast<float*>(e.max_exp_avg_sq);
    const int64_t begin = (static_cast<int64_t>(blockIdx.x) - e.chunk_begin) * chunk;
    const int64_t end = begin + chunk < e.numel ? begin + chunk : e.numel;
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
      float grad = to_float(g[i]);
      if (grad_scale != nullptr) grad = grad / scale;
      if (h.maximize) grad = -grad;
      float param = to_float(p[i]);
      if (h.decoupled) {
        param *= decay;
      } else {
        grad = fmaf(h.weight_decay, param, grad);
      }
      float mi = m[i];
      mi = fmaf(1.0f - h.beta1, grad - mi, mi);
      const float vi = fmaf(h.beta2, v[i], (1.0f - h.beta2) * grad * grad);
      float denom_src = vi;
      if (h.amsgrad) {
        denom_src = fmaxf(vi, vmax[i]);
        vmax[i] = denom_src;
      }
      const float denom = sqrtf(denom_src) / bc2_sqrt + h.eps;
      param -= step_size * mi / denom;
      p[i] = from_float<P>(param);
      m[i] = mi;
      v[i] = vi;
    }
  }
  finish(table, n, done, skipped);
}

// Sets *found_inf to 1 when any (unscaled) gradient is inf or NaN. The caller zeroes it.
template <typename G>
__global__ void __launch_bounds__(kThreads) nonfinite_kernel(const Entry* __restrict__ table, int n, int64_t chunk,
                                                             float* found_inf) {
  __shared__ int tensor;
  if (threadIdx.x == 0) tensor = find_tensor(table, n, blockIdx.x);
  __syncthreads();
  const Entry e = table[tensor];
  const G* g = reinterpret_cast<const G*>(e.grad);
  const int64_t begin = (static_cast<int64_t>(blockIdx.x) - e.chunk_begin) * chunk;
  const int64_t end = begin + chunk < e.numel ? begin + chunk : e.numel;
  bool bad = false;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) bad |= !isfinite(to_float(g[i]));
  if (__syncthreads_or(bad) && threadIdx.x == 0) *found_inf = 1.0f;
}

template <typename P, typename G>
void launch_adam(const Entry* table, int n, int64_t blocks, int64_t chunk, const Hyper& h, const float* grad_scale,
                 const float* found_inf, unsigned int* done, cudaStream_t stream) {
  adam_kernel<P, G><<<static_cast<unsigned int>(blocks), kThreads, 0, stream>>>(table, n, chunk, h, grad_scale,
                                                                                found_inf, done);
}

template <typename P>
int dispatch_grad(int grad_dtype, const Entry* table, int n, int64_t blocks, int64_t chunk, const Hyper& h,
                  const float* grad_scale, const float* found_inf, unsigned int* done, cudaStream_t stream) {
  switch (grad_dtype) {
    case kF32: launch_adam<P, float>(table, n, blocks, chunk, h, grad_scale, found_inf, done, stream); break;
    case kBF16: launch_adam<P, __nv_bfloat16>(table, n, blocks, chunk, h, grad_scale, found_inf, done, stream); break;
    case kF16: launch_adam<P, __half>(table, n, blocks, chunk, h, grad_scale, found_inf, done, stream); break;
    default: return -1;
  }
  return 0;
}

}  // namespace ds_fused

using namespace ds_fused;  // the C entry points below dispatch into it

// table: device array of n Entry rows; blocks: total chunks over all tensors. Returns 0,
// -1 for an unknown dtype, or the cudaError_t of the launch.
DS_EXPORT int ds_fused_adam_step(const void* table, int n, int64_t blocks, int64_t chunk, int param_dtype,
                                 int grad_dtype, const Hyper* hyper, const float* grad_scale, const float* found_inf,
                                 unsigned int* done, void* stream) {
  if (blocks <= 0) return 0;
  const Entry* t = static_cast<const Entry*>(table);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  int rc;
  switch (param_dtype) {
    case kF32: rc = dispatch_grad<float>(grad_dtype, t, n, blocks, chunk, *hyper, grad_scale, found_inf, done, s); break;
    case kBF16: rc = dispatch_grad<__nv_bfloat16>(grad_dtype, t, n, blocks, chunk, *hyper, grad_scale, found_inf, done, s); break;
    case kF16: rc = dispatch_grad<__half>(grad_dtype, t, n, blocks, chunk, *hyper, grad_scale, found_inf, done, s); break;
    default: return -1;
  }
  if (rc != 0) return rc;
  return static_cast<int>(cudaGetLastError());
}

DS_EXPORT int ds_fused_nonfinite(const void* table, int n, int64_t blocks, int64_t chunk, int grad_dtype,
                                 float* found_inf, void* stream) {
  if (blocks <= 0) return 0;
  const Entry* t = static_cast<const Entry*>(table);
  const unsigned int grid = static_cast<unsigned int>(blocks);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (grad_dtype) {
    case kF32: nonfinite_kernel<float><<<grid, kThreads, 0, s>>>(t, n, chunk, found_inf); break;
    case kBF16: nonfinite_kernel<__nv_bfloat16><<<grid, kThreads, 0, s>>>(t, n, chunk, found_inf); break;
    case kF16: nonfinite_kernel<__half><<<grid, kThreads, 0, s>>>(t, n, chunk, found_inf); break;
    default: return -1;
  }
  return static_cast<int>(cudaGetLastError());
}

DS_EXPORT const char* ds_fused_adam_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

// Copies the host table (`bytes` of pageable memory) to the device, ordered on `stream`
// before the launch that reads it. cudaMemcpyAsync returns once a pageable source has been
// staged, so the caller may free it right away. Returns the cudaError_t.
DS_EXPORT int ds_fused_upload(void* device_dst, const void* host_src, int64_t bytes, void* stream) {
  if (bytes <= 0) return 0;
  return static_cast<int>(cudaMemcpyAsync(device_dst, host_src, static_cast<size_t>(bytes), cudaMemcpyHostToDevice,
                                          static_cast<cudaStream_t>(stream)));
}
