// CPU Adagrad over flat fp32 master parameters, one pass per element (see cpu_adam.cpp for
// why there are no torch headers and how the instruction set is chosen).
//
// torch.optim.Adagrad's update, with the learning-rate decay folded in by the op (cpu_adagrad_op.cpp):
//   g = +-g + wd*p;  sum += g*g;  p -= clr * g / (sqrt(sum) + eps),  clr = lr / (1 + (step-1)*lr_decay)
// Gradients may be fp32, bf16 or fp16; the new parameters can be written to a bf16/fp16
// copy in the same pass, as for Adam.
#include "cpu_hyper.h"
#include "cpu_simd.h"

namespace ds {

template <int GD, int OD>
struct AdagradSpan {
  static void run(const AdagradHyper& h, int64_t begin, int64_t end, float* p, const void* g, float* sum,
                  void* out) {
    int64_t i = begin;
#if defined(__AVX512F__) || defined(__AVX2__)
    using S = Simd;
    const auto clr = S::set1(h.clr), eps = S::set1(h.eps), wd = S::set1(h.weight_decay);
    for (; i + S::kWidth <= end; i += S::kWidth) {
      auto grad = S::template load_grad<GD>(g, i);
      if (h.maximize) grad = S::neg(grad);
      auto param = S::load(p + i);
      grad = S::fma(wd, param, grad);
      const auto si = S::fma(grad, grad, S::load(sum + i));
      param = S::sub(param, S::mul(clr, S::div(grad, S::add(S::sqrt(si), eps))));
      S::store(p + i, param);
      S::store(sum + i, si);
      if (OD != kNone) S::template store_out<OD>(out, i, param);
    }
#endif
    for (; i < end; ++i) {
      float grad = load_grad_scalar<GD>(g, i);
      if (h.maximize) grad = -grad;
      float param = p[i];
      grad = std::fma(h.weight_decay, param, grad);
      const float si = std::fma(grad, grad, sum[i]);
      param -= h.clr * (grad / (std::sqrt(si) + h.eps));
      p[i] = param;
      sum[i] = si;
      store_out_scalar<OD>(out, i, param);
    }
  }
};

}  // namespace ds

DS_EXPORT const char* ds_cpu_adagrad_isa() { return ds::kIsa; }

// Steps `n` tensors in one parallel region. Returns 0, or -1 for an unknown dtype.
DS_EXPORT int ds_cpu_adagrad_step(int64_t n, const int64_t* numels, float* const* params, void* const* grads,
                                  float* const* sums, void* const* outs, int32_t grad_dtype, int32_t out_dtype,
                                  const ds::AdagradHyper* hyper, int32_t num_threads) {
  const auto fn = ds::pick_span<ds::AdagradSpan>(grad_dtype, out_dtype);
  if (fn == nullptr) return -1;
  const ds::AdagradHyper h = *hyper;
  ds::for_each_span(n, numels, num_threads, [&](int64_t t, int64_t b, int64_t e) {
    fn(h, b, e, params[t], grads[t], sums[t], outs ? outs[t] : nullptr);
  });
  return 0;
}
