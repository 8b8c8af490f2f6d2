"""On-policy distillation pieces (DeepSpeed's deepspeed.runtime.rollout.opsd): the
response-only causal targets of a rollout, and the generalized Jensen-Shannon divergence
between a student's and a teacher's next-token distributions on those targets."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from .base import RolloutBatch


@dataclass(frozen=True)
class ResponseTokenBatch:
    """input_ids/attention_mask as rolled out; target_ids and response_mask are one column
    shorter: the logits at column i predict target_ids[:, i] (= input_ids[:, i + 1]), and
    response_mask marks the targets that are real response tokens."""
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    target_ids: torch.Tensor
    response_mask: torch.Tensor

    @classmethod
    def from_rollout(cls, rollout: RolloutBatch) -> "ResponseTokenBatch":
        ids, mask, start = rollout.input_ids, rollout.attention_mask, rollout.response_start_idx
        if ids.device != mask.device:
            raise ValueError("rollout input_ids and attention_mask must be on the same device")
        if ids.device != start.device:
            raise ValueError("rollout input_ids and response_start_idx must be on the same device")
        if start.dtype not in (torch.int32, torch.int64):
            raise ValueError("rollout response_start_idx must use an integer dtype")
        length = ids.shape[1]
        if bool(((start < 1) | (start > length)).any()):
            raise ValueError("rollout response_start_idx must be in [1, sequence_length]")
        # target column j is token j + 1, a response token when j + 1 >= its row's start
        token_of_target = torch.arange(1, length, device=ids.device)
        in_response = token_of_target[None, :] >= start[:, None]
        return cls(input_ids=ids, attention_mask=mask, target_ids=ids[:, 1:],
                   response_mask=in_response & mask[:, 1:].bool())

    def select_causal_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits that predict target_ids (all but the last column)."""
        if logits.dim() != 3:
            raise ValueError("logits must be 3-D [batch, sequence_length, vocabulary_size]")
        if logits.shape[:2] != self.input_ids.shape:
            raise ValueError("logits batch and sequence dimensions must match input_ids")
        return logits[:, :-1, :]


@dataclass(frozen=True)
class JSDLossOutput:
    """The mean loss over valid tokens, and its sum and token count (to reduce across ranks)."""
    loss: torch.Tensor
    loss_sum: torch.Tensor
    valid_token_count: torch.Tensor


def _check(student, teacher, mask, beta, temperature, top_k, clip) -> None:
    if student.dim() != 3 or student.shape != teacher.shape:
        raise ValueError("student_logits and teacher_logits must have matching 3-D shapes")
    if mask.shape != student.shape[:2]:
        raise ValueError("response_mask shape must match logits batch and sequence dimensions")
    if not 0.0 <= beta <= 1.0:
        raise ValueError("beta must be in [0, 1]")
    if temperature <= 0.0:
        raise ValueError("temperature must be positive")
    if top_k is not None and top_k <= 0:
        raise ValueError("teacher_top_k must be positive when specified")
    if top_k is not None and top_k > student.shape[-1]:
        raise ValueError("teacher_top_k must not exceed the vocabulary size")
    if clip is not None and clip < 0.0:
        raise ValueError("pointwise_clip must be non-negative when specified")


def _kl_terms(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """p * (log p - log q), per vocabulary entry."""
    return p_log.exp() * (p_log - q_log)


def generalized_jsd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, response_mask: torch.Tensor,
                         beta: float = 0.5, temperature: float = 1.0, teacher_top_k: Optional[int] = None,
                         pointwise_clip: Optional[float] = None) -> JSDLossOutput:
    """JSD_beta(teacher || student) per response token: beta * KL(T || M) + (1 - beta) * KL(S || M)
    with M = beta * T + (1 - beta) * S; beta = 0 is KL(T || S) and beta = 1 is KL(S || T).
    teacher_top_k renormalizes both over the teacher's k likeliest entries; pointwise_clip caps
    each vocabulary entry's term before the per-token sum."""
    _check(student_logits, teacher_logits, response_mask, beta, temperature, teacher_top_k, pointwise_clip)
    s = student_logits / temperature
    t = teacher_logits / temperature
    if teacher_top_k is not None:
        keep = t.topk(teacher_top_k, dim=-1).indices
        s, t = s.gather(-1, keep), t.gather(-1, keep)
    s_log, t_log = F.log_softmax(s, dim=-1), F.log_softmax(t, dim=-1)
    if beta == 0.0:
        terms = _kl_terms(t_log, s_log)
    elif beta == 1.0:
        terms = _kl_terms(s_log, t_log)
    else:
        # log M in log space: log((1 - beta) S + beta T)
        log_beta = torch.log(torch.tensor(beta, dtype=s.dtype, device=s.device))
        log_rest = torch.log1p(torch.tensor(-beta, dtype=s.dtype, device=s.device))
        m_log = torch.logaddexp(s_log + log_rest, t_log + log_beta)
        terms = beta * _kl_terms(t_log, m_log) + (1.0 - beta) * _kl_terms(s_log, m_log)
    if pointwise_clip is not None:
        terms = terms.clamp(max=pointwise_clip)
    weights = response_mask.to(terms.dtype)
    loss_sum = (terms.sum(-1) * weights).sum()
    count = weights.sum().long()
    return JSDLossOutput(loss=loss_sum / count.clamp_min(1), loss_sum=loss_sum, valid_token_count=count)
