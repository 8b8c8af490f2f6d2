"""ZeRO shards: save on 4 ranks (stage 2, NVMe-swapped Adam state), resume on 2 and 1 with
another stage and no offload, consolidate.

Resume equality is checked against an uninterrupted 4-rank run on the same global
batches (every world size sees the same 12 sequences per micro-step), so the only
differences are reduction order: fp32, 1e-5.
"""
import os
import tempfile

import pytest
import torch

from dist_harness import run_function
from test_zero_parity import Cfg, global_mean, make_model, train_reference, train_zero

TOL = 1e-5


def _save_worker(ckpt, stage):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cfg = Cfg(stage, "float32", 2, "nvme")  # the saved Adam state comes back from the swap files
    full_losses, _ = train_reference(cfg, rank, world, 5)
    nvme = tempfile.mkdtemp(prefix="zero-nvme-", dir=ckpt)  # inside the test's own folder: removed with it
    losses, params, shard, _ = train_zero(cfg, rank, world, 3, nvme_dir=nvme)
    torch.save(shard, os.path.join(ckpt, f"zero_shard_rank{rank}.pt"))
    if rank == 0:
        model = make_model()
        model.load_state_dict(params, strict=False)
        torch.save(model.state_dict(), os.path.join(ckpt, "module.pt"))
    return {"full_losses": full_losses, "losses": losses, "params": params}


def _resume_worker(ckpt, stage, saved_world):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    shards = [torch.load(os.path.join(ckpt, f"zero_shard_rank{r}.pt"), weights_only=False) for r in range(saved_world)]
    cfg = Cfg(stage, "float32", 2, "none")
    losses, _, _, _ = train_zero(cfg, rank, world, 2, load_from=shards, first_step=3)
    return losses


@pytest.mark.timeout(300)
def test_save_on_4_ranks_resume_on_2_and_1_with_other_stages_and_consolidate(tmp_path):
    from dslaunch.runtime.checkpoint.reshard import consolidated_state_dict, tied_aliases

    saved = run_function(_save_worker, nprocs=4, kwargs={"ckpt": str(tmp_path), "stage": 2}, timeout=200)
    full = saved[0]["full_losses"]
    assert saved[0]["losses"] == pytest.approx(full[:3], rel=TOL)
    for stage, world in ((1, 2), (2, 1)):
        resumed = run_function(_resume_worker, nprocs=world, kwargs={"ckpt": str(tmp_path), "stage": stage,
                                                                    "saved_world": 4}, timeout=120)
        assert resumed[0] == pytest.approx(full[3:], rel=TOL), (stage, world)

    shards = [torch.load(tmp_path / f"zero_shard_rank{r}.pt", weights_only=False) for r in range(4)]
    module_state = torch.load(tmp_path / "module.pt")
    sd = consolidated_state_dict(shards, module_state, tied_aliases(make_model()))
    assert list(sd) == list(module_state)  # tied head.weight and frozen.* included, same order
    for name, value in saved[0]["params"].items():
        assert sd[name].dtype == torch.float32 and torch.equal(sd[name], value), name
    assert sd["head.weight"] is sd["emb.weight"] or torch.equal(sd["head.weight"], sd["emb.weight"])
    model = make_model(seed=99)
    model.load_state_dict(sd)  # strict: every key present, every shape right


def test_missing_rank_file_is_a_clear_error(tmp_path):
    from dslaunch.runtime.checkpoint import CheckpointError
    from dslaunch.runtime.checkpoint.reshard import full_fp32_params

    shard = {"groups": [{"pieces": [{"name": "w", "start": 0, "end": 3, "offset": 0}], "shapes": {"w": [2, 3]},
                         "master": {"w": torch.ones(3)}, "state": {}}]}
    with pytest.raises(CheckpointError, match=r"missing elements \[3, 6\) of fp32 weights 'w'"):
        full_fp32_params([shard])
