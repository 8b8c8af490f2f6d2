"""Tensor-parallel inference: `deepspeed.init_inference(model, mp_size=2, dtype=torch.half, ...)`.

    engine = deepspeed.init_inference(model, tensor_parallel={"tp_size": 2}, dtype=torch.float)
    logits = engine(input_ids).logits          # the sharded module
    tokens = engine.generate(input_ids, max_new_tokens=32)

Modules, in the order the data flows:
    config.py         init_inference arguments -> InferenceConfig (strict; DeepSpeed's names)
    groups.py         the tensor-parallel process group (caller's, a topology grid's, or made)
    structure.py      read-only inspection of the module tree (blocks, projections, norms)
    plan.py           the sharding plan and its maths (pure; refuses uneven splits)
    layers.py         the parallel Linear/Embedding layers, dense or int8 (forwards and
                      collectives: runtime/tensor_parallel)
    surgery.py        plan -> layers swapped into the model, attributes divided, int8 applied
    loader.py         checkpoint= files -> each layer's slice, memory-mapped
    quantize.py       per-group symmetric int8 and its dequantisation
    kernel_inject.py  replace_with_kernel_inject: the optimised modules we have
    engine.py         InferenceEngine: the order of the above, forward, generate
    on_device.py      OnDevice: build a model with its parameters on the meta device
"""
from __future__ import annotations

from .config import InferenceConfig, InferenceConfigError, parse_inference_config
from .engine import InferenceEngine, MaxTokensError
from .on_device import OnDevice
from ..tensor_parallel.plan import ShardPlan, plan_tensor_parallel

__all__ = ["init_inference", "InferenceEngine", "OnDevice", "InferenceConfig", "InferenceConfigError", "MaxTokensError",
           "ShardPlan", "plan_tensor_parallel"]


def init_inference(model, config=None, **kwargs) -> InferenceEngine:
    """DeepSpeed's init_inference: `config` (dict or JSON/YAML path) merged with keyword arguments."""
    return InferenceEngine(model, parse_inference_config(config, kwargs))
