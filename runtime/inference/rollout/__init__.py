"""On-policy rollout for RL and distillation training (DeepSpeed's deepspeed.runtime.rollout):
the interface (base.py), generation by the training engine's module
(hybrid_engine_rollout.py), and the response-token distillation loss (opsd.py)."""
from __future__ import annotations

from .base import RolloutBatch, RolloutConfig, RolloutEngine, RolloutRequest, SamplingConfig
from .hybrid_engine_rollout import HybridEngineRollout, HybridEngineRolloutConfig
from .opsd import JSDLossOutput, ResponseTokenBatch, generalized_jsd_loss

__all__ = ["HybridEngineRollout", "HybridEngineRolloutConfig", "JSDLossOutput", "RolloutBatch", "RolloutConfig",
           "RolloutEngine", "RolloutRequest", "ResponseTokenBatch", "SamplingConfig", "build_rollout",
           "generalized_jsd_loss"]


def build_rollout(rollout_cfg, student_engine=None, tokenizer=None, **kwargs):
    """The rollout engine rollout_cfg.engine names ("hybrid_engine", the only one)."""
    name = rollout_cfg.engine
    if name != "hybrid_engine":
        raise ValueError(f"Unknown rollout engine {name!r}; choose from 'hybrid_engine'")
    if student_engine is None or tokenizer is None:
        raise ValueError("hybrid_engine rollout needs both student_engine and tokenizer")
    return HybridEngineRollout(engine=student_engine, tokenizer=tokenizer, cfg=rollout_cfg)
