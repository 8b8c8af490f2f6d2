"""The rollout interface a trainer generates on-policy samples through (DeepSpeed's
deepspeed.runtime.rollout.base): a request in, a batch out, the sampling knobs, and the
abstract engine. The dataclasses check their tensors' shapes when made, so a malformed
batch stops where it is built, not steps later in the loss."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional

import torch


def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


@dataclass
class RolloutConfig:
    """Which rollout engine build_rollout makes, and its decode option."""
    engine: str = "hybrid_engine"
    use_graph_capture: bool = False


@dataclass
class SamplingConfig:
    """What generate() is asked for each step; top_k <= 0 means no top-k filter."""
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n_samples_per_prompt: int = 1
    continuous_batch_size: Optional[int] = None


@dataclass
class RolloutRequest:
    """Prompts, left-padded ([B, T_p]), and their attention mask of the same shape."""
    prompt_ids: torch.Tensor
    prompt_attention_mask: torch.Tensor

    def __post_init__(self) -> None:
        if self.prompt_ids.dim() != 2:
            raise ValueError(f"prompt_ids must be 2-D [B, T_p]; got {_shape(self.prompt_ids)}")
        if self.prompt_attention_mask.shape != self.prompt_ids.shape:
            raise ValueError(f"prompt_attention_mask shape {_shape(self.prompt_attention_mask)} does not match "
                             f"prompt_ids {_shape(self.prompt_ids)}")


@dataclass
class RolloutBatch:
    """Prompt and response in one tensor ([B * n, T_p + T_r]), its mask, and the column
    each row's response starts at."""
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_start_idx: torch.Tensor

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2:
            raise ValueError(f"input_ids must be 2-D; got {_shape(self.input_ids)}")
        if self.attention_mask.shape != self.input_ids.shape:
            raise ValueError(f"attention_mask shape {_shape(self.attention_mask)} does not match "
                             f"input_ids {_shape(self.input_ids)}")
        rows = self.input_ids.shape[0]
        if _shape(self.response_start_idx) != (rows, ):
            raise ValueError(f"response_start_idx must be 1-D of length {rows}; got "
                             f"{_shape(self.response_start_idx)}")

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])


class RolloutEngine(ABC):
    """What a trainer calls: generate() a batch, sync_weights() after an optimizer step."""

    name: str = "base"

    @abstractmethod
    def generate(self, request: RolloutRequest, sampling: SamplingConfig) -> RolloutBatch:
        """Prompts in, prompt + response out."""

    @abstractmethod
    def sync_weights(self, step: int) -> None:
        """Make the generator see the weights of training step `step`."""

    def shutdown(self) -> None:
        """Free the generator's resources (none by default)."""
        return None
