"""InferenceEngine: the model sharded over its tensor-parallel group, converted, quantised.

Order of work in the constructor, chosen so that no rank ever holds more than its shard
plus one layer in flight: plan (pure, refuses bad sizes before anything changes) -> swap
in the parallel layers, each cut from the original or left empty for the checkpoint ->
convert what stays whole to the dtype -> give meta tensors real storage -> load the
checkpoint slice by slice -> quantise to int8 -> kernel injection -> one log line.
"""
from __future__ import annotations

import sys
from typing import List, Optional, Set, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ..core import comm
from .config import InferenceConfig, InferenceConfigError
from .groups import TPGroup, resolve_tp_group
from .layers import _ShardedWeight
from ..tensor_parallel.plan import plan_tensor_parallel
from .surgery import apply_plan, quantize_layers


class MaxTokensError(InferenceConfigError):
    """A generate call asks for more tokens than max_out_tokens allows."""


def _log(tpg: TPGroup, msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"dslaunch inference: {msg}", file=sys.stderr, flush=True)


def _device() -> torch.device:
    if torch.cuda.is_available():
        from ..core.comm import local_rank

        return torch.device("cuda", local_rank())
    return torch.device("cpu")


def _float_dtype(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _materialize_meta(model: nn.Module, device) -> List[Tuple[str, torch.Tensor]]:
    """Give every meta parameter/buffer empty real storage; returns them (the checkpoint must fill them).
    A parameter shared by several modules (a tied LM head) stays shared."""
    made, real = [], {}
    for mname, module in model.named_modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.device.type == "meta":
                if id(p) not in real:
                    real[id(p)] = nn.Parameter(torch.empty_like(p, device=device), requires_grad=False)
                    made.append((f"{mname}.{name}".lstrip("."), real[id(p)]))
                module._parameters[name] = real[id(p)]
        for name, b in list(module._buffers.items()):
            if b is not None and b.device.type == "meta":
                module._buffers[name] = torch.empty_like(b, device=device)
                made.append((f"{mname}.{name}".lstrip("."), module._buffers[name]))
    return made


def _recompute_rotary(model: nn.Module, device) -> Set[int]:
    """Hugging Face rotary tables are non-persistent buffers (never in a checkpoint): rebuild them."""
    rebuilt = set()
    for module in model.modules():
        init = getattr(module, "rope_init_fn", None)
        if callable(init) and isinstance(getattr(module, "inv_freq", None), torch.Tensor):
            inv_freq, scaling = init(module.config, device)
            module.inv_freq.copy_(inv_freq)
            if isinstance(getattr(module, "original_inv_freq", None), torch.Tensor):
                module.original_inv_freq = module.inv_freq
            rebuilt.add(id(module.inv_freq))
    return rebuilt


def weight_bytes(model: nn.Module) -> int:
    """Bytes of parameters and weight buffers this rank holds (each storage once)."""
    seen, total = set(), 0
    tensors = list(model.parameters()) + [b for m in model.modules() if isinstance(m, _ShardedWeight)
                                          for b in m.buffers(recurse=False)]
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.device)
        if key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


