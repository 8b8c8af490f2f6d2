// CPU Adam/AdamW as a torch op: `<ns>::adam_step`, its schema below. The op checks every
// tensor (op_boundary.h), computes the step's constants in double exactly as the kernel
// expects them (cpu_hyper.h) and calls the kernel once per distinct step count.
//
// Per-parameter step counts come either as `steps` (the optimizer state's float32 `step`
// tensors, already counting this update: what a torch.compile'd optimizer passes, so no
// count leaves the graph) or as the integer `step` for all of them (ZeRO offload's flat
// partitions). Empty lists stand for "none" (max_exp_avg_sqs without amsgrad, copy_out).
#include <cmath>

#include "cpu_hyper.h"
#include "op_boundary.h"

namespace ds {

inline AdamHyper adam_hyper(int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay,
                            bool decoupled, bool amsgrad, bool maximize, bool bias_correction) {
  const double bc1 = bias_correction ? 1.0 - std::pow(beta1, static_cast<double>(step)) : 1.0;
  const double bc2_sqrt = bias_correction ? std::sqrt(1.0 - std::pow(beta2, static_cast<double>(step))) : 1.0;
  AdamHyper h;
  h.beta1_complement = static_cast<float>(1.0 - beta1);
  h.beta2 = static_cast<float>(beta2);
  h.beta2_complement = static_cast<float>(1.0 - beta2);
  h.eps_scaled = static_cast<float>(eps * bc2_sqrt);
  h.step_scaled = static_cast<float>(lr / bc1 * bc2_sqrt);
  h.weight_decay = static_cast<float>(decoupled ? 0.0 : weight_decay);
  h.decay_factor = static_cast<float>(decoupled ? 1.0 - lr * weight_decay : 1.0);
  h.decoupled = decoupled;
  h.amsgrad = amsgrad;
  h.maximize = maximize;
  return h;
}

void adam_step(Tensors params, Tensors grads, Tensors exp_avgs, Tensors exp_avg_sqs, Tensors max_exp_avg_sqs,
               Tensors copy_out, Tensors steps, int64_t step, double lr, double beta1, double beta2, double eps,
               double weight_decay, bool decoupled, bool amsgrad, bool maximize, bool bias_correction,
               int64_t num_threads) {
  const char* op = "adam_step";
  Batch b = check_batch(op, params, grads, copy_out);
  check_list(op, "exp_avgs", exp_avgs, b.numels, false, ST::Float);
  check_list(op, "exp_avg_sqs", exp_avg_sqs, b.numels, false, ST::Float);
  if (amsgrad && !params.empty() && max_exp_avg_sqs.empty())
    fail("%s: amsgrad=True needs max_exp_avg_sqs", op);
  check_list(op, "max_exp_avg_sqs", max_exp_avg_sqs, b.numels, true, ST::Float);
  const std::vector<int64_t> counts = read_steps(op, steps, step, params.size());
  auto m = ptrs<float>(exp_avgs), v = ptrs<float>(exp_avg_sqs);
  auto vmax = amsgrad ? ptrs<float>(max_exp_avg_sqs) : std::vector<float*>();
  auto outs = ptrs<void>(copy_out);
  for (const auto& idx : group_by_step(counts)) {
    const AdamHyper h = adam_hyper(counts[idx[0]], lr, beta1, beta2, eps, weight_decay, decoupled, amsgrad, maximize,
                                   bias_correction);
    auto n = pick(b.numels, idx);
    auto p = pick(b.params, idx), mi = pick(m, idx), vi = pick(v, idx), vm = pick(vmax, idx);
    auto g = pick(b.grads, idx), o = pick(outs, idx);
    const int rc = ds_cpu_adam_step(static_cast<int64_t>(idx.size()), n.data(), p.data(), g.data(), mi.data(),
                                    vi.data(), data_or_null(vm), data_or_null(o), b.grad_code, b.out_code, &h,
                                    static_cast<int32_t>(num_threads));
    if (rc != 0) fail("%s: the kernel rejected grad dtype code %d / copy-out %d", op, b.grad_code, b.out_code);
  }
}

}  // namespace ds

DS_EXPORT const char* ds_cpu_adam_namespace() { return DS_STR(DS_OPS_NS); }

DS_OPS_LIBRARY(DS_OPS_NS, m) {
  m.def("adam_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
        "Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] copy_out, Tensor[] steps, int step, float lr, float beta1, "
        "float beta2, float eps, float weight_decay, bool decoupled, bool amsgrad, bool maximize, "
        "bool bias_correction, int num_threads) -> ()");
}

DS_OPS_LIBRARY_IMPL(DS_OPS_NS, CompositeExplicitAutograd, m) {
  m.impl("adam_step", TORCH_BOX(&ds::adam_step));
}
