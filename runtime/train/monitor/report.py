"""What rank 0 says about the run outside the progress line: the start-up line, the
`dump_state` dump, `memory_breakdown` lines, the `vocabulary_size` warning, and the
`disable_python_gc` switch."""
from __future__ import annotations

import gc
import json
import sys
from typing import Optional

import torch

from ...core.parallel.dims import MeshError

_DTYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def optimizer_kernel(optimizer, strategy) -> str:
    """Which code steps the optimizer: the offload's fused CPU step when the offload host
    runs one, else the optimizer's own answer (`describe()`), else its class."""
    host = getattr(strategy, "host", None)
    if host is not None and getattr(host, "kernel", None) is not None:
        return host.kernel.kernel  # the offload's FusedCPUStep (dslaunch.kernels.fused_step)
    describe = getattr(optimizer, "describe", None)
    if callable(describe):
        return str(describe())
    cls = type(optimizer)
    where = "torch" if cls.__module__.startswith("torch.") else cls.__module__
    return f"{where} {cls.__name__}"


_ADAM_TYPES = ("adam", "adamw", "cpuadam", "deepspeedcpuadam", "fusedadam")


def optimizer_label(optimizer, config) -> str:
    """The optimizer as the config asked for it, then what implements it and, for the Adam
    family, which weight decay: `AdamW (FusedAdam, adam_w_mode)`. The class alone would say
    FusedAdam for a config that asked for AdamW, and not whether the decay is AdamW's."""
    cls = type(optimizer).__name__
    asked = config.optimizer.type if getattr(config, "optimizer", None) is not None else None
    if asked is None:
        return cls  # the script's own optimizer
    detail = [cls] if cls.lower() != asked.lower() else []
    groups = getattr(optimizer, "param_groups", None) or [{}]
    decoupled = groups[0].get("decoupled_weight_decay")
    if asked.lower() in _ADAM_TYPES and decoupled is not None:
        detail.append("adam_w_mode" if decoupled else "adam_w_mode false: L2 weight decay")
    return f"{asked} ({', '.join(detail)})" if detail else asked


def startup_line(engine) -> str:
    c, b = engine.config, engine.batch
    z = c.zero_optimization
    dtype = _DTYPE.get(engine.compute_dtype, str(engine.compute_dtype))
    policy = engine.precision
    if engine.compute_dtype != torch.float32 or policy.low_precision_masters:
        dtype += f" compute, {_DTYPE.get(policy.master, policy.master)} masters"
    if policy.optimizer_state != policy.master:
        dtype += f", {_DTYPE.get(policy.optimizer_state, policy.optimizer_state)} optimizer state"
    if c.torch_autocast.enabled:
        dtype += f" (torch.autocast {c.torch_autocast.dtype})"
    offload = f"offload optimizer {z.offload_optimizer_device}, params {z.offload_param_device}"
    sizes = parallel_sizes(engine)
    opt = (f"optimizer {optimizer_label(engine.optimizer, c)} stepped by "
           f"{optimizer_kernel(engine.optimizer, engine.strategy)}"
           if engine.optimizer is not None else "no optimizer (forward only)")
    experts = _expert_size(engine)
    data = f"data {sizes['data']}" + (f" (expert {experts} x expert-data {sizes['data'] // experts})"
                                      if experts > 1 else "")
    seq = getattr(engine, "seq_parallel_size", 1)
    seq_part = f" x sequence {seq}" if seq > 1 else ""
    return (f"dslaunch: ZeRO stage {z.stage} | {dtype} | {offload} | {opt} | world {sizes['world']} = {data} "
            f"x pipeline {sizes['pipeline']}{seq_part} x model {sizes['model']} | batch {b.train_batch_size} = micro "
            f"{b.micro_batch_per_gpu} x accumulation {b.gradient_accumulation_steps} x data {sizes['data']}")


def _expert_size(engine) -> int:
    """The mesh's expert-parallel size (MoE layers with ep_size > 1), else 1."""
    mesh = getattr(engine, "mesh", None)
    try:
        return mesh.size("expert") if mesh is not None else 1
    except MeshError:  # an mpu's mesh has no expert axis
        return 1


def parallel_sizes(engine) -> dict:
    world = engine.world_size
    mpu = getattr(engine, "mpu", None)
    sizes = {"world": world, "data": world, "pipeline": 1, "model": 1}
    if mpu is not None:
        # "model" is the tensor-parallel size: a pipeline grid's get_model_parallel_world_size
        # is DeepSpeed's pipe x model (every rank of one replica), its slice size the model axis
        model = "get_slice_parallel_world_size" if hasattr(mpu, "get_slice_parallel_world_size") else \
            "get_model_parallel_world_size"
        for key, name in (("data", "get_data_parallel_world_size"), ("pipeline", "get_pipe_parallel_world_size"),
                          ("model", model)):
            fn = getattr(mpu, name, None)
            if callable(fn):
                sizes[key] = int(fn())
    return sizes


def dump_state(engine, stream=None) -> None:
    """dump_state: the resolved config and the engine's state, after initialize."""
    stream = stream or sys.stdout
    print("dslaunch engine state:", file=stream)
    state = {"rank": engine.global_rank, "world_size": engine.world_size, "device": str(engine.device),
             "compute_dtype": str(engine.compute_dtype), "batch": vars(engine.batch),
             "strategy": type(engine.strategy).__name__, "optimizer": repr(engine.optimizer),
             "lr_scheduler": type(engine.lr_scheduler).__name__ if engine.lr_scheduler is not None else None,
             "loss_scaler": type(engine.loss_scaler).__name__ if engine.loss_scaler is not None else None,
             "parameters": sum(p.numel() for p in engine.module.parameters())}
    for key, value in state.items():
        print(f"  {key:<14} {value}", file=stream)
    print("  config " + json.dumps(engine.config.to_dict(), sort_keys=True, default=str), file=stream, flush=True)


def memory_line(label: str, device: torch.device) -> str:
    """DeepSpeed's see_memory_usage: allocated/peak/reserved on the GPU, and the host's RSS."""
    import psutil

    gib = 1024 ** 3
    parts = [f"memory {label}:"]
    if device.type == "cuda":
        parts.append(f"allocated {torch.cuda.memory_allocated(device) / gib:.2f} GB, peak "
                     f"{torch.cuda.max_memory_allocated(device) / gib:.2f} GB, reserved "
                     f"{torch.cuda.memory_reserved(device) / gib:.2f} GB;")
    vm = psutil.virtual_memory()
    rss = psutil.Process().memory_info().rss
    parts.append(f"process RSS {rss / gib:.2f} GB, host used {(vm.total - vm.available) / gib:.2f} GB "
                 f"({vm.percent:.0f}%)")
    return " ".join(parts)


def vocabulary_warning(size: Optional[int]) -> Optional[str]:
    if size and size % 8:
        return (f"warning: vocabulary_size {size} is not a multiple of 8; tensor-core matmuls over the vocabulary "
                f"run slower (pad it to {size + 8 - size % 8})")
    return None


class PythonGC:
    """disable_python_gc: collect once, then keep Python's cyclic collector off while any
    engine that asked for it is alive; the previous state comes back with the last one."""

    _holders = 0
    _was_enabled = True

    def __init__(self):
        self.held = False

    def acquire(self) -> None:
        if PythonGC._holders == 0:
            PythonGC._was_enabled = gc.isenabled()
        PythonGC._holders += 1
        self.held = True
        gc.collect()
        gc.disable()

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        PythonGC._holders -= 1
        if PythonGC._holders == 0 and PythonGC._was_enabled:
            gc.enable()