class InferenceEngine(nn.Module):
    """`engine(...)` runs the module; `engine.generate(...)` is the module's generate, checked
    against max_out_tokens. Attributes the engine lacks are the module's (`config`, `device`,
    `generation_config`, ...), so a Hugging Face pipeline keeps working with `pipe.model = engine`."""

    def __init__(self, model: nn.Module, config: InferenceConfig):
        super().__init__()
        if not isinstance(model, nn.Module):
            raise InferenceConfigError(f"init_inference: model must be a torch.nn.Module, got {type(model).__name__}")
        self.module = model
        self._config = config
        self.tp = resolve_tp_group(config)
        self.mp_group = self.tp.group  # DeepSpeed's attribute name
        device = _device()
        compute_dtype = _float_dtype(model) if config.int8 else config.dtype

        policy = config.injection_policy
        plan = plan_tensor_parallel(model, self.tp.size, policy) if self.tp.size > 1 or policy else None
        if plan is not None and self.tp.size == 1:
            plan = None  # tp 1: the policy was checked (names exist), nothing is split
        report = apply_plan(model, plan, self.tp, compute_dtype, device, copy_weights=True, whole_too=config.int8)
        self.plan = plan
        model.to(compute_dtype)
        needed = report.empty + _materialize_meta(model, device)
        model.to(device)
        self.load_report = None
        if config.checkpoint is not None:
            from .loader import load_checkpoint

            self.load_report = load_checkpoint(model, config.checkpoint, config.base_dir)
        filled = (self.load_report.loaded if self.load_report else set()) | \
            (_recompute_rotary(model, device) if needed else set())
        missing = [name for name, t in needed if id(t) not in filled]
        if missing:
            from ..core.errors import CheckpointError

            where = "the checkpoint lacks" if config.checkpoint is not None else "no checkpoint= given for"
            raise CheckpointError(f"init_inference: {where} {len(missing)} tensors of a meta-device model, "
                                  f"e.g. {', '.join(missing[:3])}")
        quantized = quantize_layers(model, report, config.quant.weight.q_groups, config.mlp_extra_grouping) \
            if config.int8 else 0
        model.eval()
        self.injected = None
        if config.replace_with_kernel_inject:
            from .kernel_inject import inject

            self.injected = inject(model, config, lambda m: _log(self.tp, m))
        self._sync_rng()
        parts = [f"dtype {compute_dtype if not config.int8 else f'int8 weights, {compute_dtype} compute'}",
                 f"tp {self.tp.size} ({self.tp.source})"]
        if plan is not None:
            parts.append(plan.summary())
        if quantized:
            parts.append(f"{quantized} layers int8")
        parts.append(f"{weight_bytes(model) / 2**20:.2f} MiB of weights per rank")
        _log(self.tp, "; ".join(parts))

    def _sync_rng(self) -> None:
        """Sampling must draw the same tokens on every rank of the group, or they diverge and hang."""
        if self.tp.size == 1:
            return
        device = _device()  # NCCL moves only device tensors
        state = torch.get_rng_state().to(device)
        comm.broadcast(state, group=self.tp.group, group_src=0, label="tp rng state")
        torch.set_rng_state(state.cpu())
        if torch.cuda.is_available():
            cuda_state = torch.cuda.get_rng_state().to(device)
            comm.broadcast(cuda_state, group=self.tp.group, group_src=0, label="tp cuda rng state")
            torch.cuda.set_rng_state(cuda_state.cpu())

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = super().__getattr__("module")
            return getattr(module, name)

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    def generate(self, *inputs, **kwargs):
        if not hasattr(self.module, "generate"):
            raise AttributeError(f"{type(self.module).__name__} has no generate()")
        ids = kwargs.get("input_ids", inputs[0] if inputs and torch.is_tensor(inputs[0]) else None)
        limit = self._config.max_out_tokens
        if ids is not None and ids.dim() >= 1:
            prompt = ids.shape[-1]
            new = kwargs.get("max_new_tokens")
            gen_cfg = kwargs.get("generation_config")
            if new is None and gen_cfg is not None:
                new = getattr(gen_cfg, "max_new_tokens", None)
            if prompt > limit:
                raise MaxTokensError(f"generate: the input has {prompt} tokens, more than max_out_tokens={limit}")
            if new is not None and prompt + new > limit:
                raise MaxTokensError(f"generate: {prompt} input + {new} new tokens exceed max_out_tokens={limit}")
        if self.injected is not None:
            kwargs = self.injected.generate_kwargs(kwargs, limit)
        return self.module.generate(*inputs, **kwargs)

    def weight_bytes(self) -> int:
        return weight_bytes(self.module)
