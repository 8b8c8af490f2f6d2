// CPU Lion over flat fp32 master parameters, one pass per element (see cpu_adam.cpp for
// why there are no torch headers and how the instruction set is chosen).
//
// Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"):
//   c = beta1*m + (1-beta1)*g;  p = p*(1 - lr*wd) - lr*sign(c);  m = beta2*m + (1-beta2)*g
// sign() follows torch.sign: 0 stays 0 (a parameter whose gradient and momentum are both 0
// does not move), NaN stays NaN. Gradients may be fp32, bf16 or fp16; the new parameters
// can be written to a bf16/fp16 copy in the same pass, as for Adam.
#include "cpu_hyper.h"
#include "cpu_simd.h"

namespace ds {

template <int GD, int OD>
struct LionSpan {
  static void run(const LionHyper& h, int64_t begin, int64_t end, float* p, const void* g, float* m, void* out) {
    int64_t i = begin;
#if defined(__AVX512F__) || defined(__AVX2__)
    using S = Simd;
    const auto lr = S::set1(h.lr), b1 = S::set1(h.beta1), b1c = S::set1(h.beta1_complement);
    const auto b2 = S::set1(h.beta2), b2c = S::set1(h.beta2_complement), decay = S::set1(h.decay_factor);
    for (; i + S::kWidth <= end; i += S::kWidth) {
      const auto grad = S::template load_grad<GD>(g, i);
      const auto mi = S::load(m + i);
      const auto c = S::fma(b1c, grad, S::mul(b1, mi));
      const auto param = S::sub(S::mul(S::load(p + i), decay), S::signed_step(c, lr));
      S::store(p + i, param);
      S::store(m + i, S::fma(b2c, grad, S::mul(b2, mi)));
      if (OD != kNone) S::template store_out<OD>(out, i, param);
    }
#endif
    for (; i < end; ++i) {
      const float grad = load_grad_scalar<GD>(g, i);
      const float mi = m[i];
      const float c = std::fma(h.beta1_complement, grad, h.beta1 * mi);
      const float param = p[i] * h.decay_factor - signed_step(c, h.lr);
      p[i] = param;
      m[i] = std::fma(h.beta2_complement, grad, h.beta2 * mi);
      store_out_scalar<OD>(out, i, param);
    }
  }
};

}  // namespace ds

DS_EXPORT const char* ds_cpu_lion_isa() { return ds::kIsa; }

// Steps `n` tensors in one parallel region. Returns 0, or -1 for an unknown dtype.
DS_EXPORT int ds_cpu_lion_step(int64_t n, const int64_t* numels, float* const* params, void* const* grads,
                               float* const* exp_avgs, void* const* outs, int32_t grad_dtype, int32_t out_dtype,
                               const ds::LionHyper* hyper, int32_t num_threads) {
  const auto fn = ds::pick_span<ds::LionSpan>(grad_dtype, out_dtype);
  if (fn == nullptr) return -1;
  const ds::LionHyper h = *hyper;
  ds::for_each_span(n, numels, num_threads, [&](int64_t t, int64_t b, int64_t e) {
    fn(h, b, e, params[t], grads[t], exp_avgs[t], outs ? outs[t] : nullptr);
  });
  return 0;
}
