"""Tensor parallelism for training (`deepspeed.runtime.tensor_parallel`).

    collectives.py  the region boundaries as autograd functions on an explicit group
                    (copy_to_region, reduce_from_region, gather_last_dim, split_last_dim)
    shard.py        the shard maths (even, fused-part and padded-vocabulary splits); the error
    layers.py       ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                    VocabParallelLMHead, HeadParallelEmbedding, vocab_parallel_cross_entropy,
                    full_state_dict / load_full_state_dict (reassemble / cut a full state dict)
    autotp.py       shard_model_for_training: a Hugging Face model's layers replaced in place,
                    from partition_config, the model's tp plan, or its structure
    groups.py       the tensor-parallel group: given, or built over the world in DeepSpeed's
                    rank order (tensor ranks adjacent)
    mode.py         set_autotp_mode, tp_model_init (records, as DeepSpeed 0.19) and its merge
                    into initialize's config

Nothing here imports the engine, the topology or the pipeline: groups come in as arguments.
The inference engine (runtime/inference) runs the same forwards and collectives.
"""
from __future__ import annotations

from .autotp import (LayerSpec, PartitionConfig, TrainingShardPlan, hf_tp_plan, parse_partition_config,
                     plan_training_shards, shard_model_for_training)
from .collectives import copy_to_region, gather_last_dim, reduce_from_region, split_last_dim
from .groups import TensorParallelGroup, current_group, tensor_parallel_group, use_group
from .layers import (ColumnParallelLinear, HeadParallelEmbedding, ParamShard, RowParallelLinear, TensorParallelLayer,
                     VocabParallelEmbedding, VocabParallelLMHead, full_state_dict, is_tensor_parallel_shard,
                     load_full_state_dict, vocab_parallel_cross_entropy)
from .mode import (AUTOTP_MODE, get_autotp_mode, is_autotp_training_mode, merge_tp_model_init_into_config,
                   recorded_tp_model_init, set_autotp_mode, tp_model_init)
from .shard import TensorParallelError

__all__ = ["copy_to_region", "reduce_from_region", "gather_last_dim", "split_last_dim", "ColumnParallelLinear",
           "RowParallelLinear", "VocabParallelEmbedding", "VocabParallelLMHead", "HeadParallelEmbedding",
           "TensorParallelLayer", "ParamShard", "vocab_parallel_cross_entropy", "full_state_dict",
           "is_tensor_parallel_shard", "load_full_state_dict",
           "shard_model_for_training", "plan_training_shards", "parse_partition_config", "hf_tp_plan", "LayerSpec",
           "PartitionConfig", "TrainingShardPlan", "TensorParallelGroup", "tensor_parallel_group", "use_group",
           "current_group", "AUTOTP_MODE", "set_autotp_mode", "get_autotp_mode", "is_autotp_training_mode",
           "tp_model_init", "recorded_tp_model_init", "merge_tp_model_init_into_config", "TensorParallelError"]
