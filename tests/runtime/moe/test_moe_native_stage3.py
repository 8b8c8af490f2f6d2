"""deepspeed.moe layers spread over several ranks at ZeRO stage 3 are refused at initialize as
DeepSpeed 0.19.8's engine refuses them: an AssertionError whose text starts with its words
("Native DeepSpeed MoE is not supported with ZeRO Stage 3", which its AutoEP integration test
matches), in one line naming the layer; stages 1 and 2 are not touched by the check."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from dslaunch.runtime.moe.layer import MoE
from dslaunch.runtime.moe.utils import NativeMoEStage3Error, refuse_native_moe_at_stage3


class _Native(nn.Module):
    def __init__(self, ep_size: int):
        super().__init__()
        self.moe = MoE(hidden_size=8, expert=nn.Linear(8, 8), num_experts=2, ep_size=ep_size)

    def forward(self, x):
        return self.moe(x)[0]


def _config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
            "zero_optimization": {"stage": stage}}


def test_initialize_refuses_native_moe_at_stage3_as_deepspeed_does():
    import dslaunch.runtime as deepspeed

    with pytest.raises(AssertionError, match="Native DeepSpeed MoE") as err:
        deepspeed.initialize(model=_Native(ep_size=2), config=_config(3))
    assert isinstance(err.value, deepspeed.ConfigError)  # the one line a script's user sees
    text = str(err.value)
    assert "\n" not in text and "'moe'" in text and "ep_size=2" in text and "stage 1 or 2" in text


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_other_stages_pass_the_check(stage):
    refuse_native_moe_at_stage3(_Native(ep_size=2), stage)


def test_a_layer_holding_every_expert_is_left_to_stage3(stage=3):
    refuse_native_moe_at_stage3(_Native(ep_size=1), stage)
    with pytest.raises(NativeMoEStage3Error):
        refuse_native_moe_at_stage3(nn.Sequential(nn.Linear(8, 8), _Native(ep_size=2)), stage)
    assert issubclass(NativeMoEStage3Error, AssertionError)
    assert torch.is_tensor(_Native(ep_size=1)(torch.zeros(2, 8)))
