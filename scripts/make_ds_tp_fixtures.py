"""Make the DeepSpeed AutoTP training fixtures in tests/data/ds_autotp/ with real DeepSpeed.

    .venv/bin/python scripts/make_ds_tp_fixtures.py --ds-python /work/ds-venv/bin/python

DeepSpeed (0.19.8, CPU, gloo) trains a tiny Hugging Face Llama built from a config (weights
set from a seeded generator by parameter name, so both sides start alike whatever
transformers version each has) with `tensor_parallel.autotp_size` 2 on 2 ranks: AdamW,
gradient clipping, 6 steps of fixed batches, saving at step 3. dslaunch runs the same worker
(`import dslaunch.runtime as deepspeed`) for its own losses. For each case (ZeRO stage):

  CASE/               DeepSpeed's checkpoint (latest + global_step3/): mp_rank_00/01 model
                      states, and ZeRO shards per (data, tensor) rank
  expected.json       per case: DeepSpeed's 6 losses and dslaunch's 6 losses

tests/runtime/tensor_parallel/test_tp_checkpoint.py resumes CASE under dslaunch at tp 2 (the layout that saved it)
and tp 1 and checks steps 4-6 against DeepSpeed's losses. DeepSpeed is run, never imported
by the project.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from make_ds_fixtures import _tidy  # noqa: E402  (the interop fixtures' clean-up of a saved checkpoint)

ROOT = os.path.dirname(HERE)
OUT = os.path.join(ROOT, "tests", "data", "ds_autotp")
CASES = {"tp2_s0_fp32": 0, "tp2_s1_fp32": 1}
STEPS, SAVE_AT, WORLD, TP, ROWS, SEQ, VOCAB = 6, 3, 2, 2, 2, 8, 64


# -- the training both engines run ------------------------------------------------------------------
def make_model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32,
                      tie_word_embeddings=False, attn_implementation="eager")
    model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def tokens(step):
    import torch

    g = torch.Generator().manual_seed(900 + step)
    return torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)


def config(stage: int, tp: int) -> dict:
    # no train_batch_size: DeepSpeed 0.19.8 counts every rank in it (micro x accumulation x world),
    # dslaunch the data-parallel ranks only; micro and accumulation mean the same to both
    cfg = {"train_micro_batch_size_per_gpu": ROWS // (WORLD // tp),
           "gradient_accumulation_steps": 1, "steps_per_print": 1000, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01, "torch_adam": True}},
           "zero_optimization": {"stage": stage}}
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    return cfg


def train(deepspeed, stage: int, tp: int, first: int, steps: int, load=None, save=None):
    """Losses of steps [first, first + steps) (averaged over data ranks), resuming `load`."""
    import torch
    import torch.distributed as dist

    model = make_model()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config(stage, tp))
    if load:
        engine.load_checkpoint(load)
    world = dist.get_world_size()
    dp = world // tp
    d = dist.get_rank() // tp
    rows = ROWS // dp
    losses = []
    for step in range(first, first + steps):
        batch = tokens(step)[d * rows:(d + 1) * rows]
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        t = loss.detach().float().reshape(1).clone()
        dist.all_reduce(t)
        losses.append(float(t) / world)  # every tensor rank holds the same loss
        if save and step + 1 == SAVE_AT:
            engine.save_checkpoint(save, tag=f"global_step{SAVE_AT}")
    return losses


def worker(rank: int, world: int, port: int, job: dict, out: str) -> None:
    from bench_ranks import start_rank, write_result  # on sys.path when run as a script (tests import this file without it)

    rt, _ = start_rank(rank, world, port, as_peer=job["module"] == "deepspeed", cuda=False)
    losses = train(rt, job["stage"], job["tp"], 0, STEPS, save=job.get("save"))
    write_result(out, rank, losses)


def run_here(job: dict) -> list:
    from bench_ranks import spawn
    return spawn(worker, WORLD, job)[0]  # rank 0's losses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ds-python", help="a Python with deepspeed 0.19.8 installed")
    p.add_argument("--job", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.job:  # inside the DeepSpeed Python: run one job, print its losses
        print("LOSSES " + json.dumps(run_here(json.loads(args.job))), flush=True)
        return
    if not args.ds_python:
        sys.exit("error: give --ds-python, a Python with deepspeed installed")
    os.makedirs(OUT, exist_ok=True)
    expected = {}
    for case, stage in CASES.items():
        dest = os.path.join(OUT, case)
        shutil.rmtree(dest, ignore_errors=True)
        env = dict(os.environ, TORCH_EXTENSIONS_DIR=os.path.join(tempfile.gettempdir(), "ds-tp-fixture-ext"))
        job = {"module": "deepspeed", "stage": stage, "tp": TP, "save": dest}
        proc = subprocess.run([args.ds_python, os.path.abspath(__file__), "--job", json.dumps(job)], env=env,
                              capture_output=True, text=True)
        lines = [l for l in proc.stdout.splitlines() if l.startswith("LOSSES ")]
        if proc.returncode or not lines:
            sys.exit(f"error: DeepSpeed's run of {case} failed:\n{proc.stderr[-4000:]}")
        ds_losses = json.loads(lines[-1][len("LOSSES "):])
        _tidy(dest)  # DeepSpeed copies its recovery scripts into the checkpoint: not ours to commit
        ours = run_here({"module": "dslaunch.runtime", "stage": stage, "tp": TP})
        expected[case] = {"stage": stage, "tp": TP, "deepspeed": ds_losses, "dslaunch": ours}
        print(f"{case}: DeepSpeed {[round(x, 6) for x in ds_losses]}\n{'':>{len(case)}}  dslaunch  "
              f"{[round(x, 6) for x in ours]}", flush=True)
    with open(os.path.join(OUT, "expected.json"), "w") as fh:
        json.dump(expected, fh, indent=1)


if __name__ == "__main__":
    main()
