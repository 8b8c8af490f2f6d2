"""Which saved files feed which rank when a DeepSpeed checkpoint is read at smaller pipeline /
tensor / data-parallel degrees: DeepSpeed's `model_3d_desc` and `meg_2d_parallel_map`
(deepspeed.checkpoint), and the topology a folder was saved at. Pure logic, no I/O.

A checkpoint saved at (pp, tp, dp) numbers its model-state files pp_index * tp + tp_index, and
its ZeRO files dp_index * (pp * tp) + that (the order ds_checkpoint.zero_files sorts them in).
Reading it at (pp', tp', dp') with every degree no larger:

- tensor slices: each pipeline stage's tp files, in order, are cut into tp' consecutive runs;
- pipeline stages: each tensor column's files, over the stages in order, into pp' runs;
- data parallel: each (pp', tp') cell's file indices expand to the dp copies of each one (idx,
  idx + pp*tp, ...), interleaved, and that list is cut into dp' consecutive runs, one per new
  data-parallel rank.

Growing a degree is refused (DeepSpeed refuses it too): can_reshape says why.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from ...core.errors import CheckpointError
from .constants import CHECKPOINT_PARALLEL_DIMS, CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE, LAYER_FILE_PREFIX

PP_DIM, TP_DIM, DP_DIM = "PP", "TP", "DP"


def split_evenly(items: Sequence[Any], parts: int) -> List[List[Any]]:
    """`items` cut into `parts` consecutive runs of equal length (DeepSpeed's partition_data)."""
    if parts < 1 or len(items) % parts:
        raise CheckpointError(f"cannot split {len(items)} checkpoint files into {parts} equal parts")
    size = len(items) // parts
    return [list(items[i:i + size]) for i in range(0, len(items), size)]


class meg_2d_parallel_map:  # noqa: N801  (DeepSpeed's class name)
    """File indices per (pipeline stage, tensor slice) cell; `map` keys are DeepSpeed's "pp,tp"."""

    def __init__(self, pp_degree: int, tp_degree: int):
        self.pp_degree, self.tp_degree = pp_degree, tp_degree
        self.map: Dict[str, List[int]] = {}

    def simple_init(self) -> None:
        """Each cell holds its own file: pp_index * tp_degree + tp_index."""
        self.map = {self._key(pp, tp): [pp * self.tp_degree + tp]
                    for pp in range(self.pp_degree) for tp in range(self.tp_degree)}

    def add_data(self, pp_index: int, tp_index: int, data: List[int]) -> None:
        self._check(pp_index, tp_index)
        if not isinstance(data, list):
            raise TypeError(f"meg_2d_parallel_map.add_data: data must be a list, got {type(data).__name__}")
        self.map.setdefault(self._key(pp_index, tp_index), []).extend(data)

    def get_data(self, pp_index: Optional[int] = None, tp_index: Optional[int] = None) -> List[int]:
        """The cell's indices; a None index spans that dimension (stages outer, slices inner)."""
        self._check(pp_index, tp_index)
        pps = range(self.pp_degree) if pp_index is None else [pp_index]
        tps = range(self.tp_degree) if tp_index is None else [tp_index]
        return [i for pp in pps for tp in tps for i in self.map[self._key(pp, tp)]]

    def print_data(self, tag: str) -> None:
        print(tag)
        for key, value in self.map.items():
            print(f"{key} = {value}")

    def _check(self, pp_index: Optional[int], tp_index: Optional[int]) -> None:
        for index, degree, dim in ((pp_index, self.pp_degree, PP_DIM), (tp_index, self.tp_degree, TP_DIM)):
            if index is not None and not 0 <= index < degree:
                raise IndexError(f"{dim} index {index} is outside 0..{degree - 1}")

    @staticmethod
    def _key(pp_index: int, tp_index: int) -> str:
        return f"{pp_index},{tp_index}"


def reshape_meg_2d_parallel(old_pp_degree: int, old_tp_degree: int, new_pp_degree: int, new_tp_degree: int,
                            verbose: bool = False) -> meg_2d_parallel_map:
    """The (pp, tp) grid of model-state files read at (new_pp, new_tp): tensor slices first."""
    if new_pp_degree > old_pp_degree or new_tp_degree > old_tp_degree:
        raise CheckpointError(f"cannot read a checkpoint saved at pp={old_pp_degree}, tp={old_tp_degree} at "
                              f"pp={new_pp_degree}, tp={new_tp_degree}: degrees can only shrink")
    grid = meg_2d_parallel_map(old_pp_degree, old_tp_degree)
    grid.simple_init()
    if new_tp_degree != old_tp_degree:
        merged = meg_2d_parallel_map(old_pp_degree, new_tp_degree)
        for pp in range(old_pp_degree):
            for tp, run in enumerate(split_evenly(grid.get_data(pp_index=pp), new_tp_degree)):
                merged.add_data(pp, tp, run)
        grid = merged
    if new_pp_degree != old_pp_degree:
        merged = meg_2d_parallel_map(new_pp_degree, grid.tp_degree)
        for tp in range(grid.tp_degree):
            for pp, run in enumerate(split_evenly(grid.get_data(tp_index=tp), new_pp_degree)):
                merged.add_data(pp, tp, run)
        grid = merged
    if verbose:
        grid.print_data("reshaped 2d map:")
    return grid


class model_3d_desc:  # noqa: N801  (DeepSpeed's class name)
    """A checkpoint's (or a reader's) pipeline, tensor and data-parallel degrees."""

    def __init__(self, pp_degree: int = 1, tp_degree: int = 1, dp_degree: int = 1):
        self.pp_degree, self.tp_degree, self.dp_degree = pp_degree, tp_degree, dp_degree

    def get_desc(self) -> str:
        return f"{PP_DIM},{TP_DIM},{DP_DIM} = ({self.pp_degree}, {self.tp_degree}, {self.dp_degree})"

    def world_size(self) -> int:
        return self.pp_degree * self.tp_degree * self.dp_degree

    def is_valid(self, pp_index: int, tp_index: int, dp_index: int) -> Tuple[bool, List[str]]:
        errors = [f"{dim} indexing error: index {index} >= degree {degree}"
                  for index, degree, dim in ((pp_index, self.pp_degree, PP_DIM), (tp_index, self.tp_degree, TP_DIM),
                                             (dp_index, self.dp_degree, DP_DIM)) if index >= degree]
        return not errors, errors

    def can_reshape(self, target: "model_3d_desc") -> Tuple[bool, List[str]]:
        """(whether `target` can read this checkpoint, why not): no degree may grow."""
        errors = [f"Expansion reshape not supported - {dim}: {old} ---> {new}"
                  for dim, old, new in ((PP_DIM, self.pp_degree, target.pp_degree),
                                        (TP_DIM, self.tp_degree, target.tp_degree),
                                        (DP_DIM, self.dp_degree, target.dp_degree)) if new > old]
        return not errors, errors

    def reshape(self, target: "model_3d_desc", verbose: bool = False) -> List[meg_2d_parallel_map]:
        """For each of `target`'s data-parallel ranks, its (pp, tp) grid of ZeRO file indices."""
        ok, errors = self.can_reshape(target)
        if not ok:
            raise CheckpointError(f"cannot read a checkpoint saved at {self.get_desc()} at {target.get_desc()}: "
                                  + "; ".join(errors))
        grid = reshape_meg_2d_parallel(self.pp_degree, self.tp_degree, target.pp_degree, target.tp_degree, verbose)
        stride = self.pp_degree * self.tp_degree  # ZeRO files of one data-parallel rank
        per_rank = [meg_2d_parallel_map(grid.pp_degree, grid.tp_degree) for _ in range(target.dp_degree)]
        for pp in range(grid.pp_degree):
            for tp in range(grid.tp_degree):
                copies = [idx + copy * stride for idx in grid.get_data(pp, tp) for copy in range(self.dp_degree)]
                for rank_map, run in zip(per_rank, split_evenly(copies, target.dp_degree)):
                    rank_map.add_data(pp, tp, run)
        return per_rank


def _degree(value: Any, key: str, model_file: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointError(f"checkpoint {key} must be a positive integer in {model_file}, got {value!r}")
    return value


def descriptor_from_metadata(file_list: Sequence[str], zero_file_list: Sequence[str],
                             model_state_metadata: Sequence[Tuple[str, Dict[str, Any]]]) -> model_3d_desc:
    """The degrees a folder was saved at, from each model-state file's recorded
    checkpoint_parallel_dimensions (all files or none must have them, and agree); a folder
    saved before they were recorded is read as DeepSpeed reads it: tp = the number of
    Megatron layer_01 files (pp = model files / tp), else tp = the number of model files."""
    model_files = [model_file for model_file, _ in model_state_metadata]
    found, missing = [], []
    for model_file, metadata in model_state_metadata:
        dims = metadata.get(CHECKPOINT_PARALLEL_DIMS)
        if dims is None:
            missing.append(model_file)
            continue
        if not isinstance(dims, dict):
            raise CheckpointError(f"checkpoint {CHECKPOINT_PARALLEL_DIMS} must be a dictionary in {model_file}")
        found.append((_degree(dims.get(CHECKPOINT_PP_DEGREE), CHECKPOINT_PP_DEGREE, model_file),
                      _degree(dims.get(CHECKPOINT_TP_DEGREE), CHECKPOINT_TP_DEGREE, model_file)))
    if found:
        if missing:
            raise CheckpointError(f"checkpoint {CHECKPOINT_PARALLEL_DIMS} is missing from model-state files: "
                                  f"{missing}")
        if len(set(found)) != 1:
            raise CheckpointError(f"checkpoint {CHECKPOINT_PARALLEL_DIMS} disagrees across model-state files: "
                                  f"{found}")
        pp, tp = found[0]
        if len(model_files) != pp * tp:
            raise CheckpointError(f"checkpoint has {len(model_files)} model-state files, but its "
                                  f"{CHECKPOINT_PP_DEGREE}={pp} x {CHECKPOINT_TP_DEGREE}={tp} needs {pp * tp}")
        if len(zero_file_list) % (pp * tp):
            raise CheckpointError(f"checkpoint has {len(zero_file_list)} ZeRO files, not a multiple of "
                                  f"{CHECKPOINT_PP_DEGREE}={pp} x {CHECKPOINT_TP_DEGREE}={tp}")
        return model_3d_desc(pp, tp, max(1, len(zero_file_list) // (pp * tp)))
    layer_01 = [f for f in file_list if _basename(f).startswith(f"{LAYER_FILE_PREFIX}01")]
    tp = len(layer_01) or len(model_files)
    pp = len(model_files) // tp if layer_01 else 1
    if tp == 0 or pp == 0:
        raise CheckpointError(f"checkpoint has {len(model_files)} model-state files and {len(layer_01)} "
                              f"{LAYER_FILE_PREFIX}01 files: no pipeline/tensor layout fits")
    return model_3d_desc(pp, tp, max(1, len(zero_file_list) // (pp * tp)))


def _basename(path: str) -> str:
    return path.replace("\\", "/").rsplit("/", 1)[-1]
