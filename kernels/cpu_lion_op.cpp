// CPU Lion as a torch op: `<ns>::lion_step` (see cpu_adam_op.cpp for the layout; Lion has
// no step count). copy_out may be empty.
#include "cpu_hyper.h"
#include "op_boundary.h"

namespace ds {

void lion_step(Tensors params, Tensors grads, Tensors exp_avgs, Tensors copy_out, double lr, double beta1,
               double beta2, double weight_decay, int64_t num_threads) {
  const char* op = "lion_step";
  Batch b = check_batch(op, params, grads, copy_out);
  check_list(op, "exp_avgs", exp_avgs, b.numels, false, ST::Float);
  if (params.empty()) return;
  LionHyper h;
  h.lr = static_cast<float>(lr);
  h.beta1 = static_cast<float>(beta1);
  h.beta1_complement = static_cast<float>(1.0 - beta1);
  h.beta2 = static_cast<float>(beta2);
  h.beta2_complement = static_cast<float>(1.0 - beta2);
  h.decay_factor = static_cast<float>(1.0 - lr * weight_decay);
  auto m = ptrs<float>(exp_avgs);
  auto outs = ptrs<void>(copy_out);
  const int rc = ds_cpu_lion_step(static_cast<int64_t>(params.size()), b.numels.data(), b.params.data(),
                                  b.grads.data(), m.data(), data_or_null(outs), b.grad_code, b.out_code, &h,
                                  static_cast<int32_t>(num_threads));
  if (rc != 0) fail("%s: the kernel rejected grad dtype code %d / copy-out %d", op, b.grad_code, b.out_code);
}

}  // namespace ds

DS_EXPORT const char* ds_cpu_lion_namespace() { return DS_STR(DS_OPS_NS); }

DS_OPS_LIBRARY(DS_OPS_NS, m) {
  m.def("lion_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] copy_out, float lr, "
        "float beta1, float beta2, float weight_decay, int num_threads) -> ()");
}

DS_OPS_LIBRARY_IMPL(DS_OPS_NS, CompositeExplicitAutograd, m) {
  m.impl("lion_step", TORCH_BOX(&ds::lion_step));
}
