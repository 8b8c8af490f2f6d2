// CPU Adagrad as a torch op: `<ns>::adagrad_step` (see cpu_adam_op.cpp for the layout and
// the two ways to give step counts). The learning-rate decay is folded in here, in double:
// clr = lr / (1 + (step-1)*lr_decay), as torch.optim.Adagrad computes it.
#include "cpu_hyper.h"
#include "op_boundary.h"

namespace ds {

void adagrad_step(Tensors params, Tensors grads, Tensors sums, Tensors copy_out, Tensors steps, int64_t step,
                  double lr, double lr_decay, double eps, double weight_decay, bool maximize, int64_t num_threads) {
  const char* op = "adagrad_step";
  Batch b = check_batch(op, params, grads, copy_out);
  check_list(op, "sums", sums, b.numels, false, ST::Float);
  const std::vector<int64_t> counts = read_steps(op, steps, step, params.size());
  auto s = ptrs<float>(sums);
  auto outs = ptrs<void>(copy_out);
  for (const auto& idx : group_by_step(counts)) {
    AdagradHyper h;
    h.clr = static_cast<float>(lr / (1.0 + static_cast<double>(counts[idx[0]] - 1) * lr_decay));
    h.eps = static_cast<float>(eps);
    h.weight_decay = static_cast<float>(weight_decay);
    h.maximize = maximize;
    auto n = pick(b.numels, idx);
    auto p = pick(b.params, idx), si = pick(s, idx);
    auto g = pick(b.grads, idx), o = pick(outs, idx);
    const int rc = ds_cpu_adagrad_step(static_cast<int64_t>(idx.size()), n.data(), p.data(), g.data(), si.data(),
                                       data_or_null(o), b.grad_code, b.out_code, &h, static_cast<int32_t>(num_threads));
    if (rc != 0) fail("%s: the kernel rejected grad dtype code %d / copy-out %d", op, b.grad_code, b.out_code);
  }
}

}  // namespace ds

DS_EXPORT const char* ds_cpu_adagrad_namespace() { return DS_STR(DS_OPS_NS); }

DS_OPS_LIBRARY(DS_OPS_NS, m) {
  m.def("adagrad_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] sums, Tensor(c!)[] copy_out, "
        "Tensor[] steps, int step, float lr, float lr_decay, float eps, float weight_decay, bool maximize, "
        "int num_threads) -> ()");
}

DS_OPS_LIBRARY_IMPL(DS_OPS_NS, CompositeExplicitAutograd, m) {
  m.impl("adagrad_step", TORCH_BOX(&ds::adagrad_step));
}
