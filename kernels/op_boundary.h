// The torch side of the CPU optimizer ops: checks every tensor that crosses into a kernel
// and hands the kernel raw pointers. Shared by cpu_adam_op.cpp, cpu_lion_op.cpp and
// cpu_adagrad_op.cpp, each compiled into the same library as its kernel.
//
// Header-light on purpose: only torch's stable C++ API (torch/csrc/stable/*), which
// compiles in about a second, where <torch/extension.h> takes 20 s and <torch/library.h>
// 5 s on a 2-core machine; the kernels themselves (cpu_adam.cpp, ...) include no torch
// header at all. A refusal throws std::runtime_error, which torch hands to Python as one
// RuntimeError naming the op, the argument and its index. (Messages are formatted by one
// out-of-line printf-style function rather than STD_TORCH_CHECK, which would prefix our
// function, file and line to every message; std::string concatenation at every call site
// instead cost this file 30% more compile time.) The ops are registered for every device
// (CompositeExplicitAutograd), so a GPU tensor reaches these checks and is named, rather
// than meeting torch's generic "no kernel for this backend"; meta and fake tensors go to
// the Python fake implementations (torch_ops.py), which run the same checks.
#pragma once

#include "cpu_simd.h"
#include "op_common.h"

namespace ds {

static_assert(kF32 == 0 && kBF16 == 1 && kF16 == 2, "op_common.h's dtype_code must give the kernels' codes");

// Pointers and sizes of one checked call.
struct Batch {
  std::vector<int64_t> numels;
  std::vector<float*> params;
  std::vector<void*> grads;
  int32_t grad_code = kF32;
  int32_t out_code = kNone;
};

// Every tensor of `ts` on CPU, of dtype `want` (or, for want_any, the dtype of ts[0]),
// contiguous, with numels[i] elements. A list may be empty only where `optional`.
inline void check_list(const char* op, const char* name, const Tensors& ts, const std::vector<int64_t>& numels,
                       bool optional, ST want) {
  if (optional && ts.empty()) return;
  if (ts.size() != numels.size()) fail("%s: %zu params but %zu %s", op, numels.size(), ts.size(), name);
  for (size_t i = 0; i < ts.size(); ++i) {
    const Tensor& t = ts[i];
    if (!t.is_cpu()) fail("%s: %s[%zu] is not on the CPU; the CPU op needs CPU tensors", op, name, i);
    if (t.scalar_type() != want)
      fail("%s: %s[%zu] has dtype %s; expected %s", op, name, i, dtype_name(t.scalar_type()), dtype_name(want));
    if (t.numel() != numels[i])
      fail("%s: %s[%zu] has %lld elements, the parameter has %lld", op, name, i, ll(t.numel()), ll(numels[i]));
    if (!t.is_contiguous()) fail("%s: %s[%zu] is not contiguous; the update would be lost in a copy", op, name, i);
  }
}

template <typename T>
inline std::vector<T*> ptrs(const Tensors& ts) {
  std::vector<T*> out;
  out.reserve(ts.size());
  for (const Tensor& t : ts) out.push_back(static_cast<T*>(t.data_ptr()));
  return out;
}

// params (fp32), grads (fp32/bf16/fp16, one dtype), copy_out (empty, or bf16/fp16, one dtype).
inline Batch check_batch(const char* op, const Tensors& params, const Tensors& grads, const Tensors& copy_out) {
  Batch b;
  b.numels.reserve(params.size());
  for (const Tensor& p : params) b.numels.push_back(p.numel());
  check_list(op, "params", params, b.numels, false, ST::Float);
  if (!grads.empty()) {
    b.grad_code = dtype_code(grads[0].scalar_type());
    if (b.grad_code < 0)
      fail("%s: grads[0] has dtype %s; expected float32, bfloat16 or float16", op, dtype_name(grads[0].scalar_type()));
  }
  check_list(op, "grads", grads, b.numels, false, grads.empty() ? ST::Float : grads[0].scalar_type());
  if (!copy_out.empty()) {
    const ST t = copy_out[0].scalar_type();
    if (t != ST::BFloat16 && t != ST::Half)
      fail("%s: copy_out[0] has dtype %s; expected bfloat16 or float16", op, dtype_name(t));
    b.out_code = dtype_code(t);
    check_list(op, "copy_out", copy_out, b.numels, true, t);
  }
  b.params = ptrs<float>(params);
  b.grads = ptrs<void>(grads);
  return b;
}

// Step counts: one 1-element float32 CPU tensor per parameter (the optimizer state's
// `step`, already counting this update), or none, and then `step` for all.
inline std::vector<int64_t> read_steps(const char* op, const Tensors& steps, int64_t step, size_t n) {
  std::vector<int64_t> out(n, step);
  if (steps.empty()) {
    if (n > 0 && step < 1) fail("%s: step must be >= 1 (the count after this update), got %lld", op, ll(step));
    return out;
  }
  if (steps.size() != n) fail("%s: %zu params but %zu steps", op, n, steps.size());
  for (size_t i = 0; i < n; ++i) {
    const Tensor& s = steps[i];
    if (!s.is_cpu() || s.scalar_type() != ST::Float || s.numel() != 1)
      fail("%s: steps[%zu] must be a one-element float32 CPU tensor (got %s, %lld elements)", op, i,
           dtype_name(s.scalar_type()), ll(s.numel()));
    out[i] = static_cast<int64_t>(*static_cast<const float*>(s.data_ptr()));
    if (out[i] < 1) fail("%s: steps[%zu] is %lld; it must count this update (>= 1)", op, i, ll(out[i]));
  }
  return out;
}

// The indices of the parameters that share each distinct step count, in first-seen order.
inline std::vector<std::vector<size_t>> group_by_step(const std::vector<int64_t>& steps) {
  std::vector<int64_t> seen;
  std::vector<std::vector<size_t>> groups;
  for (size_t i = 0; i < steps.size(); ++i) {
    size_t g = 0;
    while (g < seen.size() && seen[g] != steps[i]) ++g;
    if (g == seen.size()) {
      seen.push_back(steps[i]);
      groups.emplace_back();
    }
    groups[g].push_back(i);
  }
  return groups;
}

template <typename T>
inline std::vector<T> pick(const std::vector<T>& all, const std::vector<size_t>& idx) {
  std::vector<T> out;
  if (all.empty()) return out;
  out.reserve(idx.size());
  for (size_t i : idx) out.push_back(all[i]);
  return out;
}

template <typename T>
inline T* data_or_null(std::vector<T>& v) {
  return v.empty() ? nullptr : v.data();
}

}  // namespace ds
