// What every torch op of ours shares, CPU or CUDA: torch's header-light stable API (see
// op_boundary.h for why), the op namespace macros, the one way to refuse (fail) and the
// dtype names and codes. Nothing CPU-specific: fused_adam_op.cpp includes it without the
// CPU kernels' SIMD header (whose OpenMP pragmas a plain host compile warns about).
#pragma once

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <vector>

#ifndef DS_EXPORT
#define DS_EXPORT extern "C" __attribute__((visibility("default")))
#endif

// The op namespace is unique to each build (-DDS_OPS_NS=ds_<isa>_<nonce>): a process may
// load two builds of one op (two caches, two instruction sets), and torch allows one
// registration per namespace. The indirection expands the macro before torch pastes it.
#define DS_OPS_LIBRARY(ns, m) STABLE_TORCH_LIBRARY(ns, m)
#define DS_OPS_LIBRARY_IMPL(ns, k, m) STABLE_TORCH_LIBRARY_IMPL(ns, k, m)
#define DS_STR2(x) #x
#define DS_STR(x) DS_STR2(x)

namespace ds {

using torch::stable::Tensor;
using Tensors = std::vector<Tensor>;
using ST = torch::headeronly::ScalarType;

// Throws the printf-formatted message (the ops' one way to refuse).
[[noreturn]] __attribute__((noinline, cold, format(printf, 1, 2))) inline void fail(const char* fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  throw std::runtime_error(msg);
}

using ll = long long;

inline const char* dtype_name(ST t) {
  switch (t) {
    case ST::Float: return "float32";
    case ST::BFloat16: return "bfloat16";
    case ST::Half: return "float16";
    case ST::Double: return "float64";
    default: return "a dtype other than float32/bfloat16/float16";
  }
}

// The kernels' dtype codes (cpu_simd.h's kF32/kBF16/kF16, fused_adam.cu's too); -2: none.
inline int32_t dtype_code(ST t) {
  switch (t) {
    case ST::Float: return 0;
    case ST::BFloat16: return 1;
    case ST::Half: return 2;
    default: return -2;
  }
}

}  // namespace ds
