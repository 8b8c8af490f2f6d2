"""How a model is put in its training dtype, as DeepSpeed 0.19.8 does it.

Under fp16/bf16 the floating parameters are cast to that dtype. Buffers keep the dtype they
came in, so a rotary `inv_freq` or a routing bias stays fp32, unless `data_types.buffer_dtype`
names one. Buffers the model names for fp32 stay fp32 either way, and are brought back to fp32
if they arrive lower: Hugging Face's `_keep_in_fp32_modules_strict` (and, under fp16,
`_keep_in_fp32_modules`) when `data_types.keep_in_fp32_modules` is "auto", or the config's own
list of name patterns.

The functions are pure tensor work on a module; the engine decides when they run.
"""
from __future__ import annotations

import re
from typing import List, Optional, Tuple

import torch

from .config.precision import KEEP_IN_FP32_AUTO, dtype_named, training_dtype

# the dtypes a cast touches: integer and boolean tensors (masks, counters) keep theirs
CASTABLE = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def training_dtypes(fp16: bool, bf16: bool, buffer_dtype: Optional[str]
                    ) -> Tuple[Optional[torch.dtype], Optional[torch.dtype]]:
    """(parameter dtype, buffer dtype) of the cast: None where nothing is cast (no fp16/bf16;
    no data_types.buffer_dtype)."""
    param = training_dtype(fp16, bf16) if (fp16 or bf16) else None
    buffer = dtype_named("data_types.buffer_dtype", buffer_dtype) if buffer_dtype is not None else None
    return param, buffer


def keep_in_fp32_pattern(module: torch.nn.Module, setting, dtype: Optional[torch.dtype]) -> Optional[re.Pattern]:
    """The buffer names of `module` to keep in fp32 while training in `dtype`, as one pattern;
    None when there are none (always under fp32 training)."""
    if dtype not in (torch.float16, torch.bfloat16):
        return None
    patterns = set()
    if setting is None or setting == KEEP_IN_FP32_AUTO:
        for owner_name, owner in module.named_modules():
            names = set(getattr(owner, "_keep_in_fp32_modules_strict", None) or ())
            if dtype == torch.float16:  # transformers keeps these in fp32 under fp16 only
                names |= set(getattr(owner, "_keep_in_fp32_modules", None) or ())
            for name in names:
                glob = name.replace("*", ".*")
                # a nested model's list names buffers under that model
                patterns.add(rf"^{re.escape(owner_name)}\..*{glob}" if owner_name else glob)
    else:
        patterns = {name.replace("*", ".*") for name in setting}
    if not patterns:
        return None
    # searched, not matched: as transformers, a pattern may match anywhere in the full name
    return re.compile("|".join(sorted(patterns)))


def fp32_buffers(module: torch.nn.Module, pattern: Optional[re.Pattern]) -> List[torch.Tensor]:
    """The floating buffers of `module` whose full names `pattern` finds."""
    if pattern is None:
        return []
    found = []
    for owner_name, owner in module.named_modules():
        prefix = f"{owner_name}." if owner_name else ""
        for name, buf in owner.named_buffers(recurse=False):
            if buf is not None and buf.is_floating_point() and pattern.search(prefix + name):
                found.append(buf)
    return found


def cast_module(module: torch.nn.Module, param_dtype: Optional[torch.dtype], buffer_dtype: Optional[torch.dtype],
                *, cast_params: bool = True, keep: Optional[re.Pattern] = None) -> None:
    """Cast `module` in place: floating parameters (and any gradients they hold) to
    `param_dtype` unless `cast_params` is False (zero.Init already gave them their dtype);
    floating buffers to `buffer_dtype`, except those `keep` names, which become fp32."""
    if param_dtype is not None and cast_params:
        for p in module.parameters():
            if p.dtype in CASTABLE and p.dtype != param_dtype:
                p.data = p.data.to(param_dtype)
            if p.grad is not None and p.grad.dtype in CASTABLE and p.grad.dtype != param_dtype:
                p.grad = p.grad.to(param_dtype)
    kept = fp32_buffers(module, keep)
    for buf in kept:
        if buf.dtype != torch.float32:
            buf.data = buf.data.float()
    if buffer_dtype is not None:
        kept_ids = {id(b) for b in kept}
        for buf in module.buffers():
            if id(buf) not in kept_ids and buf.dtype in CASTABLE and buf.dtype != buffer_dtype:
                buf.data = buf.data.to(buffer_dtype)
