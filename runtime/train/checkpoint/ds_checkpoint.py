"""DeepSpeed's checkpoint-folder readers (deepspeed.checkpoint): `ZeROCheckpoint`, the ZeRO
files each rank of a smaller (pp, tp, dp) reads and their merged state; `DeepSpeedCheckpoint`,
a Megatron-DeepSpeed folder (model-state files, layer_* files, ZeRO files) as the per-rank
pieces a conversion script asks for; `get_model_3d_descriptor`, the degrees a folder was saved
at. Which file feeds which rank is reshape3d.py; this module reads the files.

Every file is read with weights_only=True (files.load_torch: DeepSpeed's few pickled classes
as inert records, no code run), where DeepSpeed unpickles whatever is there. Two other places
differ on purpose: the ZeRO files are the *_optim_states.pt files only (DeepSpeed's prefix
match also counts a ZeRO-3 folder's zero_pp_rank_*_model_states.pt, doubling its data-parallel
degree), and merging two states keeps the keys only the first has (DeepSpeed drops them).
"""
from __future__ import annotations

import os
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ...core.errors import CheckpointError
from .constants import (AUTOEP_EXPERT_KEY_PREFIX, AUTOEP_LAYERS_KEY, AUTOEP_LAYERS_KEY_LEGACY,
                        AUTOEP_ZERO12_REQUIRED_FIELDS, BASE_OPTIMIZER_STATE, BF16_ZERO_FILE_PREFIX,
                        CHECKPOINT_PARALLEL_DIMS, CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE, FP16_ZERO_FILE_PREFIX,
                        GROUP_PADDINGS, LAYER_FILE_PREFIX, MODEL_FILE_PREFIX, OPTIM_FILE_SUFFIX, OPTIMIZER_STATE_DICT,
                        PARAM_SHAPES, PARTITION_COUNT, UNIVERSAL_CHECKPOINT_INFO, ZERO_FILE_PREFIX)
from .files import load_torch
from .reshape3d import descriptor_from_metadata, meg_2d_parallel_map, model_3d_desc, reshape_meg_2d_parallel, split_evenly

ARGS_KEY = "args"
CHECKPOINT_INFO_KEY = "checkpoint_info"
ITERATION_KEY = "iteration"
EMBEDDING_LAYER_INDEX = 0
FINAL_LAYER_NORM_INDEX = -1
USE_DATA_BEFORE_EXPERT_PARALLELISM = "use_data_before_expert_parallelism"
AUTOEP_METADATA_FIELDS = ("moe_layer_id", "module_path") + AUTOEP_ZERO12_REQUIRED_FIELDS
# Megatron's layer-file state: tensors every tensor slice holds whole (taken from the first
# slice), and the dimension the others are concatenated along when not 0
SEQUENTIAL_LAYERS = ("input_layernorm.weight", "input_layernorm.bias", "self_attention.dense.bias",
                     "post_attention_layernorm.weight", "post_attention_layernorm.bias", "mlp.dense_4h_to_h.bias",
                     "position_embeddings.weight")
LAYER_CONCAT_DIM = {"self_attention.dense.weight": 1, "mlp.dense_4h_to_h.weight": 1}
_LAYER_FILE = re.compile(r"layer_(\d+)-model_.*")


# -- files --------------------------------------------------------------------------------------

def folder_files(folder: str) -> List[str]:
    """Every file under `folder` (recursively); one line when it is not a folder."""
    if not os.path.isdir(folder):
        raise CheckpointError(f"checkpoint folder {folder} does not exist or is not a folder")
    return [os.path.join(root, name) for root, _, names in os.walk(folder) for name in names]


def with_prefix(files: Sequence[str], prefix: str) -> List[str]:
    return sorted(f for f in files if os.path.basename(f).startswith(prefix))


def zero_files(folder: str) -> List[str]:
    """The ZeRO optimizer-state files, ordered by (data-parallel rank, model-parallel rank):
    the first naming scheme present (zero_, fp16_zero_, bf16_zero_pp_rank_...)."""
    files = [f for f in folder_files(folder) if f.endswith(OPTIM_FILE_SUFFIX)]
    for prefix in (ZERO_FILE_PREFIX, FP16_ZERO_FILE_PREFIX, BF16_ZERO_FILE_PREFIX):
        found = with_prefix(files, prefix)
        if found:
            ranked = []
            for path in found:
                m = re.match(rf"{re.escape(prefix)}(\d+)_{MODEL_FILE_PREFIX}(\d+)", os.path.basename(path))
                if m is None:
                    raise CheckpointError(f"checkpoint file {path}: cannot read its dp and mp ranks from its name")
                ranked.append((int(m.group(1)), int(m.group(2)), path))
            return [path for _, _, path in sorted(ranked)]
    return []


