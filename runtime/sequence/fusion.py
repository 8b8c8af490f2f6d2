"""DeepSpeed's multimodal fusion adapters (`deepspeed.sequence.autosp_fusion`): where visual
tokens, sharded over the sequence group by the ViT, meet the text.

    fusion = InternVLFusionAdapter(model.mm_projector, mesh.group("sequence"), image_token_id=CTX)
    local_fused = fusion(local_visual, text_embeds, input_ids)

forward: project this rank's visual tokens, gather every rank's (seq_gather.py: uneven
counts allowed, gradients summed back to their owner), splice them into the whole text
sequence where input_ids mark them, pad the fused length with zero rows to a multiple of
the group size, and return this rank's equal slice of it, ready for a sequence-parallel
decoder. The splices (pure, one process) are DeepSpeed's:

    LlavaFusionAdapter     each image placeholder is replaced by a chunk of the visual tokens
                           (torch.chunk's sizes over the placeholders); samples of different
                           fused lengths are zero-padded to the longest
    InternVLFusionAdapter  each IMG_CONTEXT token is replaced 1-to-1 (length unchanged)
    Qwen2VLFusionAdapter   the tokens strictly between each vision_start/vision_end pair are
                           replaced 1-to-1 (length unchanged)

Where DeepSpeed would fail inside torch (more placeholders than visual tokens, a Llava
split torch.chunk cannot make, unpaired vision_start/vision_end tokens, which DeepSpeed's
zip silently drops), this refuses in one line naming the sample and the counts.
"""
from __future__ import annotations

from typing import List

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core import comm
from .seq_gather import gather_sequence

_DEFAULT_IMAGE_TOKEN_ID = -200  # LLaVA's image placeholder


class FusionSpliceError(ValueError):
    """input_ids whose placeholders do not match the visual tokens (one line)."""


def _scatter_fused(fused: torch.Tensor, group) -> torch.Tensor:
    """This rank's equal slice of `fused` after zero-padding its length to a multiple of sp."""
    sp, rank = comm.get_world_size(group), comm.get_rank(group)
    pad = (-fused.shape[1]) % sp
    if pad:
        fused = F.pad(fused, (0, 0, 0, pad))
    n = fused.shape[1] // sp
    return fused[:, rank * n:(rank + 1) * n].contiguous()


def _check_shapes(text_embeds: torch.Tensor, visual_embeds: torch.Tensor, input_ids: torch.Tensor, who: str):
    if text_embeds.dim() != 3 or visual_embeds.dim() != 3:
        raise FusionSpliceError(f"{who}: text_embeds {tuple(text_embeds.shape)} and visual embeddings "
                                f"{tuple(visual_embeds.shape)} must both be [batch, sequence, hidden]")
    if tuple(input_ids.shape) != tuple(text_embeds.shape[:2]):
        raise FusionSpliceError(f"{who}: input_ids {tuple(input_ids.shape)} do not match text_embeds "
                                f"{tuple(text_embeds.shape[:2])}")
    if visual_embeds.shape[0] != text_embeds.shape[0] or visual_embeds.shape[2] != text_embeds.shape[2]:
        raise FusionSpliceError(f"{who}: visual embeddings {tuple(visual_embeds.shape)} do not match text_embeds "
                                f"{tuple(text_embeds.shape)} in batch or hidden size (is the projection right?)")


def _overwrite(out: torch.Tensor, i: int, positions: List[int], visual: torch.Tensor, who: str) -> None:
    """out[i, positions] <- the first len(positions) visual tokens of sample i (1-to-1)."""
    if len(positions) > visual.shape[1]:
        raise FusionSpliceError(f"{who}: sample {i} has {len(positions)} visual placeholders but only "
                                f"{visual.shape[1]} visual tokens")
    index = torch.tensor(positions, dtype=torch.long, device=out.device)
    out[i, index] = visual[i, :len(positions)]


