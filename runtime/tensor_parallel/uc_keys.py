"""The names AutoTP's universal-checkpoint metadata is written under (DeepSpeed's
deepspeed.checkpoint.constants spells them the same way).

They live on the strategies' floor because the AutoTP layers write them onto their parameters
and collect them into the model-level info; train/checkpoint/constants.py re-exports them with
the rest of the checkpoint format's names.
"""
# the attribute a split parameter carries its restore/convert description under
DS_AUTOTP_UC_META = "ds_autotp_universal_checkpoint_meta"
UNIVERSAL_CHECKPOINT_VERSION_KEY = "universal_checkpoint_version"
UNIVERSAL_CHECKPOINT_VERSION_VALUE = 0.4  # 0.4: sub-parameters record their per-rank widths

# keys of the model-level info (client_state[UNIVERSAL_CHECKPOINT_INFO])
ORIGINAL_VOCAB_SIZE = "original_vocab_size"
VOCABULARY_PARAMETER_PATTERNS = "vocabulary_parameter_patterns"
PARAMETER_WITH_ROW_PARALLELISM_PATTERNS = "parameter_with_row_parallelism_patterns"
TP_REPLICATED_PARAMETER_PATTERNS = "tp_replicated_parameter_patterns"
PARAMETER_WITH_SUB_PARAMS = "parameter_with_sub_params"
SUB_PARAM_SHARD_WIDTHS = "sub_param_shard_widths"
AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS = "autotp_unsupported_parameter_patterns"
