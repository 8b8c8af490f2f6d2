// The CPU block quantizer as torch ops (kernel: quantizer.cpp, maths: quantize_ref.py):
//
//   <ns>::quantize_into(Tensor x, Tensor(a!) q, Tensor(b!) scales, int bits, int num_threads) -> ()
//   <ns>::dequantize_into(Tensor q, Tensor scales, Tensor(a!) out, int bits, int num_threads) -> ()
//
// The caller allocates the outputs (as the optimizer ops, these only write their arguments):
// x of n elements in scales.numel() blocks gives q of n (8 bits) or n/2 (4 bits) int8 bytes.
// Every tensor is checked here before the kernel sees a pointer; one RuntimeError names the
// argument (op_common.h).
#include "op_common.h"

extern "C" {
int ds_quantize(const void* x, int32_t x_dtype, int64_t n, int64_t groups, int32_t bits, int8_t* q, float* scales,
                int32_t num_threads);
int ds_dequantize(const int8_t* q, const float* scales, int64_t n, int64_t groups, int32_t bits, void* out,
                  int32_t out_dtype, int32_t num_threads);
}

namespace ds {
namespace quantop {

inline void check_cpu(const char* op, const char* name, const Tensor& t) {
  if (!t.is_cpu()) fail("%s: %s is not on the CPU; the CPU op needs CPU tensors", op, name);
  if (!t.is_contiguous()) fail("%s: %s is not contiguous", op, name);
}

// The block size of n elements in `groups` blocks at `bits`, or a refusal.
inline int64_t block_size(const char* op, int64_t n, int64_t groups, int64_t bits) {
  if (bits != 4 && bits != 8) fail("%s: bits must be 4 or 8, got %lld", op, ll(bits));
  if (groups < 1 || n < 1 || n % groups != 0)
    fail("%s: %lld elements do not split into %lld equal blocks", op, ll(n), ll(groups));
  const int64_t e = n / groups;
  if (bits == 4 && e % 2 != 0)
    fail("%s: int4 blocks pack two elements a byte; %lld elements per block is odd", op, ll(e));
  return e;
}

inline void check_packed(const char* op, const Tensor& q, const Tensor& scales, int64_t n, int64_t bits) {
  check_cpu(op, "q", q);
  check_cpu(op, "scales", scales);
  if (q.scalar_type() != ST::Char) fail("%s: q must be int8", op);
  if (scales.scalar_type() != ST::Float) fail("%s: scales has dtype %s; expected float32", op,
                                              dtype_name(scales.scalar_type()));
  const int64_t bytes = bits == 8 ? n : n / 2;
  if (q.numel() != bytes) fail("%s: q has %lld bytes; %lld elements at %lld bits take %lld", op, ll(q.numel()), ll(n),
                               ll(bits), ll(bytes));
}

void quantize_into(Tensor x, Tensor q, Tensor scales, int64_t bits, int64_t num_threads) {
  const char* op = "quantize_into";
  check_cpu(op, "x", x);
  const int32_t code = dtype_code(x.scalar_type());
  if (code < 0) fail("%s: x has dtype %s; expected float32, bfloat16 or float16", op, dtype_name(x.scalar_type()));
  block_size(op, x.numel(), scales.numel(), bits);
  check_packed(op, q, scales, x.numel(), bits);
  const int rc = ds_quantize(x.data_ptr(), code, x.numel(), scales.numel(), static_cast<int32_t>(bits),
                             static_cast<int8_t*>(q.data_ptr()), static_cast<float*>(scales.data_ptr()),
                             static_cast<int32_t>(num_threads));
  if (rc != 0) fail("%s: the kernel rejected dtype code %d / %lld bits", op, code, ll(bits));
}

void dequantize_into(Tensor q, Tensor scales, Tensor out, int64_t bits, int64_t num_threads) {
  const char* op = "dequantize_into";
  check_cpu(op, "out", out);
  const int32_t code = dtype_code(out.scalar_type());
  if (code < 0) fail("%s: out has dtype %s; expected float32, bfloat16 or float16", op,
                     dtype_name(out.scalar_type()));
  block_size(op, out.numel(), scales.numel(), bits);
  check_packed(op, q, scales, out.numel(), bits);
  const int rc = ds_dequantize(static_cast<const int8_t*>(q.data_ptr()), static_cast<const float*>(scales.data_ptr()),
                               out.numel(), scales.numel(), static_cast<int32_t>(bits), out.data_ptr(), code,
                               static_cast<int32_t>(num_threads));
  if (rc != 0) fail("%s: the kernel rejected dtype code %d / %lld bits", op, code, ll(bits));
}

}  // namespace quantop
}  // namespace ds

DS_EXPORT const char* ds_quant_namespace() { return DS_STR(DS_OPS_NS); }

DS_OPS_LIBRARY(DS_OPS_NS, m) {
  m.def("quantize_into(Tensor x, Tensor(a!) q, Tensor(b!) scales, int bits, int num_threads) -> ()");
  m.def("dequantize_into(Tensor q, Tensor scales, Tensor(a!) out, int bits, int num_threads) -> ()");
}

DS_OPS_LIBRARY_IMPL(DS_OPS_NS, CompositeExplicitAutograd, m) {
  m.impl("quantize_into", TORCH_BOX(&ds::quantop::quantize_into));
  m.impl("dequantize_into", TORCH_BOX(&ds::quantop::dequantize_into));
}
