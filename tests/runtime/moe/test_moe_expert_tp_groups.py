"""deepspeed.utils.groups._get_expert_model_parallel_world_size(): DeepSpeed's tensor-parallel
degree inside an expert. Experts are never split over tensor-parallel ranks here (the MoE layer
refuses enable_expert_tensor_parallelism in one line), so the answer is 1, DeepSpeed's own answer
whenever that option is off (its module default, and what DeepSpeed's test_moe_tp expects then).
One process."""
import pytest
import torch


def test_expert_model_parallel_world_size_is_one_and_expert_tp_is_refused():
    import dslaunch.runtime as deepspeed
    from dslaunch.runtime.moe.layer import MoE, MoEError

    groups = deepspeed.utils.groups  # DeepSpeed's path, through the alias table
    assert groups._get_expert_model_parallel_world_size() == 1
    expert = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    with pytest.raises(MoEError, match="enable_expert_tensor_parallelism=True is not supported"):
        MoE(hidden_size=8, expert=expert, num_experts=2, ep_size=1, enable_expert_tensor_parallelism=True)
    assert groups._get_expert_model_parallel_world_size() == 1