def get_model_3d_descriptor(dir: str) -> model_3d_desc:  # noqa: A002 (DeepSpeed's name)
    """The (pp, tp, dp) degrees the folder `dir` was saved at (reshape3d.descriptor_from_metadata)."""
    files = folder_files(dir)
    metadata = [(f, {CHECKPOINT_PARALLEL_DIMS: load_torch(f).get(CHECKPOINT_PARALLEL_DIMS)})
                for f in with_prefix(files, MODEL_FILE_PREFIX)]
    return descriptor_from_metadata(files, zero_files(dir), metadata)


# -- merging per-rank states --------------------------------------------------------------------

def merge_state(a: Any, b: Any, where: str = "") -> Any:
    """Two ranks' states as one: tensors concatenated along dim 0, dicts and lists merged item
    by item, anything else taken from `a`."""
    if type(a) is not type(b):
        raise CheckpointError(f"cannot merge checkpoint states at {where or 'the top level'}: "
                              f"{type(a).__name__} and {type(b).__name__}")
    if isinstance(a, dict):
        merged = type(a)()
        for key in list(a) + [k for k in b if k not in a]:
            merged[key] = merge_state(a[key], b[key], f"{where}.{key}" if where else str(key)) \
                if key in a and key in b else (a[key] if key in a else b[key])
        return merged
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            raise CheckpointError(f"cannot merge checkpoint states at {where or 'the top level'}: lists of "
                                  f"{len(a)} and {len(b)} items")
        return type(a)(merge_state(x, y, f"{where}[{i}]") for i, (x, y) in enumerate(zip(a, b)))
    if torch.is_tensor(a):
        return torch.cat([a, b], 0)
    return a


# -- ZeRO files ---------------------------------------------------------------------------------

class ZeROCheckpoint:
    """A folder's ZeRO optimizer-state files, as the ranks of a (possibly smaller) target
    topology read them: `reshape(target)`, then `get_state_for_rank(pp, tp, dp)`."""

    def __init__(self, dir: str, source_3d: Optional[model_3d_desc] = None):  # noqa: A002 (DeepSpeed's name)
        self.dir = dir
        self.file_list = zero_files(dir)
        self.num_files = len(self.file_list)
        if not self.file_list:
            raise CheckpointError(f"checkpoint folder {dir} has no ZeRO optimizer-state files")
        self.src_3d = get_model_3d_descriptor(dir) if source_3d is None else source_3d
        self.reshape(model_3d_desc(self.src_3d.pp_degree, self.src_3d.tp_degree, self.src_3d.dp_degree))

    def get_src_world_size(self) -> int:
        return self.src_3d.world_size()

    def get_src_tp_degree(self) -> int:
        return self.src_3d.tp_degree

    def get_src_pp_degree(self) -> int:
        return self.src_3d.pp_degree

    def get_src_dp_degree(self) -> int:
        return self.src_3d.dp_degree

    def reshape(self, target_3d_desc: model_3d_desc) -> None:
        self.target_3d = target_3d_desc
        self._3d_file_map = self.src_3d.reshape(target_3d_desc)

    def get_file_indices_for_rank(self, pp_index: int, tp_index: int, dp_index: int) -> List[int]:
        if not 0 <= dp_index < len(self._3d_file_map):
            raise IndexError(f"DP index {dp_index} is outside 0..{len(self._3d_file_map) - 1}")
        return self._3d_file_map[dp_index].get_data(pp_index, tp_index)

    def get_files_for_rank(self, pp_index: int, tp_index: int, dp_index: int) -> List[str]:
        return [self.file_list[i] for i in self.get_file_indices_for_rank(pp_index, tp_index, dp_index)]

    def get_state_for_rank(self, pp_index: int, tp_index: int, dp_index: int, keys_to_ignore: Sequence[str] = (),
                           strip_tensor_paddings: bool = True) -> Optional[dict]:
        """The rank's files' states merged in file order; with `strip_tensor_paddings` each
        optimizer-state tensor loses its group's padding first (and the merged state records
        none), and partition_count names the target's data-parallel degree."""
        merged = None
        for path in self.get_files_for_rank(pp_index, tp_index, dp_index):
            state = load_torch(path)
            for key in keys_to_ignore:
                state.pop(key, None)
            if strip_tensor_paddings:
                _strip_paddings(state)
            merged = state if merged is None else merge_state(merged, state)
            counts = _optimizer_entry(merged, PARTITION_COUNT)
            if counts:
                merged[OPTIMIZER_STATE_DICT][PARTITION_COUNT] = [self.target_3d.dp_degree] * len(counts)
            paddings = _optimizer_entry(merged, GROUP_PADDINGS)
            if strip_tensor_paddings and paddings:
                merged[OPTIMIZER_STATE_DICT][GROUP_PADDINGS] = [0] * len(paddings)
        return merged

    def print_3d_index_map(self, tag: Optional[str] = None) -> None:
        if tag:
            print(f"3D index map: {tag}")
        for dp_index, grid in enumerate(self._3d_file_map):
            grid.print_data(f"dp = {dp_index}")


