"""Checkpoint settings across ranks (issue #11 item 6): `checkpoint.tag_validation`
(Ignore/Warn/Fail, as DeepSpeed) and `checkpoint.use_node_local_storage`, on 4 gloo ranks
laid out as 2 "nodes" of 2 (LOCAL_RANK 0,1,0,1; each node's save_dir is its own folder,
standing in for a local disk)."""
import contextlib
import io
import os

import pytest
import torch

from dist_harness import run_function
from test_checkpoint_safety import _error


def _engine(checkpoint_cfg, seed=0):
    import dslaunch.runtime as deepspeed

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
    cfg = {"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": 0.05}}, "steps_per_print": 100,
           "zero_optimization": {"stage": 1}, "checkpoint": checkpoint_cfg}
    return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]


def _step(engine, i):
    rank = engine.global_rank
    x = torch.linspace(-1, 1, 8).view(2, 4) * (i + 1) + rank
    engine.backward(engine(x).pow(2).mean())
    engine.step()


def ranks_body(root):
    rank = int(os.environ["RANK"])
    os.environ["LOCAL_RANK"] = str(rank % 2)  # two nodes of two ranks
    out = {}

    # use_node_local_storage: each node's local rank 0 writes its node's shared files.
    node_dir = os.path.join(root, f"node{rank // 2}")
    engine = _engine({"use_node_local_storage": True})
    for i in range(2):
        _step(engine, i)
    engine.save_checkpoint(node_dir, tag="t")
    _step(engine, 2)
    expected = [p.detach().clone() for p in engine.module.parameters()]
    resumed = _engine({"use_node_local_storage": True}, seed=7)
    path, _ = resumed.load_checkpoint(node_dir)
    _step(resumed, 2)
    out["node_local_resume_exact"] = all(torch.equal(a, b) for a, b in zip(expected, resumed.module.parameters()))
    out["node_files"] = sorted(os.listdir(os.path.join(node_dir, "t")))
    out["node_latest"] = open(os.path.join(node_dir, "latest")).read()

    # tag_validation: Warn (the default) saves under rank 0's tag with one warning line on rank 0 ...
    shared = os.path.join(root, "shared")
    warn = _engine({})
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        path = warn.save_checkpoint(shared, tag=f"step-r{rank // 2}")
    out["warn_path"] = os.path.basename(path)
    out["warn_stderr"] = err.getvalue()
    out["shared_tags"] = sorted(os.listdir(shared))
    # ... Fail refuses on every rank, Ignore says nothing.
    out["fail"] = _error(_engine({"tag_validation": "Fail"}).save_checkpoint, shared, tag=f"x{rank}")
    try:  # DeepSpeed asserts here: its tests catch an AssertionError
        _engine({"tag_validation": "Fail"}).save_checkpoint(shared, tag=f"y{rank}")
    except AssertionError:
        out["fail_asserts"] = True
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        out["ignore_path"] = os.path.basename(_engine({"tag_validation": "ignore"}).save_checkpoint(
            shared, tag=f"y{rank % 2}"))
    out["ignore_stderr"] = err.getvalue()
    return out


@pytest.mark.timeout(300)
def test_node_local_storage_and_tag_validation_on_two_nodes_of_two(tmp_path):
    outs = run_function(ranks_body, nprocs=4, kwargs={"root": str(tmp_path)}, timeout=270)
    for r, out in enumerate(outs):
        node = r // 2
        assert out["node_local_resume_exact"], r
        assert out["node_latest"] == "t"
        assert out["node_files"] == ["manifest.json", "mp_rank_00_model_states.pt",
                                     f"rng_state_rank_{2 * node}.pt", f"rng_state_rank_{2 * node + 1}.pt",
                                     f"zero_pp_rank_{2 * node}_mp_rank_00_optim_states.pt",
                                     f"zero_pp_rank_{2 * node + 1}_mp_rank_00_optim_states.pt"], r
        assert out["warn_path"] == "step-r0"
        assert out["fail_asserts"]
        assert out["fail"] == ("checkpoint tag differs across ranks: rank 0 'x0', rank 1 'x1', rank 2 'x2', "
                               "rank 3 'x3' (checkpoint.tag_validation: Fail)")
        assert out["ignore_path"] == "y0" and out["ignore_stderr"] == ""
    assert outs[0]["warn_stderr"] == ("dslaunch: warning: checkpoint tag differs across ranks: rank 0 'step-r0', "
                                      "rank 2 'step-r1', rank 3 'step-r1'; saving under rank 0's tag\n")
    assert all(o["warn_stderr"] == "" for o in outs[1:])
    assert outs[0]["shared_tags"] == ["latest", "step-r0", "zero_to_fp32.py"]
