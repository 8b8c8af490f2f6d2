// The C entry points of the CPU optimizer kernels and the hyperparameters each reads,
// shared by the kernel (cpu_<op>.cpp, no torch headers) and its torch op
// (cpu_<op>_op.cpp), which computes them in double from the op's arguments and rounds
// each once to float.
#pragma once

#include <cstdint>

namespace ds {
// Adam: the op folds the bias corrections in (in double), so the inner loop does one
// sqrt and one division:
//   p -= step_size * m / (sqrt(v)/bc2 + eps)  ==  p -= (step_size*bc2) * m / (sqrt(v) + eps*bc2)
struct AdamHyper {
  float beta1_complement;  // 1 - beta1 (exp_avg is a lerp towards the gradient)
  float beta2;
  float beta2_complement;  // 1 - beta2
  float eps_scaled;        // eps * sqrt(1 - beta2^step)
  float step_scaled;       // lr / (1 - beta1^step) * sqrt(1 - beta2^step)
  float weight_decay;      // L2 coefficient added to the gradient (Adam mode)
  float decay_factor;      // 1 - lr*weight_decay applied to the parameter (AdamW mode)
  int32_t decoupled;       // 1: AdamW, 0: Adam with L2 in the gradient
  int32_t amsgrad;
  int32_t maximize;
};

struct LionHyper {
  float lr;
  float beta1;
  float beta1_complement;  // 1 - beta1
  float beta2;
  float beta2_complement;  // 1 - beta2
  float decay_factor;      // 1 - lr*weight_decay (decoupled, as in the paper)
};

struct AdagradHyper {
  float clr;           // the step's learning rate after lr_decay
  float eps;
  float weight_decay;  // L2 coefficient added to the gradient, as torch's Adagrad does
  int32_t maximize;
};

}  // namespace ds

// Each steps `n` tensors (tensor t has numels[t] elements at params[t], grads[t], ...) in
// one parallel region and returns 0, or -1 for an unknown dtype code.
extern "C" {
const char* ds_cpu_adam_isa();
int ds_cpu_adam_step(int64_t n, const int64_t* numels, float* const* params, void* const* grads,
                     float* const* exp_avgs, float* const* exp_avg_sqs, float* const* max_exp_avg_sqs,
                     void* const* outs, int32_t grad_dtype, int32_t out_dtype, const ds::AdamHyper* hyper,
                     int32_t num_threads);
const char* ds_cpu_lion_isa();
int ds_cpu_lion_step(int64_t n, const int64_t* numels, float* const* params, void* const* grads,
                     float* const* exp_avgs, void* const* outs, int32_t grad_dtype, int32_t out_dtype,
                     const ds::LionHyper* hyper, int32_t num_threads);
const char* ds_cpu_adagrad_isa();
int ds_cpu_adagrad_step(int64_t n, const int64_t* numels, float* const* params, void* const* grads,
                        float* const* sums, void* const* outs, int32_t grad_dtype, int32_t out_dtype,
                        const ds::AdagradHyper* hyper, int32_t num_threads);
}
