"""What zero.Init builds, run the same way under real DeepSpeed and under dslaunch: 2 ranks,
the same seed on both, a small model and a few loose tensors created inside the context. For
each case rank 0 prints one line, `RESULT {json}`: the case, every parameter gathered whole
(its dtype and values) and the loose tensors (dtype and values).

    torchrun --nproc_per_node 2 scripts/zero_init_dtype_case.py deepspeed|dslaunch CONFIG:DTYPE...

CONFIG is the precision section of the config given to Init (fp32: none, bf16, fp16); DTYPE is
Init's dtype= argument (none, or a dtype name). DeepSpeed makes every floating tensor created in
the context its target dtype at creation, so weights are sampled in it.
scripts/make_ds_zero_init_dtype_fixtures.py runs the cases under DeepSpeed;
tests/runtime/zero/test_zero_init_dtype_vs_deepspeed.py under dslaunch.
"""
import sys

import torch

from ds_case_runs import import_side, print_result

DTYPES = {"none": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def config(precision: str) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    return cfg


def _record(t: torch.Tensor) -> dict:
    return {"dtype": str(t.dtype).replace("torch.", ""), "values": t.detach().double().flatten().tolist()}


def run_case(deepspeed, precision: str, dtype: str) -> None:
    torch.manual_seed(0)
    kwargs = {} if DTYPES[dtype] is None else {"dtype": DTYPES[dtype]}
    with deepspeed.zero.Init(config_dict_or_path=config(precision), **kwargs):
        model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
        loose = {"randn": torch.randn(6), "arange": torch.arange(0.0, 1.0, 0.1), "ones": torch.ones(2),
                 "arange_int": torch.arange(3), "tensor": torch.tensor([0.1, 1.0 / 3.0])}
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        params = {n: _record(p) for n, p in model.named_parameters()}
    if torch.distributed.get_rank() == 0:
        print_result({"case": f"{precision}:{dtype}", "params": params,
                      "loose": {k: _record(v) for k, v in loose.items()}})


def main() -> None:
    deepspeed = import_side(sys.argv[1])
    for case in sys.argv[2:]:
        run_case(deepspeed, *case.split(":"))


if __name__ == "__main__":
    main()
