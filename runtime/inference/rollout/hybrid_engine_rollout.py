"""Rollout by the training engine's own module (DeepSpeed's deepspeed.runtime.rollout.
hybrid_engine_rollout): generate() calls engine.module.generate (a Hugging Face model) on the
live training weights, so sync_weights has nothing to do.

Decoding always runs every step to max_new_tokens (eos_token_id=None): under ZeRO-3 each
forward gathers parameters collectively, so every rank must take the same number of steps.
The response is then cut at its first EOS: later tokens become padding and leave the mask.

Not provided, each refused in one line: the CUDA-graph greedy decoder (use_graph_capture
with temperature <= 0), continuous batching (SamplingConfig.continuous_batch_size and the
options that only it reads), per-stage profiling, and shared prefill (it needs DeepSpeed's
hybrid engine, which dslaunch refuses)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .base import RolloutBatch, RolloutEngine, RolloutRequest, SamplingConfig

GRAPH_REFUSED = ("HybridEngineRollout: use_graph_capture's CUDA-graph greedy decoder is not provided; set "
                 "use_graph_capture=False (greedy decoding then runs through module.generate)")
CONTINUOUS_REFUSED = ("HybridEngineRollout: continuous batching (SamplingConfig.continuous_batch_size) is not "
                      "provided; leave continuous_batch_size None")


@dataclass
class HybridEngineRolloutConfig:
    use_graph_capture: bool = False
    enable_profiling: bool = False
    use_shared_prefill: bool = False
    align_decode_fronts: bool = False  # continuous batching only
    enable_cache_trimming: bool = False  # continuous batching only
    continuous_cache_capacity: Optional[int] = None  # continuous batching only


def _refuse_unprovided(cfg) -> None:
    if getattr(cfg, "enable_profiling", False):
        raise ValueError("HybridEngineRollout: enable_profiling (per-stage decode timings) is not provided")
    if getattr(cfg, "use_shared_prefill", False):
        raise ValueError("HybridEngineRollout: use_shared_prefill needs DeepSpeed's hybrid engine "
                         "(prepare_shared_prefill), which dslaunch does not provide")
    for key in ("align_decode_fronts", "enable_cache_trimming"):
        if getattr(cfg, key, False):
            raise ValueError(f"HybridEngineRollout: {key} applies to continuous batching, which is not provided")
    if getattr(cfg, "continuous_cache_capacity", None) is not None:
        raise ValueError("HybridEngineRollout: continuous_cache_capacity applies to continuous batching, "
                         "which is not provided")


def pad_after_eos(output_ids: torch.Tensor, response_start: int, eos_token_id, pad_token_id: int):
    """(ids, response mask): each response keeps its first EOS (one of eos_token_id, an id or
    a list) and every token after it becomes pad_token_id; the mask is 1 on real response
    tokens, the kept EOS included even where it equals the pad id."""
    response = output_ids[:, response_start:]
    real = response != pad_token_id
    if eos_token_id is None or response.shape[1] == 0:
        return output_ids, real.long()
    eos = torch.as_tensor(eos_token_id, dtype=response.dtype, device=response.device).reshape(-1)
    is_eos = torch.isin(response, eos)
    seen_before = (is_eos.long().cumsum(dim=1) - is_eos.long()) > 0  # an EOS earlier in the row
    first_eos = is_eos & ~seen_before
    after = seen_before
    out = output_ids.clone()
    out[:, response_start:] = response.masked_fill(after, pad_token_id)
    return out, ((real | first_eos) & ~after).long()


class HybridEngineRollout(RolloutEngine):
    """generate() on engine.module; tokenizer gives the pad (else EOS) and EOS ids."""

    name = "hybrid_engine"

    def __init__(self, engine, tokenizer, cfg=None):
        _refuse_unprovided(cfg)
        self.engine = engine
        self.tokenizer = tokenizer
        self.use_graph_capture = bool(getattr(cfg, "use_graph_capture", False))

    def _pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = self.tokenizer.eos_token_id
        if pad is None:
            raise ValueError("The tokenizer must define pad_token_id or eos_token_id")
        return pad

    @torch.no_grad()
    def generate(self, request: RolloutRequest, sampling: SamplingConfig) -> RolloutBatch:
        if sampling.continuous_batch_size is not None:
            raise ValueError(CONTINUOUS_REFUSED)
        n = sampling.n_samples_per_prompt
        prompts, prompt_mask = request.prompt_ids, request.prompt_attention_mask
        if n > 1:
            prompts, prompt_mask = prompts.repeat_interleave(n, dim=0), prompt_mask.repeat_interleave(n, dim=0)
        width = prompts.shape[1]
        pad = self._pad_id()
        module = self.engine.module
        greedy = sampling.temperature <= 0.0
        if self.use_graph_capture and greedy:
            ids = self._generate_graph(prompts, prompt_mask, sampling.max_new_tokens, pad, module, prompts.device)
        else:
            kwargs = dict(attention_mask=prompt_mask, max_new_tokens=sampling.max_new_tokens, eos_token_id=None,
                          do_sample=not greedy, pad_token_id=pad)
            if greedy:
                kwargs.update(temperature=1.0, top_p=1.0)
            else:
                kwargs.update(temperature=max(sampling.temperature, 1e-8), top_p=sampling.top_p,
                              top_k=max(sampling.top_k, 0))
            ids = module.generate(prompts, **kwargs)
        ids, response_mask = pad_after_eos(ids, width, self.tokenizer.eos_token_id, pad)
        mask = torch.cat([prompt_mask.to(response_mask.dtype), response_mask], dim=1)
        starts = torch.full((ids.shape[0], ), width, dtype=torch.long, device=prompts.device)
        return RolloutBatch(input_ids=ids, attention_mask=mask, response_start_idx=starts)

    def _generate_graph(self, prompt_ids, prompt_attn, max_new_tokens, pad_token_id, module, device):
        raise ValueError(GRAPH_REFUSED)

    @staticmethod
    def _sample_top_p(logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0) -> torch.Tensor:
        """One token per row ([B, 1]) drawn from softmax(logits / temperature), restricted to
        the nucleus: the likeliest tokens up to and including the one whose cumulative
        probability first reaches top_p."""
        probs = torch.softmax(logits / temperature, dim=-1)
        if top_p >= 1.0:
            return torch.multinomial(probs, 1)
        ranked, order = probs.sort(dim=-1, descending=True)
        mass_before = ranked.cumsum(dim=-1) - ranked
        ranked = ranked.masked_fill(mass_before >= top_p, 0.0)
        return order.gather(1, torch.multinomial(ranked, 1))

    def sync_weights(self, step: int) -> None:
        """Nothing to do: generation reads the training module's weights themselves."""
        return None