def _optimizer_entry(state: Any, key: str) -> Any:
    optimizer = state.get(OPTIMIZER_STATE_DICT) if isinstance(state, dict) else None
    return optimizer.get(key) if isinstance(optimizer, dict) else None


def _strip_paddings(state: dict) -> None:
    base = _optimizer_entry(state, BASE_OPTIMIZER_STATE)
    groups = base.get("state") if isinstance(base, dict) else None
    paddings = _optimizer_entry(state, GROUP_PADDINGS)
    if groups is None or paddings is None:
        return
    for key, group_state in groups.items():
        if paddings[key]:
            for name, value in group_state.items():
                if name != "step" and torch.is_tensor(value):
                    group_state[name] = value.narrow(0, 0, value.numel() - paddings[key]).clone()


# -- a Megatron-DeepSpeed folder ----------------------------------------------------------------

def _light_autoep(state: dict) -> Any:
    records = state.get(AUTOEP_LAYERS_KEY)
    if records is None:
        records = state.get(AUTOEP_LAYERS_KEY_LEGACY)
    if not isinstance(records, list):  # None stays None; anything else is named by its type
        return records if records is None else type(records).__name__
    return [{k: r[k] for k in AUTOEP_METADATA_FIELDS if k in r} if isinstance(r, dict) else type(r).__name__
            for r in records]


def _light_ds_config(state: dict) -> Any:
    config = state.get("ds_config", {})
    if not isinstance(config, dict):
        return type(config).__name__
    ordering = config.get(USE_DATA_BEFORE_EXPERT_PARALLELISM, False)
    return {USE_DATA_BEFORE_EXPERT_PARALLELISM: ordering if isinstance(ordering, bool) else type(ordering).__name__}


def _light_param_shapes(state: dict) -> Any:
    shapes = state.get(PARAM_SHAPES)
    if not isinstance(shapes, (list, tuple)) or not all(isinstance(group, dict) for group in shapes):
        return shapes if shapes is None else type(shapes).__name__
    return {name: shape for group in shapes for name, shape in group.items()}


def _light_dims(state: dict) -> Any:
    dims = state.get(CHECKPOINT_PARALLEL_DIMS)
    if not isinstance(dims, dict):
        return dims if dims is None else type(dims).__name__
    return {key: dims.get(key) for key in (CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE)}


