// CPU Adam/AdamW over flat fp32 master parameters, one pass per element.
//
// Why no torch headers: <torch/extension.h> turns a 200-line kernel into a 20-second
// compile. The torch op (cpu_adam_op.cpp, torch's stable API only) checks dtypes, sizes
// and contiguity and passes raw pointers to the C entry point below, so this translation
// unit needs only the standard library, OpenMP and the SIMD intrinsics.
//
// The instruction set is fixed at compile time (-mavx512f..., -mavx2, or neither); the
// builder keys its cache on it, so a binary is only loaded on a CPU that can run it.
// Every element is loaded once and stored once per step: the gradient is widened to fp32
// in registers and the optional bf16/fp16 copy of the new parameter is written in the
// same pass, which is what keeps the step at the memory-bandwidth bound.
#include "cpu_hyper.h"
#include "cpu_simd.h"

namespace ds {

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

template <int GD, int OD>
struct AdamSpan {
static void run(const AdamHyper& h, int64_t begin, int64_t end, float* p, const void* g, float* m, float* v,
                float* vmax, void* out) {
  int64_t i = begin;
#if defined(__AVX512F__) || defined(__AVX2__)
  using S = Simd;
  const auto b1c = S::set1(h.beta1_complement), b2 = S::set1(h.beta2), b2c = S::set1(h.beta2_complement);
  const auto eps = S::set1(h.eps_scaled), step = S::set1(h.step_scaled);
  const auto wd = S::set1(h.weight_decay), decay = S::set1(h.decay_factor);
  for (; i + S::kWidth <= end; i += S::kWidth) {
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
};

}  // namespace ds

DS_EXPORT const char* ds_cpu_adam_isa() { return ds::kIsa; }

// Steps `n` tensors; tensor t has numels[t] elements at params[t], grads[t], ... in one
// parallel region (ds::for_each_span). Returns 0, or -1 for an unknown dtype.
DS_EXPORT int ds_cpu_adam_step(int64_t n, const int64_t* numels, float* const* params, void* const* grads,
                               float* const* exp_avgs, float* const* exp_avg_sqs, float* const* max_exp_avg_sqs,
                               void* const* outs, int32_t grad_dtype, int32_t out_dtype, const ds::AdamHyper* hyper,
                               int32_t num_threads) {
  const auto fn = ds::pick_span<ds::AdamSpan>(grad_dtype, out_dtype);
  if (fn == nullptr) return -1;
  const ds::AdamHyper h = *hyper;
  ds::for_each_span(n, numels, num_threads, [&](int64_t t, int64_t b, int64_t e) {
    fn(h, b, e, params[t], grads[t], exp_avgs[t], exp_avg_sqs[t], max_exp_avg_sqs ? max_exp_avg_sqs[t] : nullptr,
       outs ? outs[t] : nullptr);
  });
  return 0;
}
