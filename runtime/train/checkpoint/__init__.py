"""dslaunch.runtime.checkpoint: everything about checkpoints, in one package.

    errors.py       CheckpointError, the one failure type (one line, exit 2 when uncaught)
    layout.py       file names (DeepSpeed's, with real dp/pp/mp ranks), tags, `latest`
    files.py        atomic checksummed writes, weights_only reads, OS errors as one line
    manifest.py     manifest.json: every file's size and XXH3-64 checksum, written last
    rng.py          per-rank RNG states as plain values
    agree.py        every rank learns whether every other rank's part succeeded
    run.py          Run: what a save or load sees of the training run (built by the engine), Placement
    saving.py       engine.save_checkpoint: write, then commit the tag atomically
    loading.py      engine.load_checkpoint: read and check everything, then apply
    reshard.py      ZeRO shards re-cut for any world size and stage; consolidation maths
    dsformat.py     DeepSpeed's file contents <-> our shards and states (we write and read its format)
    foreign.py      DeepSpeed's pickled classes as inert stand-ins, read and written without it
    reader.py       one Checkpoint view of a directory, dslaunch's or DeepSpeed's
    consolidate.py  `dslaunch consolidate`: one fp32 state_dict from any checkpoint
    universal.py    DeepSpeed's universal checkpoint folders: read (load_universal) and written
    ds_to_universal.py  `dslaunch ds_to_universal` / deepspeed.checkpoint.ds_to_universal
    zero_to_fp32.py the script save_checkpoint ships beside the tags, as DeepSpeed does
    reshape3d.py    which saved files feed which rank at smaller (pp, tp, dp) degrees: model_3d_desc
    ds_checkpoint.py  DeepSpeed's folder readers: DeepSpeedCheckpoint, ZeROCheckpoint, get_model_3d_descriptor
"""
from ...core.errors import CheckpointDirError, CheckpointError
from .ds_checkpoint import DeepSpeedCheckpoint, ZeROCheckpoint, get_model_3d_descriptor
from .loading import load
from .reshape3d import model_3d_desc
from .run import Placement, Run
from .saving import save

__all__ = ["CheckpointDirError", "CheckpointError", "DeepSpeedCheckpoint", "Placement", "Run", "ZeROCheckpoint",
           "get_model_3d_descriptor", "load", "model_3d_desc", "save"]
