"""Pipeline checkpoints through the public API: save_checkpoint at pp=2 x dp=2 writes
DeepSpeed's per-layer files and per-stage/per-rank names; load_checkpoint resumes it at
pp=4 x dp=1 (in the same 4-rank job), at pp=1 x dp=2 and into the same model without a
pipeline (a 2-rank job), each continuing with the losses of the uninterrupted run (fp32,
1e-5); `dslaunch consolidate` turns it into one fp32 state_dict equal to the saved weights.
Saved twice: stage 0 (unsharded optimizer state, re-cut by name) and ZeRO-1 (shards)."""
import os
import subprocess
import sys

import pytest
import torch

from dist_harness import run_function
from test_pipe_parity import STEPS, global_batches, gptlite, gptlite_pair, pipeline_engine, replica_iter

TOL = 1e-5
SAVED_AT = 2  # steps before the save
BATCH = 8  # global batch: 4 micro-batches of 2, whatever the data-parallel size


def cfg(zero):
    return {"train_batch_size": BATCH, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.05,
            "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "betas": [0.9, 0.99], "weight_decay": 0.01}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.002, "warmup_max_lr": 0.02,
                                                         "warmup_num_steps": 3}},
            "zero_optimization": {"stage": zero, "reduce_bucket_size": 300, "allgather_bucket_size": 300}}


def data(engine):
    dp = engine.grid.get_data_parallel_world_size()
    gas = engine.gradient_accumulation_steps()
    return replica_iter(global_batches(STEPS + SAVED_AT, dp, gas), engine.grid.get_data_parallel_rank(), gas)


class Counting:
    def __init__(self, it):
        self.it, self.count = it, 0

    def __iter__(self):
        return self

    def __next__(self):
        self.count += 1
        return next(self.it)


def _save_and_resume_pp4(root):
    """4 ranks: train pp=2 x dp=2 and save after SAVED_AT steps, keep going (the reference);
    then resume each checkpoint at pp=4 x dp=1."""
    import torch.distributed as dist

    out = {"rank": dist.get_rank()}
    for zero in (0, 1):
        model, _ = gptlite_pair(gptlite())
        engine = pipeline_engine(model.to_layers(), 2, cfg(zero))
        it = data(engine)
        losses = [float(engine.train_batch(it)) for _ in range(SAVED_AT)]
        engine.save_checkpoint(os.path.join(root, f"zero{zero}"), tag="t")
        losses += [float(engine.train_batch(it)) for _ in range(STEPS)]
        out[f"ref{zero}"] = losses[SAVED_AT:]
        engine.destroy()

        model, _ = gptlite_pair(gptlite())
        torch.manual_seed(99)  # the resumed weights must come from the checkpoint, not from here
        engine = pipeline_engine(model.to_layers(), 4, cfg(zero))
        engine.load_checkpoint(os.path.join(root, f"zero{zero}"))
        it = Counting(data(engine))
        for _ in range(SAVED_AT * engine.gradient_accumulation_steps()):
            next(it.it)  # this replica's share of the steps before the save
        out[f"pp4_{zero}"] = [float(engine.train_batch(it)) for _ in range(STEPS)]
        out[f"reads_{zero}"] = (engine.stage_id, it.count)
        engine.destroy()
    return out


def _resume_on_2(root):
    """2 ranks: resume each checkpoint at pp=1 x dp=2 and without a pipeline (dp=2)."""
    import dslaunch.runtime as deepspeed

    out = {}
    for zero in (0, 1):
        ckpt = os.path.join(root, f"zero{zero}")
        model, _ = gptlite_pair(gptlite())
        engine = pipeline_engine(model.to_layers(), 1, cfg(1 - zero))  # the other stage, too
        engine.load_checkpoint(ckpt)
        it = data(engine)
        for _ in range(SAVED_AT * engine.gradient_accumulation_steps()):
            next(it)
        out[f"pp1_{zero}"] = [float(engine.train_batch(it)) for _ in range(STEPS)]
        engine.destroy()

        model, _ = gptlite_pair(gptlite())
        engine, _, _, _ = deepspeed.initialize(model=model, config=cfg(zero))
        engine.load_checkpoint(ckpt)
        saved = {k: v.detach().float().clone() for k, v in engine.strategy.module_state_dict().items()}
        batches = global_batches(STEPS + SAVED_AT, 2, engine.gradient_accumulation_steps())[SAVED_AT:]
        losses = []
        for step in batches:
            mine = step[engine.dp_rank * 2:(engine.dp_rank + 1) * 2]
            total = 0.0
            for x, y in mine:
                loss = torch.nn.functional.cross_entropy(engine(x), y)
                engine.backward(loss)
                engine.step()
                total += float(loss) / len(mine)
            t = torch.tensor([total])
            torch.distributed.all_reduce(t)
            losses.append(float(t) / 2)
        out[f"plain_{zero}"] = losses
        out[f"saved_{zero}"] = saved
        engine.destroy()
    return out


@pytest.mark.timeout(600)
def test_pipeline_checkpoint_resumes_at_other_topologies_and_consolidates(tmp_path):
    root = str(tmp_path)
    saved = run_function(_save_and_resume_pp4, nprocs=4, kwargs={"root": root}, timeout=400)
    for zero in (0, 1):
        ref = saved[0][f"ref{zero}"]
        files = sorted(os.listdir(os.path.join(root, f"zero{zero}", "t")))
        # DeepSpeed's names: a file per layer with weights (the lambdas have none), one model-states
        # file per stage, ZeRO shards named by data-parallel rank and stage
        assert "layer_00-model_states.pt" in files and "layer_01-model_states.pt" not in files
        assert {"mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"} <= set(files)
        shards = {f for f in files if f.endswith("optim_states.pt")}
        assert shards == ({f"zero_pp_rank_{d}_mp_rank_{s:02d}_optim_states.pt" for d in (0, 1) for s in (0, 1)}
                          if zero else set())
        for r in saved:
            assert r[f"ref{zero}"] == pytest.approx(ref, rel=TOL, abs=TOL)
            assert r[f"pp4_{zero}"] == pytest.approx(ref, rel=TOL, abs=TOL), (zero, r["rank"])
            stage, reads = r[f"reads_{zero}"]
            assert reads == (STEPS * 4 if stage in (0, 3) else 0), (stage, reads)  # only first and last read

    resumed = run_function(_resume_on_2, nprocs=2, kwargs={"root": root}, timeout=300)
    for zero in (0, 1):
        ref = saved[0][f"ref{zero}"]
        for r in resumed:
            assert r[f"pp1_{zero}"] == pytest.approx(ref, rel=TOL, abs=TOL), zero
            assert r[f"plain_{zero}"] == pytest.approx(ref, rel=TOL, abs=TOL), zero

        out = tmp_path / f"zero{zero}.pt"
        dslaunch = os.path.join(os.path.dirname(sys.executable), "dslaunch")
        proc = subprocess.run([dslaunch, "consolidate", os.path.join(root, f"zero{zero}"), str(out)],
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        consolidated = torch.load(out)
        from dslaunch.runtime.pipe import from_pipeline_state

        got = from_pipeline_state(gptlite().GPTlite(), consolidated)
        want = resumed[0][f"saved_{zero}"]
        assert set(got) == set(want)
        for k in want:
            assert got[k].dtype == torch.float32 and torch.equal(got[k], want[k]), k