class DeepSpeedCheckpoint:
    """A Megatron-DeepSpeed checkpoint folder read at (pp_degree, tp_degree, dp_degree), by
    default the degrees it was saved at. Each model-state file is read once, at construction,
    keeping only `model_state_metadata` (per file: parallel dimensions, parameter shapes, AutoEP
    records, the expert-ordering flag) and the first file's args, checkpoint info and iteration."""

    def __init__(self, dir: str, tp_degree: Optional[int] = None, pp_degree: Optional[int] = None,  # noqa: A002
                 dp_degree: Optional[int] = None, final_layer_norm_idx: int = FINAL_LAYER_NORM_INDEX):
        self.dir = dir
        self.final_layer_norm_idx = final_layer_norm_idx
        self.file_list = folder_files(dir)
        self.layer_files = sorted(f for f in self.file_list if _LAYER_FILE.fullmatch(os.path.basename(f)))
        self.mp_rank_files = with_prefix(self.file_list, MODEL_FILE_PREFIX)
        needed = [MODEL_FILE_PREFIX] + ([LAYER_FILE_PREFIX, f"{LAYER_FILE_PREFIX}01"] if self.layer_files else [])
        for prefix in needed:
            if not with_prefix(self.file_list, prefix):
                raise CheckpointError(f"{dir} is not a DeepSpeed checkpoint folder: it has no {prefix}* files")
        self.model_state_metadata, self.global_state = self._read_model_states()
        source = descriptor_from_metadata(self.file_list, zero_files(dir), self.model_state_metadata)
        self.zero_checkpoint = ZeROCheckpoint(dir, source_3d=source)
        self.layer_keys = self._layer_keys()
        self.layer_count = len(self.layer_keys)
        self.tp_degree = source.tp_degree if tp_degree is None else tp_degree
        self.pp_degree = source.pp_degree if pp_degree is None else pp_degree
        self.dp_degree = source.dp_degree if dp_degree is None else dp_degree
        self.original_world_size = source.world_size()
        self.world_size = self.tp_degree * self.pp_degree * self.dp_degree
        self.old_2d_map = meg_2d_parallel_map(source.pp_degree, source.tp_degree)
        self.old_2d_map.simple_init()
        self.new_2d_map = reshape_meg_2d_parallel(source.pp_degree, source.tp_degree, self.pp_degree, self.tp_degree)
        if self.is_change_pp_degree() or self.is_change_tp_degree() or self.is_change_dp_degree():
            self.zero_checkpoint.reshape(model_3d_desc(self.pp_degree, self.tp_degree, self.dp_degree))
        self._check_counts()
        self.pp_to_transformer_map = self._pp_transformer_map()
        self.transformer_file_map = self._transformer_file_map()
        self.tp_to_embedding_map = self._tp_layer_map(EMBEDDING_LAYER_INDEX)
        self.tp_to_final_norm_map = self._tp_layer_map(self.final_layer_norm_idx)

    def _read_model_states(self) -> Tuple[List[Tuple[str, Dict[str, Any]]], Dict[str, Any]]:
        metadata, global_state = [], {}
        for i, path in enumerate(self.mp_rank_files):
            state = load_torch(path)
            if not isinstance(state, dict):
                raise CheckpointError(f"checkpoint file {path} is not a model-states dictionary")
            metadata.append((path, {CHECKPOINT_PARALLEL_DIMS: _light_dims(state), PARAM_SHAPES: _light_param_shapes(state),
                                    AUTOEP_LAYERS_KEY: _light_autoep(state), "ds_config": _light_ds_config(state)}))
            if i == 0:
                global_state[ITERATION_KEY] = state.get(ITERATION_KEY, 0)
                for key in (ARGS_KEY, CHECKPOINT_INFO_KEY, UNIVERSAL_CHECKPOINT_INFO):
                    global_state[key] = state.get(key)
        return metadata, global_state

    def _check_counts(self) -> None:
        zero_count, slices = self.zero_checkpoint.num_files, self.pp_degree * self.tp_degree
        if len(self.mp_rank_files) % self.tp_degree or zero_count % slices:
            raise CheckpointError(f"checkpoint {self.dir}: {len(self.mp_rank_files)} model-state and {zero_count} "
                                  f"ZeRO files do not fit tp={self.tp_degree}, pp={self.pp_degree}")

    def is_change_tp_degree(self) -> bool:
        return self.tp_degree != self.zero_checkpoint.get_src_tp_degree()

    def is_change_pp_degree(self) -> bool:
        return self.pp_degree != self.zero_checkpoint.get_src_pp_degree()

    def is_change_dp_degree(self) -> bool:
        return self.dp_degree != self.zero_checkpoint.get_src_dp_degree()

    # the first model-state file's values
    def _value(self, key: str) -> Any:
        if key not in self.global_state:
            self.global_state[key] = load_torch(self.mp_rank_files[0]).get(key)
        return self.global_state[key]

    def get_iteration(self) -> Any:
        return self._value(ITERATION_KEY)

    def get_args(self) -> Any:
        return self._value(ARGS_KEY)

    def get_checkpoint_info(self, info_key: str = CHECKPOINT_INFO_KEY) -> Any:
        return self._value(info_key)

    # ZeRO state per rank of the target topology
    def get_zero_checkpoint_state(self, pp_index: int, tp_index: int, dp_index: int,
                                  strip_tensor_paddings: bool = True) -> Optional[dict]:
        return self.zero_checkpoint.get_state_for_rank(pp_index, tp_index, dp_index, keys_to_ignore=[PARAM_SHAPES],
                                                       strip_tensor_paddings=strip_tensor_paddings)

    def get_zero_files(self, pp_index: int, tp_index: int, dp_index: int) -> List[str]:
        return self.zero_checkpoint.get_files_for_rank(pp_index, tp_index, dp_index)

    # model-state files per (pp, tp) cell of the target topology
    def get_2d_parallel_files(self, tp_index: int, pp_index: int) -> List[str]:
        self._check_cell(tp_index, pp_index)
        return [self.mp_rank_files[i] for i in self.new_2d_map.get_data(pp_index=pp_index, tp_index=tp_index)]

    def get_2d_parallel_state(self, tp_index: int, pp_index: int) -> Any:
        merged = None
        for path in self.get_2d_parallel_files(tp_index=tp_index, pp_index=pp_index):
            state = load_torch(path)
            merged = state if merged is None else merge_state(merged, state)
        return merged

    # Megatron's layer files
    def get_embedding_layer_id(self) -> str:
        return self.layer_keys[EMBEDDING_LAYER_INDEX]

    def get_final_norm_layer_id(self) -> str:
        return self.layer_keys[self.final_layer_norm_idx]

    def get_embedding_files(self, tp_index: int) -> List[str]:
        return self._tp_files(self.tp_to_embedding_map, tp_index, "embedding")

    def get_embedding_state(self, tp_index: int) -> Dict[str, torch.Tensor]:
        return self._merge_slices([load_torch(f) for f in self.get_embedding_files(tp_index)])

    def get_final_norm_files(self, tp_index: int) -> List[str]:
        return self._tp_files(self.tp_to_final_norm_map, tp_index, "final norm")

    def get_final_norm_state(self, tp_index: int) -> Any:
        return load_torch(self.get_final_norm_files(tp_index)[0])

    def get_pp_transformer_map(self, pp_index: int) -> List[str]:
        self._check_cell(0, pp_index)
        return self.pp_to_transformer_map[pp_index]

    def get_transformer_state(self, tp_index: int, pp_index: int) -> List[Dict[str, torch.Tensor]]:
        self._check_cell(tp_index, pp_index)
        return [self._merge_slices([load_torch(f) for f in files])
                for files in self.transformer_file_map.get((tp_index, pp_index), [])]

    def _check_cell(self, tp_index: int, pp_index: int) -> None:
        if not (0 <= tp_index < self.tp_degree and 0 <= pp_index < self.pp_degree):
            raise IndexError(f"(tp, pp) = ({tp_index}, {pp_index}) is outside tp_degree={self.tp_degree}, "
                             f"pp_degree={self.pp_degree}")

    @staticmethod
    def _tp_files(data_map: Dict[int, List[str]], tp_index: int, what: str) -> List[str]:
        if tp_index not in data_map:
            raise IndexError(f"no {what} layer files for tensor slice {tp_index}")
        return data_map[tp_index]

    def _layer_keys(self) -> List[str]:
        ids = {_LAYER_FILE.fullmatch(os.path.basename(f)).group(1) for f in self.layer_files}
        return [f"{LAYER_FILE_PREFIX}{i}" for i in sorted(ids, key=int)]

    def _tp_layer_map(self, layer_index: int) -> Dict[int, List[str]]:
        if not self.layer_files:
            return {}
        files = with_prefix(self.layer_files, self.layer_keys[layer_index])
        return dict(enumerate(split_evenly(files, self.tp_degree)))

    def _transformer_layers(self) -> List[str]:
        return self.layer_keys[1:self.final_layer_norm_idx]

    def _pp_transformer_map(self) -> Dict[int, List[str]]:
        layers = self._transformer_layers()
        per_stage = len(layers) // self.pp_degree
        return {i: layers[i * per_stage:(i + 1) * per_stage] for i in range(self.pp_degree)}

    def _transformer_file_map(self) -> Dict[Tuple[int, int], List[List[str]]]:
        layers = self._transformer_layers()
        per_stage = max(1, len(layers) // self.pp_degree)
        file_map: Dict[Tuple[int, int], List[List[str]]] = {}
        for i, key in enumerate(layers):
            slices = split_evenly(with_prefix(self.layer_files, key + "-"), self.tp_degree)
            for tp_index in range(self.tp_degree):
                file_map.setdefault((tp_index, i // per_stage), []).append(slices[tp_index])
        return file_map

    @staticmethod
    def _merge_slices(states: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
        """One layer's tensor slices as one state: replicated tensors from the first slice,
        the others concatenated (along LAYER_CONCAT_DIM's dimension, else 0)."""
        return {key: states[0][key] if key in SEQUENTIAL_LAYERS
                else torch.cat([s[key] for s in states], dim=LAYER_CONCAT_DIM.get(key, 0)) for key in states[0]}


# -- what the metadata says ---------------------------------------------------------------------

def autoep_zero12_metadata(model_state_metadata: Sequence[Tuple[str, Dict[str, Any]]]
                           ) -> Tuple[List[Dict[str, Any]], Optional[List[Dict[str, Any]]], bool]:
    """A DeepSpeedCheckpoint's model_state_metadata checked and merged across its files:
    (each file's parameter shapes, the AutoEP layer records by expert key prefix or None, the
    use_data_before_expert_parallelism flag). Records for one prefix must agree, and so must
    the flag; anything malformed is one line naming the file."""
    shapes_by_file, records, first_seen, flags = [], {}, {}, {}
    for path, metadata in model_state_metadata:
        shapes = metadata[PARAM_SHAPES]
        if not isinstance(shapes, dict):
            raise CheckpointError(f"checkpoint {PARAM_SHAPES} must be a list of dictionaries in {path}")
        shapes_by_file.append(shapes)
        layers = metadata[AUTOEP_LAYERS_KEY]
        if layers is not None:
            if not isinstance(layers, list):
                raise CheckpointError(f"AutoEP metadata must be a list of layer records in {path}")
            for record in layers:
                if not isinstance(record, dict):
                    raise CheckpointError(f"AutoEP layer metadata must hold dictionaries in {path}")
                prefix = record.get(AUTOEP_EXPERT_KEY_PREFIX)
                if not isinstance(prefix, str) or not prefix:
                    raise CheckpointError(f"AutoEP {AUTOEP_EXPERT_KEY_PREFIX} must be a non-empty string in {path}")
                if prefix in records and records[prefix] != record:
                    raise CheckpointError(f"AutoEP metadata for {AUTOEP_EXPERT_KEY_PREFIX} {prefix!r} differs between "
                                          f"{first_seen[prefix]} and {path}")
                records.setdefault(prefix, record)
                first_seen.setdefault(prefix, path)
        config = metadata["ds_config"]
        if not isinstance(config, dict):
            raise CheckpointError(f"checkpoint ds_config must be a dictionary in {path}")
        flag = config.get(USE_DATA_BEFORE_EXPERT_PARALLELISM, False)
        if not isinstance(flag, bool):
            raise CheckpointError(f"checkpoint {USE_DATA_BEFORE_EXPERT_PARALLELISM} must be a boolean in {path}")
        flags[path] = flag
    if len(set(flags.values())) != 1:
        raise CheckpointError(f"checkpoint {USE_DATA_BEFORE_EXPERT_PARALLELISM} disagrees across model-state files: "
                              f"{flags}")
    return shapes_by_file, list(records.values()) or None, next(iter(flags.values()))


def parallel_dimensions_of(mpu: Any) -> Dict[str, Dict[str, int]]:
    """The checkpoint_parallel_dimensions record a checkpoint saved under `mpu` carries (as
    saving.py writes it): pipeline and tensor degrees, each 1 without an mpu, asked with the
    Megatron or DeepSpeed method names the mpu has."""
    pp = tp = 1
    if mpu is not None:
        for name in ("get_pipeline_model_parallel_world_size", "get_pipe_parallel_world_size"):
            if hasattr(mpu, name):
                pp = getattr(mpu, name)()
                break
        for name in ("get_tensor_model_parallel_world_size", "get_slice_parallel_world_size",
                     "get_model_parallel_world_size"):
            if hasattr(mpu, name):
                tp = getattr(mpu, name)()
                break
    return {CHECKPOINT_PARALLEL_DIMS: {CHECKPOINT_PP_DEGREE: pp, CHECKPOINT_TP_DEGREE: tp}}
