"""DeepSpeed's AutoSP for multimodal models (`deepspeed.sequence.auto_sp` and
`deepspeed.sequence.autosp_detector`): find the attention layers by class name and wrap the
ViT ones for sequence parallelism.

    auto_wrap_model_for_sp(model, mesh.group("sequence"))   # in place; returns model

- a ViT encoder attention (class name in VIT_ATTN_CLASSNAMES) is replaced by
  UlyssesSPViTAttention, with has_cls_token from VIT_HAS_CLS_TOKEN (True for a class
  registered there without an entry);
- a decoder attention (LLM_ATTN_CLASSNAMES) is left alone with a warning: Hugging Face
  decoders take hidden states, DistributedAttention takes q, k, v; such models use
  UlyssesSPAttentionHF (deepspeed.runtime.sequence_parallel.ulysses_sp) instead;
- the first module whose dotted name holds a vision-projection keyword is reported with a
  warning: wrap it with a fusion adapter (fusion.py) yourself.
A model with neither kind of attention is refused in one line (ValueError, as DeepSpeed).

Detection is pure (no process group); only the wrapping needs one.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch.nn as nn

from .vit_attention import UlyssesSPViTAttention

logger = logging.getLogger(__name__)

# Hugging Face class name -> whether position 0 is a [CLS] token (replicated, not sharded)
VIT_HAS_CLS_TOKEN = {
    "ViTAttention": True, "CLIPAttention": True, "SiglipAttention": False, "InternVisionAttention": False,
    "Qwen2VLVisionAttention": False, "Idefics2VisionAttention": False, "PaliGemmaVisionAttention": False,
}
VIT_ATTN_CLASSNAMES = set(VIT_HAS_CLS_TOKEN)
LLM_ATTN_CLASSNAMES = {
    "LlamaAttention", "MistralAttention", "Qwen2Attention", "InternLM2Attention", "GemmaAttention", "Phi3Attention",
    "GPTNeoXAttention", "FalconAttention", "MptAttention",
}
VISION_PROJ_KEYWORDS = ("visual_projection", "mm_projector", "vision_proj", "multi_modal_projector",
                        "img_projection")

# DeepSpeed's (private) names for the same tables: extending them extends detection
_VIT_ATTN_CLASSNAMES = VIT_ATTN_CLASSNAMES
_VIT_HAS_CLS_TOKEN = VIT_HAS_CLS_TOKEN
_LLM_ATTN_CLASSNAMES = LLM_ATTN_CLASSNAMES
_VISION_PROJ_KEYWORDS = VISION_PROJ_KEYWORDS


@dataclass
class SPModelInfo:
    """(dotted name, module) of what detect_model_sp_info found, in named_modules() order."""

    vit_attn_modules: List[Tuple[str, nn.Module]] = field(default_factory=list)
    llm_attn_modules: List[Tuple[str, nn.Module]] = field(default_factory=list)
    vision_projection_module: Optional[Tuple[str, nn.Module]] = None  # the outermost match only


def detect_model_sp_info(model: nn.Module) -> SPModelInfo:
    info = SPModelInfo()
    for name, module in model.named_modules():
        cls_name = type(module).__name__
        if cls_name in VIT_ATTN_CLASSNAMES:
            info.vit_attn_modules.append((name, module))
        elif cls_name in LLM_ATTN_CLASSNAMES:
            info.llm_attn_modules.append((name, module))
        if info.vision_projection_module is None and any(kw in name for kw in VISION_PROJ_KEYWORDS):
            info.vision_projection_module = (name, module)
    return info


def _set_module_by_name(model: nn.Module, dotted_name: str, new_module: nn.Module) -> None:
    *path, last = dotted_name.split(".")
    parent = model
    for part in path:
        parent = getattr(parent, part)
    setattr(parent, last, new_module)


def auto_wrap_model_for_sp(model: nn.Module, process_group) -> nn.Module:
    info = detect_model_sp_info(model)
    if not info.vit_attn_modules and not info.llm_attn_modules:
        raise ValueError("auto_wrap_model_for_sp: no known attention class in the model; add its attention class "
                         "name to VIT_ATTN_CLASSNAMES or LLM_ATTN_CLASSNAMES (deepspeed.sequence.autosp_detector)")
    for name, module in info.vit_attn_modules:
        if name == "":
            raise ValueError(f"auto_wrap_model_for_sp: the model itself is a {type(module).__name__}; wrap it "
                             "directly with UlyssesSPViTAttention")
        has_cls = VIT_HAS_CLS_TOKEN.get(type(module).__name__, True)
        _set_module_by_name(model, name, UlyssesSPViTAttention(module, process_group, has_cls_token=has_cls))
        logger.debug("AutoSP: %s wrapped in UlyssesSPViTAttention (has_cls_token=%s)", name, has_cls)
    logger.info("AutoSP: wrapped %d ViT attention layer(s)", len(info.vit_attn_modules))
    for name, module in info.llm_attn_modules:
        logger.warning("AutoSP: decoder attention '%s' (%s) takes hidden states, not DistributedAttention's q, k, v: "
                       "not wrapped; use UlyssesSPAttentionHF for the decoder", name, type(module).__name__)
    if info.vision_projection_module is not None:
        logger.warning("AutoSP: vision projection '%s' found: wrap it with a fusion adapter "
                       "(deepspeed.sequence.autosp_fusion) so the fused sequence is sharded",
                       info.vision_projection_module[0])
    return model
