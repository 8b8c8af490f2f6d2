"""`checkpoint`: how checkpoints are validated and written."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..strict import disabled, refused

LATER = "is not supported yet; remove it"


@dataclass
class CheckpointConfig:
    tag_validation: Any = refused("checkpoint tag validation across ranks " + LATER, "Ignore", "IGNORE", "ignore")
    load_universal: Any = refused("universal checkpoints are not supported; checkpoints re-shard on load by "
                                  "themselves", False)
    use_node_local_storage: Any = refused("node-local checkpoint storage " + LATER, False)
    parallel_write: Any = refused("parallel checkpoint writing by pipeline stage " + LATER, disabled,
                                  lambda v: v == {"pipeline_stage": False})
    checkpoint_serialization: Any = refused("unserialized (legacy zipfile-less) checkpoints are not supported",
                                            True)
    writer: Any = refused("DeepSpeed's fast checkpoint writers are not supported; remove it", None)
