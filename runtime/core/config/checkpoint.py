"""`checkpoint`: how checkpoints are validated and written."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ..strict import disabled, refused, supported

LATER = "is not supported yet; remove it"


@dataclass
class CheckpointConfig:
    tag_validation: Literal["Ignore", "Warn", "Fail", "IGNORE", "WARN", "FAIL", "ignore", "warn", "fail"] = supported(
        "Warn", "save_checkpoint compares every rank's tag: Ignore, Warn (one line) or Fail (CheckpointError); "
        "rank 0's tag is used")
    load_universal: bool = supported(False, "load_checkpoint reads a DeepSpeed universal checkpoint folder "
                                     "(ds_to_universal's; tag from latest_universal) at any world size and ZeRO stage")
    use_node_local_storage: bool = supported(False, "each node's local rank 0 writes the model states, manifest "
                                             "and latest into its own save_dir; ranks read from their node")
    parallel_write: Any = refused("parallel checkpoint writing by pipeline stage " + LATER, disabled,
                                  lambda v: v == {"pipeline_stage": False})
    checkpoint_serialization: Any = refused("unserialized (legacy zipfile-less) checkpoints are not supported",
                                            True)
    writer: Any = refused("DeepSpeed's fast checkpoint writers are not supported; remove it", None)
