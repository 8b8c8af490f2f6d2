"""Gradient-accumulation cases, run the same way under real DeepSpeed and under dslaunch: 2
ranks, bf16, ZeRO stage S, 4 micro-batches per step (each rank its own data), one SGD step at
lr 1 with no clipping, so each fp32 master moves by exactly its accumulated gradient. For each
case, rank 0 prints one line, `RESULT {json}`: the case and every parameter's fp32 master
before minus after the step.

    torchrun --nproc_per_node 2 scripts/grad_accum_case.py deepspeed|dslaunch STAGE:OFFLOAD:ACCUM...

OFFLOAD is none or cpu (offload_optimizer); ACCUM is default (data_types.grad_accum_dtype not
written) or a dtype name for it. The cases run one after another in the same processes.
scripts/make_ds_grad_accum_fixtures.py runs them under DeepSpeed;
tests/runtime/zero/test_grad_accum_dtype_vs_deepspeed.py under dslaunch.
"""
import sys

import torch

from ds_case_runs import import_side, print_result

GAS = 4
HIDDEN = 8


def config(stage: int, offload: str, accum: str) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.0,
           "steps_per_print": 1000, "bf16": {"enabled": True},
           "optimizer": {"type": "SGD", "params": {"lr": 1.0}},
           "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
           "zero_optimization": {"stage": stage}}
    if offload != "none":
        cfg["zero_optimization"]["offload_optimizer"] = {"device": offload}
    if accum != "default":
        cfg["data_types"] = {"grad_accum_dtype": accum}
    return cfg


def run_case(deepspeed, safe_get_full_fp32_param, stage: int, offload: str, accum: str) -> None:
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 4))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config(stage, offload, accum))
    rank = torch.distributed.get_rank()
    names = [n for n, _ in engine.module.named_parameters()]
    before = [safe_get_full_fp32_param(p).double() for p in engine.module.parameters()]
    for micro in range(GAS):
        g = torch.Generator().manual_seed(1000 * rank + micro)
        x = torch.randn(2, HIDDEN, generator=g).to(torch.bfloat16)
        y = torch.randint(0, 4, (2,), generator=g)
        loss = torch.nn.functional.cross_entropy(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
    after = [safe_get_full_fp32_param(p).double() for p in engine.module.parameters()]
    if rank == 0:
        delta = {n: (b - a).flatten().tolist() for n, b, a in zip(names, before, after)}
        print_result({"stage": stage, "offload": offload, "accum": accum, "steps": engine.global_steps,
                      "delta": delta})
    engine.destroy()


def main() -> None:
    side, cases = sys.argv[1], sys.argv[2:]
    deepspeed = import_side(side)
    if side == "deepspeed":
        from deepspeed.utils import safe_get_full_fp32_param
    else:
        from dslaunch.runtime.utils import safe_get_full_fp32_param
    for case in cases:
        stage, offload, accum = case.split(":")
        run_case(deepspeed, safe_get_full_fp32_param, int(stage), offload, accum)


if __name__ == "__main__":
    main()
