// The CUDA block quantizer as torch ops, with the CPU op's names and schemas
// (quantizer_op.cpp): quantize_into(x, q!, scales!, bits, num_threads) and
// dequantize_into(q, scales, out!, bits, num_threads). num_threads is unused here (the
// schemas are shared so the Python side calls either op the same way).
//
// Host code only (op_common.h says why): every tensor is checked (CUDA, one device, dtype,
// contiguity, sizes) before quantizer.cu's entry points launch on torch's current stream.
#include <torch/csrc/stable/accelerator.h>

#include "op_common.h"

extern "C" {
// torch's C shim (torch/csrc/inductor/aoti_torch/c/shim.h, declared there only under USE_CUDA,
// exported by libtorch_cuda since torch 2.2): the current stream of a device as a cudaStream_t.
// Used instead of the stable API's Stream::nativeHandle(), which torch 2.11 lacks.
int32_t aoti_torch_get_current_cuda_stream(int32_t device_index, void** ret_stream);
int ds_quant_cuda_quantize(const void* x, int dtype, int64_t n, int64_t groups, int bits, int8_t* q, float* scales,
                           void* stream);
int ds_quant_cuda_dequantize(const int8_t* q, const float* scales, int64_t n, int64_t groups, int bits, void* out,
                             int dtype, void* stream);
const char* ds_quant_cuda_error_string(int code);
}

namespace ds {
namespace quantcuda {

inline void check_on(const char* op, const char* name, const Tensor& t, int32_t device) {
  if (!t.is_cuda()) fail("%s: %s is not on a CUDA device; the CUDA op needs CUDA tensors", op, name);
  if (t.get_device_index() != device)
    fail("%s: %s is on cuda:%d, the input on cuda:%d", op, name, int(t.get_device_index()), int(device));
  if (!t.is_contiguous()) fail("%s: %s is not contiguous", op, name);
}

inline void check_layout(const char* op, int64_t n, int64_t groups, int64_t bits) {
  if (bits != 4 && bits != 8) fail("%s: bits must be 4 or 8, got %lld", op, ll(bits));
  if (groups < 1 || n < 1 || n % groups != 0)
    fail("%s: %lld elements do not split into %lld equal blocks", op, ll(n), ll(groups));
  if (bits == 4 && (n / groups) % 2 != 0)
    fail("%s: int4 blocks pack two elements a byte; %lld elements per block is odd", op, ll(n / groups));
  if (groups > 2147483647LL) fail("%s: %lld blocks; at most 2^31 - 1 fit one launch", op, ll(groups));
}

inline void check_packed(const char* op, const Tensor& q, const Tensor& scales, int64_t n, int64_t bits,
                         int32_t device) {
  check_on(op, "q", q, device);
  check_on(op, "scales", scales, device);
  if (q.scalar_type() != ST::Char) fail("%s: q must be int8", op);
  if (scales.scalar_type() != ST::Float)
    fail("%s: scales has dtype %s; expected float32", op, dtype_name(scales.scalar_type()));
  const int64_t bytes = bits == 8 ? n : n / 2;
  if (q.numel() != bytes)
    fail("%s: q has %lld bytes; %lld elements at %lld bits take %lld", op, ll(q.numel()), ll(n), ll(bits), ll(bytes));
}

inline void* current_stream(const char* op, int32_t device) {
  void* stream = nullptr;
  if (aoti_torch_get_current_cuda_stream(device, &stream) != 0)
    fail("%s: no current stream for cuda:%d", op, int(device));
  return stream;
}

inline void check_rc(const char* op, int rc) {
  if (rc != 0)
    fail("%s: launch failed: %s", op, rc < 0 ? "unknown dtype or bit width" : ds_quant_cuda_error_string(rc));
}

void quantize_into(Tensor x, Tensor q, Tensor scales, int64_t bits, int64_t num_threads) {
  const char* op = "quantize_into";
  if (!x.is_cuda()) fail("%s: x is not on a CUDA device; the CUDA op needs CUDA tensors", op);
  const int32_t device = x.get_device_index();
  check_on(op, "x", x, device);
  const int32_t code = dtype_code(x.scalar_type());
  if (code < 0) fail("%s: x has dtype %s; expected float32, bfloat16 or float16", op, dtype_name(x.scalar_type()));
  check_layout(op, x.numel(), scales.numel(), bits);
  check_packed(op, q, scales, x.numel(), bits, device);
  torch::stable::accelerator::DeviceGuard guard(device);
  void* stream = current_stream(op, device);
  check_rc(op, ds_quant_cuda_quantize(x.data_ptr(), code, x.numel(), scales.numel(), static_cast<int>(bits),
                                      static_cast<int8_t*>(q.data_ptr()), static_cast<float*>(scales.data_ptr()),
                                      stream));
}

void dequantize_into(Tensor q, Tensor scales, Tensor out, int64_t bits, int64_t num_threads) {
  const char* op = "dequantize_into";
  if (!out.is_cuda()) fail("%s: out is not on a CUDA device; the CUDA op needs CUDA tensors", op);
  const int32_t device = out.get_device_index();
  check_on(op, "out", out, device);
  const int32_t code = dtype_code(out.scalar_type());
  if (code < 0)
    fail("%s: out has dtype %s; expected float32, bfloat16 or float16", op, dtype_name(out.scalar_type()));
  check_layout(op, out.numel(), scales.numel(), bits);
  check_packed(op, q, scales, out.numel(), bits, device);
  torch::stable::accelerator::DeviceGuard guard(device);
  void* stream = current_stream(op, device);
  check_rc(op, ds_quant_cuda_dequantize(static_cast<const int8_t*>(q.data_ptr()),
                                        static_cast<const float*>(scales.data_ptr()), out.numel(), scales.numel(),
                                        static_cast<int>(bits), out.data_ptr(), code, stream));
}

}  // namespace quantcuda
}  // namespace ds

DS_EXPORT const char* ds_quant_cuda_namespace() { return DS_STR(DS_OPS_NS); }

DS_OPS_LIBRARY(DS_OPS_NS, m) {
  m.def("quantize_into(Tensor x, Tensor(a!) q, Tensor(b!) scales, int bits, int num_threads) -> ()");
  m.def("dequantize_into(Tensor q, Tensor scales, Tensor(a!) out, int bits, int num_threads) -> ()");
}

DS_OPS_LIBRARY_IMPL(DS_OPS_NS, CompositeExplicitAutograd, m) {
  m.impl("quantize_into", TORCH_BOX(&ds::quantcuda::quantize_into));
  m.impl("dequantize_into", TORCH_BOX(&ds::quantcuda::dequantize_into));
}