class _FusionBase(nn.Module):
    """The gather-splice-scatter forward shared by the adapters (not a DeepSpeed name)."""

    def __init__(self, projection: nn.Module, process_group) -> None:
        super().__init__()
        self.projection = projection
        self.process_group = process_group
        self.world_size = comm.get_world_size(process_group)

    def forward(self, visual_features: torch.Tensor, text_embeds: torch.Tensor,
                input_ids: torch.Tensor) -> torch.Tensor:
        """visual_features: [b, local visual tokens, vit hidden]; text_embeds: the whole text
        [b, text len, lm hidden]; input_ids: [b, text len]. Returns this rank's slice of the
        fused sequence, [b, ceil(fused len / sp), lm hidden]."""
        local_visual = self.projection(visual_features)
        full_visual, _ = gather_sequence(local_visual, self.process_group)
        fused = self._splice_visual_into_text(text_embeds, full_visual, input_ids)
        return _scatter_fused(fused, self.process_group)

    def _splice_visual_into_text(self, text_embeds: torch.Tensor, visual_embeds: torch.Tensor,
                                 input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} does not say where visual tokens go in the text: "
                                  "subclass ModalityFusionSPAdapter and override _splice_visual_into_text, or "
                                  "use LlavaFusionAdapter, InternVLFusionAdapter or Qwen2VLFusionAdapter")


class ModalityFusionSPAdapter(_FusionBase):
    """DeepSpeed's base adapter: subclasses say where the visual tokens go
    (_splice_visual_into_text(text_embeds, full_visual, input_ids) -> fused [b, len, h])."""

    def __init__(self, projection: nn.Module, process_group, image_token_id: int = _DEFAULT_IMAGE_TOKEN_ID) -> None:
        super().__init__(projection, process_group)
        self.image_token_id = image_token_id


class LlavaFusionAdapter(ModalityFusionSPAdapter):

    def _splice_visual_into_text(self, text_embeds, visual_embeds, input_ids):
        who = type(self).__name__
        _check_shapes(text_embeds, visual_embeds, input_ids, who)
        bs, text_len, hidden = text_embeds.shape
        samples = []
        for i in range(bs):
            places = (input_ids[i] == self.image_token_id).nonzero(as_tuple=True)[0].tolist()
            if not places:
                samples.append(text_embeds[i])
                continue
            chunks = torch.chunk(visual_embeds[i], len(places), dim=0)
            if len(chunks) != len(places):
                raise FusionSpliceError(f"{who}: sample {i} has {len(places)} image placeholders but its "
                                        f"{visual_embeds.shape[1]} visual tokens make {len(chunks)} chunks")
            pieces, prev = [], 0
            for chunk, pos in zip(chunks, places):
                pieces += [text_embeds[i, prev:pos], chunk]
                prev = pos + 1  # the placeholder itself is dropped
            pieces.append(text_embeds[i, prev:])
            samples.append(torch.cat(pieces, dim=0))
        longest = max(s.shape[0] for s in samples)
        return torch.stack([F.pad(s, (0, 0, 0, longest - s.shape[0])) for s in samples])


class InternVLFusionAdapter(ModalityFusionSPAdapter):

    def _splice_visual_into_text(self, text_embeds, visual_embeds, input_ids):
        who = type(self).__name__
        _check_shapes(text_embeds, visual_embeds, input_ids, who)
        out = text_embeds.clone()
        for i in range(text_embeds.shape[0]):
            places = (input_ids[i] == self.image_token_id).nonzero(as_tuple=True)[0].tolist()
            if places:
                _overwrite(out, i, places, visual_embeds, who)
        return out


class Qwen2VLFusionAdapter(_FusionBase):
    """The tokens between each vision_start_token_id / vision_end_token_id pair are the
    image's placeholders (DeepSpeed's class takes no image_token_id)."""

    def __init__(self, projection: nn.Module, process_group, vision_start_token_id: int,
                 vision_end_token_id: int) -> None:
        super().__init__(projection, process_group)
        self.vision_start_token_id = vision_start_token_id
        self.vision_end_token_id = vision_end_token_id

    def _splice_visual_into_text(self, text_embeds, visual_embeds, input_ids):
        who = type(self).__name__
        _check_shapes(text_embeds, visual_embeds, input_ids, who)
        out = text_embeds.clone()
        for i in range(text_embeds.shape[0]):
            starts = (input_ids[i] == self.vision_start_token_id).nonzero(as_tuple=True)[0].tolist()
            ends = (input_ids[i] == self.vision_end_token_id).nonzero(as_tuple=True)[0].tolist()
            if not starts and not ends:
                continue
            if len(starts) != len(ends) or any(e < s for s, e in zip(starts, ends)):
                raise FusionSpliceError(f"{who}: sample {i} has vision_start at {starts} and vision_end at {ends}; "
                                        "expected pairs, each start before its end")
            places = [p for s, e in zip(starts, ends) for p in range(s + 1, e)]
            if places:
                _overwrite(out, i, places, visual_embeds, who)
        return out
