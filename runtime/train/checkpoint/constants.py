"""`deepspeed.checkpoint.constants`: the key and file names of DeepSpeed's checkpoint format.

They name what is in the files (dsformat.py writes and reader.py reads the same names), so a
script that builds or inspects a checkpoint with DeepSpeed's constants (Megatron-DeepSpeed puts
UNIVERSAL_CHECKPOINT_INFO with its parameter patterns in client_state) finds them here. The
universal-checkpoint pattern keys are carried in client_state as given; tp_merge.py merges a
DeepSpeed slice folder's tensor-parallel slices by them, while the converter (universal.py)
still refuses tensor-parallel checkpoints (see docs/checkpoints.md).
"""
OPTIMIZER_STATE_DICT = "optimizer_state_dict"
FP32_GROUPS = "fp32_groups"
FP32_FLAT_GROUPS = "fp32_flat_groups"
BASE_OPTIMIZER_STATE = "base_optimizer_state"
BASE_OPTIMIZER_STATE_STEP = "base_optimizer_state_step"
SINGLE_PARTITION_OF_FP32_GROUPS = "single_partition_of_fp32_groups"
PARAM_GROUPS = "param_groups"
GROUP_PADDINGS = "group_paddings"
PARTITION_COUNT = "partition_count"
ZERO_STAGE = "zero_stage"
CLIP_GRAD = "clip_grad"
FP32_WEIGHT_KEY = "fp32"
LOSS_SCALER = "loss_scaler"
PARAM = "param"
PARAM_SHAPES = "param_shapes"
BUFFER_NAMES = "buffer_names"
FROZEN_PARAM_SHAPES = "frozen_param_shapes"
FROZEN_PARAM_FRAGMENTS = "frozen_param_fragments"
MODEL_FILE_PREFIX = "mp_rank_"
ZERO_FILE_PREFIX = "zero_pp_rank_"
OPTIM_FILE_SUFFIX = "_optim_states.pt"
MODEL_FILE_SUFFIX = "_model_states.pt"
LAYER_FILE_PREFIX = "layer_"
BF16_ZERO_FILE_PREFIX = "bf16_" + ZERO_FILE_PREFIX
FP16_ZERO_FILE_PREFIX = "fp16_" + ZERO_FILE_PREFIX
DS_VERSION = "ds_version"
PARAM_SLICE_MAPPINGS = "param_slice_mappings"

# universal checkpoints (AutoTP's keys are written by the layers, on the strategies' floor)
from ...tensor_parallel.uc_keys import (AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS, DS_AUTOTP_UC_META,  # noqa: E402,F401
                                        ORIGINAL_VOCAB_SIZE, PARAMETER_WITH_ROW_PARALLELISM_PATTERNS,
                                        PARAMETER_WITH_SUB_PARAMS, SUB_PARAM_SHARD_WIDTHS,
                                        TP_REPLICATED_PARAMETER_PATTERNS, UNIVERSAL_CHECKPOINT_VERSION_KEY,
                                        UNIVERSAL_CHECKPOINT_VERSION_VALUE, VOCABULARY_PARAMETER_PATTERNS)
UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"
VOCAB_TENSOR = "vocab_tensor"
PADDED_VOCAB_SIZE = "padded_vocab_size"
CAT_DIM = "cat_dim"
PARAM_N_SUB_PARAMS = "param_n_sub_params"
SUB_PARAM_SHAPE = "sub_param_shape"
PIPELINE_REPLICATED_PARAMETER_PATTERNS = "pipeline_replicated_parameter_patterns"
PARAMETER_TO_AVERAGE_PATTERNS = "parameter_to_average_patterns"
PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0 = "parameter_with_2_sub_params_cat_dim_0"
SUB_PARAMS_SHAPE = "sub_params_shape"
CHECKPOINT_PARALLEL_DIMS = "checkpoint_parallel_dimensions"
CHECKPOINT_PP_DEGREE = "pp_degree"
CHECKPOINT_TP_DEGREE = "tp_degree"

# AutoEP's per-layer records in the model-states file (train/checkpoint/autoep.py writes them)
AUTOEP_LAYERS_KEY = "ds_autoep_layers"
AUTOEP_LAYERS_KEY_LEGACY = "autoep_layers"  # the key older DeepSpeed versions wrote
AUTOEP_EXPERT_KEY_PREFIX = "expert_key_prefix"
AUTOEP_NUM_EXPERTS = "num_experts"
AUTOEP_NUM_LOCAL_EXPERTS = "num_local_experts"
AUTOEP_EP_SIZE = "ep_size"
AUTOEP_ZERO12_REQUIRED_FIELDS = (AUTOEP_EXPERT_KEY_PREFIX, AUTOEP_NUM_EXPERTS, AUTOEP_NUM_LOCAL_EXPERTS, AUTOEP_EP_SIZE)
