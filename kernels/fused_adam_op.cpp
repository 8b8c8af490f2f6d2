// The CUDA fused Adam as torch ops: `<ns>::adam_step` and `<ns>::nonfinite`, schemas below.
//
// Host code only, through torch's header-light stable API (op_common.h, op_boundary.h say why): it
// checks every tensor at the boundary (CUDA, one device, dtype, contiguity, sizes; one
// error naming the argument and index), writes the table of raw pointers that the kernels
// read (fused_adam.cu's Entry rows) into a fresh device tensor from torch's caching
// allocator, and launches on torch's current stream of the tensors' device. No CUDA
// header is needed here: the stream crosses as the native handle torch gives, the copy and
// the launches happen in fused_adam.cu's C entry points, linked into the same library.
//
// One call steps one bucket: parameters of one dtype with gradients of one dtype on one
// device (FusedAdam groups them). The kernel increments the step counts on the device
// (unless found_inf is set); a call whose tensors are all empty launches nothing and
// leaves the counts to the caller.
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/ops.h>

#include <optional>

#include "op_common.h"

// fused_adam.cu's entry points (the kernels' own C ABI).
extern "C" {
int ds_fused_adam_step(const void* table, int n, int64_t blocks, int64_t chunk, int param_dtype, int grad_dtype,
                       const void* hyper, const float* grad_scale, const float* found_inf, unsigned int* done,
                       void* stream);
int ds_fused_nonfinite(const void* table, int n, int64_t blocks, int64_t chunk, int grad_dtype, float* found_inf,
                       void* stream);
int ds_fused_upload(void* device_dst, const void* host_src, int64_t bytes, void* stream);
const char* ds_fused_adam_error_string(int code);
}

