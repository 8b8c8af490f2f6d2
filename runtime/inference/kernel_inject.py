"""`replace_with_kernel_inject=True`: swap in the optimised attention we have, and say what changed.

DeepSpeed replaces whole transformer blocks with fused CUDA modules. What dslaunch has is an
attention function over torch's scaled_dot_product_attention (flash / memory-efficient /
fused CPU kernels, chosen by torch) that reads grouped key/value heads in place
(`enable_gqa`) instead of copying them out to every query head, working on the
model's own KV cache (generate keeps use_cache on). It is installed through Hugging Face's
attention-backend registry, so it serves every model whose class accepts a registered
backend (GPT-2, Llama, Mistral, BERT, ... in transformers 5), tensor-parallel or not: it
sees the local heads. A model that only knows "eager"/"sdpa" is moved from eager to
Hugging Face's sdpa path; anything else is left as built, and the log line says so.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

BACKEND = "dslaunch_sdpa"


def sdpa_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                   is_causal: Optional[bool] = None, **kwargs):
    """Hugging Face attention-backend contract: q/k/v [batch, heads, seq, dim] -> ([batch, seq, heads, dim], None)."""
    if attention_mask is not None and attention_mask.dim() == 4:
        attention_mask = attention_mask[:, :, :, :key.shape[-2]]
    if is_causal is None:
        is_causal = attention_mask is None and query.shape[2] > 1 and getattr(module, "is_causal", True)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, is_causal=bool(is_causal),
                                         enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


def _register() -> bool:
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    except ImportError:
        return False
    AttentionInterface.register(BACKEND, sdpa_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(BACKEND, sdpa_mask)  # masks built as for sdpa
    return True


def _attention_modules(model: nn.Module) -> Counter:
    return Counter(type(m).__name__ for m in model.modules()
                   if type(m).__name__.endswith(("Attention", "SelfAttention")) and any(
                       isinstance(c, nn.Module) and hasattr(c, "weight") for c in m.children()))


@dataclass
class Injection:
    replaced: Dict[str, int] = field(default_factory=dict)  # attention class -> count
    backend: Optional[str] = None  # the attention implementation now in use

    def generate_kwargs(self, kwargs: dict, max_out_tokens: int) -> dict:
        if self.backend is not None and "use_cache" not in kwargs:
            kwargs = dict(kwargs, use_cache=True)  # the KV cache is what makes decoding cheap
        return kwargs


def _set_backend(model: nn.Module, name: str) -> None:
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter):
        setter(name)
    else:
        model.config._attn_implementation = name


def inject(model: nn.Module, config, log: Callable[[str], None]) -> Injection:
    found = _attention_modules(model)
    listing = ", ".join(f"{n} {cls}" for cls, n in sorted(found.items())) or "no attention modules"
    hf_config = getattr(model, "config", None)
    current = getattr(hf_config, "_attn_implementation", None)
    result = Injection()
    if current is not None and getattr(type(model), "_supports_attention_backend", False) and _register():
        _set_backend(model, BACKEND)
        result.replaced, result.backend = dict(found), BACKEND
        log(f"replace_with_kernel_inject: attention of {listing} -> {BACKEND} (torch scaled_dot_product_attention, "
            f"grouped KV heads read in place; was {current}); KV cache: the model's, use_cache=True in generate")
    elif current == "eager" and getattr(type(model), "_supports_sdpa", False):
        _set_backend(model, "sdpa")
        result.replaced, result.backend = dict(found), "sdpa"
        log(f"replace_with_kernel_inject: attention of {listing} -> Hugging Face's sdpa path (was eager); "
            "KV cache: the model's, use_cache=True in generate")
    else:
        why = f"{type(model).__name__} accepts no attention backend; its {current} attention stays" \
            if current is not None else f"{type(model).__name__} is not a Hugging Face model with a switchable attention"
        log(f"replace_with_kernel_inject: nothing replaced ({why}: {listing} run as built)")
    return result
