"""manifest.json: what a complete dslaunch checkpoint holds, written last.

It lists every file with its size and XXH3-64 checksum, plus what a loader must know before it
reads any tensor (saved world size, ZeRO stage, whether the optimizer state is sharded,
whether client_state needed pickle). Sizes are checked for every file as soon as the
manifest is read (a truncated file is caught before anything loads); each file's
checksum is checked when that file is read.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Dict

from dslaunch.launcher.bounded_read import read_bounded

from ...core.errors import CheckpointError
from .files import CHECKSUM, FileRecord, file_record
from .layout import MANIFEST

MANIFEST_LIMIT = 64 << 20  # a few hundred bytes per file listed: room for a hundred thousand files

FORMAT = "dslaunch-checkpoint/2"

# every field's JSON type; a manifest is data from disk, so each is checked before use
_FIELD_TYPES = {"tag": str, "world_size": int, "zero_stage": int, "sharded_optimizer_state": bool, "files": dict,
                "pickled_client_state": bool, "node_local": bool, "topology": dict, "layers": dict,
                "checksum": str, "format": str}
_REQUIRED = ("tag", "world_size", "zero_stage", "sharded_optimizer_state")


def _is(value, kind) -> bool:
    # JSON's true is not a number here, and a number is not a flag
    return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))


def _field_problem(d: dict) -> str:
    """The first field that is missing, unknown or of the wrong type, in words; "" if none."""
    for key in _REQUIRED:
        if key not in d:
            return f"field {key!r} is missing"
    for key, value in d.items():
        kind = _FIELD_TYPES.get(key)
        if kind is None:
            return f"unknown field {key!r}"
        if not _is(value, kind):
            return f"field {key!r} is {type(value).__name__}, expected {kind.__name__}"
    if d["world_size"] < 1 or not 0 <= d["zero_stage"] <= 3:
        return f"world_size {d['world_size']} or zero_stage {d['zero_stage']} out of range"
    for name, rec in d.get("files", {}).items():
        if not (isinstance(rec, dict) and _is(rec.get("size"), int) and rec["size"] >= 0
                and _is(rec.get("digest"), str)):
            return f"the entry of {name!r} is not {{size, digest}}"
    for key in ("topology",):
        if not all(_is(v, int) and v >= 1 for v in d.get(key, {}).values()):
            return f"field {key!r} holds a size that is not a whole number of at least 1"
    if not all(isinstance(v, str) for v in d.get("layers", {}).values()):
        return "field 'layers' holds a prefix that is not text"
    return ""


@dataclass
class Manifest:
    tag: str
    world_size: int
    zero_stage: int
    sharded_optimizer_state: bool
    files: Dict[str, FileRecord] = field(default_factory=dict)
    pickled_client_state: bool = False  # client_state.pt was saved with allow_pickle=True
    node_local: bool = False  # checkpoint.use_node_local_storage: only this node's ranks' files are here
    topology: Dict[str, int] = field(default_factory=dict)  # {"pipe", "data", "model"} sizes (parallel.py)
    layers: Dict[str, str] = field(default_factory=dict)  # pipelines: layer file -> its state_dict prefix
    checksum: str = CHECKSUM
    format: str = FORMAT

    def to_json(self) -> str:
        d = asdict(self)
        d["files"] = {k: asdict(v) for k, v in sorted(self.files.items())}
        return json.dumps(d, indent=1)

    @staticmethod
    def read(path: str) -> "Manifest":
        """The manifest of checkpoint directory `path`, with every listed file's size checked."""
        if not os.path.isdir(path):
            raise CheckpointError(f"checkpoint {path} does not exist")
        mpath = os.path.join(path, MANIFEST)
        try:
            d = json.loads(read_bounded(mpath, MANIFEST_LIMIT, "checkpoint manifest", CheckpointError))
        except (OSError, ValueError, RecursionError):  # read_bounded's own refusals pass through
            raise CheckpointError(f"checkpoint {path} is incomplete or damaged: "
                                  f"{MANIFEST} is missing or unreadable") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise CheckpointError(f"checkpoint {path}: {MANIFEST} is not a {FORMAT} manifest "
                                  f"(format {d.get('format') if isinstance(d, dict) else None!r})")
        if d.get("checksum") != CHECKSUM:
            raise CheckpointError(f"checkpoint {path}: {MANIFEST} uses checksum {d.get('checksum')!r}; "
                                  f"this dslaunch verifies {CHECKSUM}")
        problem = _field_problem(d)
        if problem:
            raise CheckpointError(f"checkpoint {path}: {MANIFEST} is damaged: {problem}")
        d["files"] = {k: FileRecord(v["size"], v["digest"]) for k, v in d["files"].items()}
        m = Manifest(**d)
        for name, rec in m.files.items():
            fpath = os.path.join(path, name)
            if os.path.basename(name) != name or not os.path.isfile(fpath) or os.path.getsize(fpath) != rec.size:
                raise CheckpointError(f"checkpoint {path} is damaged: {name} is missing or has the wrong size")
        return m

    def verify(self, path: str, name: str) -> str:
        """Path of file `name` after checking its checksum against the manifest."""
        rec = self.files.get(name)
        fpath = os.path.join(path, name)
        if rec is None and self.node_local:
            raise CheckpointError(f"checkpoint {path} was saved with checkpoint.use_node_local_storage and this "
                                  f"node does not hold {name}; resume on the nodes and world size that saved it")
        if rec is None:
            raise CheckpointError(f"checkpoint {path} is damaged: {name} is not listed in {MANIFEST}")
        if file_record(fpath) != rec:
            raise CheckpointError(f"checkpoint file {fpath} is damaged: its contents do not match "
                                  f"the {CHECKSUM} checksum in {MANIFEST}")
        return fpath