namespace ds {
namespace fused {

constexpr int64_t kChunk = 1 << 16;  // elements per thread block
constexpr int kRow = 8;              // int64 fields of fused_adam.cu's Entry

// Mirrors `struct Hyper` in fused_adam.cu.
struct Hyper {
  float lr, beta1, beta2, eps, weight_decay;
  int32_t decoupled, amsgrad, maximize, bias_correction;
};

// One bucket's device, and the per-tensor sizes every other list must match.
struct Bucket {
  int32_t device = 0;
  std::vector<int64_t> numels;
};

// Every tensor of `ts` on CUDA device `b.device`, contiguous, with numels[i] elements, of
// dtype `want`. An empty list is allowed only where `optional`.
inline void check_cuda_list(const char* op, const char* name, const Tensors& ts, const Bucket& b, bool optional,
                            ST want) {
  if (optional && ts.empty()) return;
  if (ts.size() != b.numels.size()) fail("%s: %zu params but %zu %s", op, b.numels.size(), ts.size(), name);
  for (size_t i = 0; i < ts.size(); ++i) {
    const Tensor& t = ts[i];
    if (!t.is_cuda()) fail("%s: %s[%zu] is not on a CUDA device; the fused op needs CUDA tensors", op, name, i);
    if (t.get_device_index() != b.device)
      fail("%s: %s[%zu] is on cuda:%d, params[0] on cuda:%d; one call steps one device", op, name, i,
           int(t.get_device_index()), int(b.device));
    if (t.scalar_type() != want)
      fail("%s: %s[%zu] has dtype %s; expected %s", op, name, i, dtype_name(t.scalar_type()), dtype_name(want));
    if (t.numel() != b.numels[i])
      fail("%s: %s[%zu] has %lld elements, the parameter has %lld", op, name, i, ll(t.numel()), ll(b.numels[i]));
    if (!t.is_contiguous()) fail("%s: %s[%zu] is not contiguous; the update would be lost in a copy", op, name, i);
  }
}

// A one-element tensor of `want` on the bucket's device (a step count, a flag, a counter).
inline void check_scalar(const char* op, const char* name, const Tensor& t, const Bucket& b, ST want) {
  if (!t.is_cuda() || t.get_device_index() != b.device || t.scalar_type() != want || t.numel() != 1)
    fail("%s: %s must be one %s element on cuda:%d (got %s, %lld elements, %s)", op, name, dtype_name(want),
         int(b.device), dtype_name(t.scalar_type()), ll(t.numel()), t.is_cuda() ? "on a CUDA device" : "not on CUDA");
}

// The dtype shared by every tensor of a non-empty list, one of float32/bfloat16/float16
// (the device is checked first, as the fake implementation does).
inline ST list_dtype(const char* op, const char* name, const Tensors& ts) {
  if (!ts[0].is_cuda()) fail("%s: %s[0] is not on a CUDA device; the fused op needs CUDA tensors", op, name);
  const ST t = ts[0].scalar_type();
  if (dtype_code(t) < 0) fail("%s: %s[0] has dtype %s; expected float32, bfloat16 or float16", op, name, dtype_name(t));
  return t;
}

inline Bucket bucket_of(const char* op, const Tensors& params) {
  Bucket b;
  if (!params[0].is_cuda()) fail("%s: params[0] is not on a CUDA device; the fused op needs CUDA tensors", op);
  b.device = params[0].get_device_index();
  for (const Tensor& p : params) b.numels.push_back(p.numel());
  return b;
}

inline void check_rc(const char* op, int rc, const char* what) {
  if (rc != 0) fail("%s: %s failed: %s", op, what, rc < 0 ? "unknown dtype" : ds_fused_adam_error_string(rc));
}

// The table rows (param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step, numel,
// chunk_begin) on the device, uploaded on `stream`; `blocks` receives the chunk count.
inline Tensor device_table(const char* op, const Tensor& like, const std::vector<int64_t>& numels,
                           const std::vector<const Tensors*>& columns, void* stream, int64_t* blocks) {
  const size_t n = numels.size();
  std::vector<int64_t> rows(n * kRow, 0);
  int64_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    int64_t* r = &rows[i * kRow];
    for (size_t c = 0; c < columns.size(); ++c) {
      const Tensors* col = columns[c];
      if (col != nullptr && !col->empty()) r[c] = reinterpret_cast<int64_t>((*col)[i].data_ptr());
    }
    r[6] = numels[i];
    r[7] = total;
    total += (numels[i] + kChunk - 1) / kChunk;
  }
  *blocks = total;
  Tensor table = torch::stable::new_empty(like, {static_cast<int64_t>(n * kRow)}, ST::Long);
  check_rc(op, ds_fused_upload(table.data_ptr(), rows.data(), static_cast<int64_t>(rows.size() * sizeof(int64_t)),
                               stream),
           "copying the pointer table to the device");
  return table;
}

// Torch's current stream on the bucket's device (a cudaStream_t), with that device current.
inline void* current_stream(int32_t device) {
  return torch::stable::accelerator::getCurrentStream(device).nativeHandle();
}

void adam_step(Tensors params, Tensors grads, Tensors exp_avgs, Tensors exp_avg_sqs, Tensors max_exp_avg_sqs,
               Tensors steps, Tensor done, std::optional<Tensor> grad_scale, std::optional<Tensor> found_inf,
               double lr, double beta1, double beta2, double eps, double weight_decay, bool decoupled, bool amsgrad,
               bool maximize, bool bias_correction) {
  const char* op = "fused adam_step";
  if (params.empty()) return;
  const Bucket b = bucket_of(op, params);
  const ST p_dtype = list_dtype(op, "params", params);
  check_cuda_list(op, "params", params, b, false, p_dtype);
  if (grads.empty()) fail("%s: %zu params but 0 grads", op, params.size());
  const ST g_dtype = list_dtype(op, "grads", grads);
  check_cuda_list(op, "grads", grads, b, false, g_dtype);
  check_cuda_list(op, "exp_avgs", exp_avgs, b, false, ST::Float);
  check_cuda_list(op, "exp_avg_sqs", exp_avg_sqs, b, false, ST::Float);
  if (amsgrad && max_exp_avg_sqs.empty()) fail("%s: amsgrad=True needs max_exp_avg_sqs", op);
  check_cuda_list(op, "max_exp_avg_sqs", max_exp_avg_sqs, b, true, ST::Float);
  if (steps.size() != params.size()) fail("%s: %zu params but %zu steps", op, params.size(), steps.size());
  char name[32];
  for (size_t i = 0; i < steps.size(); ++i) {
    std::snprintf(name, sizeof name, "steps[%zu]", i);
    check_scalar(op, name, steps[i], b, ST::Float);
  }
  check_scalar(op, "done", done, b, ST::Int);
  if (grad_scale.has_value()) check_scalar(op, "grad_scale", *grad_scale, b, ST::Float);
  if (found_inf.has_value()) check_scalar(op, "found_inf", *found_inf, b, ST::Float);

  torch::stable::accelerator::DeviceGuard guard(b.device);
  void* stream = current_stream(b.device);
  const Tensors* vmax = amsgrad ? &max_exp_avg_sqs : nullptr;
  int64_t blocks = 0;
  const Tensor table =
      device_table(op, params[0], b.numels, {&params, &grads, &exp_avgs, &exp_avg_sqs, vmax, &steps}, stream, &blocks);
  if (blocks == 0) return;
  const Hyper h{static_cast<float>(lr), static_cast<float>(beta1), static_cast<float>(beta2), static_cast<float>(eps),
                static_cast<float>(weight_decay), decoupled, amsgrad, maximize, bias_correction};
  const float* scale = grad_scale.has_value() ? static_cast<const float*>(grad_scale->data_ptr()) : nullptr;
  const float* inf = found_inf.has_value() ? static_cast<const float*>(found_inf->data_ptr()) : nullptr;
  check_rc(op,
           ds_fused_adam_step(table.data_ptr(), static_cast<int>(params.size()), blocks, kChunk, dtype_code(p_dtype),
                              dtype_code(g_dtype), &h, scale, inf, static_cast<unsigned int*>(done.data_ptr()), stream),
           "the Adam launch");
}

// Sets found_inf to 1 when a gradient holds an inf or NaN (it never clears it: the caller
// zeroes it once for a whole step's buckets).
void nonfinite(Tensors grads, Tensor found_inf) {
  const char* op = "fused nonfinite";
  if (grads.empty()) return;
  const Bucket b = bucket_of(op, grads);
  const ST g_dtype = list_dtype(op, "grads", grads);
  check_cuda_list(op, "grads", grads, b, false, g_dtype);
  check_scalar(op, "found_inf", found_inf, b, ST::Float);
  torch::stable::accelerator::DeviceGuard guard(b.device);
  void* stream = current_stream(b.device);
  int64_t blocks = 0;
  const Tensor table = device_table(op, grads[0], b.numels, {nullptr, &grads}, stream, &blocks);
  if (blocks == 0) return;
  check_rc(op,
           ds_fused_nonfinite(table.data_ptr(), static_cast<int>(grads.size()), blocks, kChunk, dtype_code(g_dtype),
                              static_cast<float*>(found_inf.data_ptr()), stream),
           "the inf/NaN check");
}

}  // namespace fused
}  // namespace ds

DS_EXPORT const char* ds_fused_adam_namespace() { return DS_STR(DS_OPS_NS); }

DS_OPS_LIBRARY(DS_OPS_NS, m) {
  m.def("adam_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
        "Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] steps, Tensor(f!) done, Tensor? grad_scale, Tensor? found_inf, "
        "float lr, float beta1, float beta2, float eps, float weight_decay, bool decoupled, bool amsgrad, "
        "bool maximize, bool bias_correction) -> ()");
  m.def("nonfinite(Tensor[] grads, Tensor(a!) found_inf) -> ()");
}

DS_OPS_LIBRARY_IMPL(DS_OPS_NS, CompositeExplicitAutograd, m) {
  m.impl("adam_step", TORCH_BOX(&ds::fused::adam_step));
  m.impl("nonfinite", TORCH_BOX(&ds::fused::nonfinite));
}
