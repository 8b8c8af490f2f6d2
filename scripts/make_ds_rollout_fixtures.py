"""Make the rollout fixture tests/data/ds_rollout/expected.json with real DeepSpeed.

    .venv/bin/python scripts/make_ds_rollout_fixtures.py --ds-python /work/ds-venv/bin/python

DeepSpeed 0.19.8 (CPU accelerator, one process) answers every case of CASES through its
deepspeed.runtime.rollout: generalized_jsd_loss over beta, temperature, teacher_top_k and
pointwise_clip; ResponseTokenBatch.from_rollout's targets and mask; and
HybridEngineRollout.generate over a stand-in module whose generate() returns a fixed
continuation (EOS early, late, twice, absent; pad equal to EOS; several samples per prompt),
recording the batch it returns and the keyword arguments it passed to module.generate.
The inputs are written beside the answers, so tests/runtime/inference/test_rollout_api.py
replays dslaunch on exactly them without DeepSpeed. DeepSpeed is run, never imported by
the project.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OUT = os.path.join(ROOT, "tests", "data", "ds_rollout", "expected.json")


def inputs() -> dict:
    """The cases' inputs, drawn once here and stored with the answers."""
    import torch

    g = torch.Generator().manual_seed(20261128)
    jsd = []
    for beta in (0.0, 0.3, 0.5, 1.0):
        for temperature, top_k, clip in ((1.0, None, None), (2.0, 3, None), (0.7, None, 0.05)):
            s = torch.randn(2, 4, 6, generator=g) * 2
            t = torch.randn(2, 4, 6, generator=g) * 2
            mask = torch.rand(2, 4, generator=g) > 0.3
            jsd.append({"student": s.tolist(), "teacher": t.tolist(), "mask": mask.tolist(), "beta": beta,
                        "temperature": temperature, "top_k": top_k, "clip": clip})
    responses = [{"input_ids": [[0, 0, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9]],
                  "attention_mask": [[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]], "start": [3, 4]},
                 {"input_ids": [[3, 4, 5]], "attention_mask": [[1, 1, 1]], "start": [1]}]
    # generate: prompts, the continuation the stand-in module appends (one row per sample), ids
    gen = [
        {"prompts": [[0, 5, 6], [7, 8, 9]], "mask": [[0, 1, 1], [1, 1, 1]], "n": 1, "pad": 0, "eos": 2,
         "continuation": [[11, 2, 13, 2], [14, 15, 16, 17]], "temperature": 0.0},
        {"prompts": [[5, 6]], "mask": [[1, 1]], "n": 3, "pad": None, "eos": 2,
         "continuation": [[2, 4, 4], [4, 2, 2], [4, 4, 4]], "temperature": 0.8, "top_p": 0.9, "top_k": 5},
        {"prompts": [[1, 5, 6], [1, 1, 7]], "mask": [[0, 1, 1], [0, 0, 1]], "n": 2, "pad": 1, "eos": [2, 3],
         "continuation": [[3, 9, 9], [9, 2, 9], [9, 9, 9], [1, 3, 1]], "temperature": 1.0, "top_k": -1},
    ]
    return {"jsd": jsd, "responses": responses, "generate": gen}


class StandIn:
    """engine.module: generate() records its keyword arguments and appends the case's tokens."""

    def __init__(self, continuation):
        import torch

        self.continuation = torch.tensor(continuation)
        self.kwargs = None

    def generate(self, prompts, **kwargs):
        import torch

        self.kwargs = {k: v for k, v in kwargs.items() if k != "attention_mask"}
        self.kwargs["attention_mask"] = kwargs["attention_mask"].tolist()
        return torch.cat([prompts, self.continuation.to(prompts.dtype)], dim=1)


def answer(rollout, hybrid, cases: dict) -> dict:
    """Every case's answer from the rollout package `rollout` (DeepSpeed's or dslaunch's)."""
    import types

    import torch

    out = {"jsd": [], "responses": [], "generate": []}
    for c in cases["jsd"]:
        r = rollout.generalized_jsd_loss(torch.tensor(c["student"]), torch.tensor(c["teacher"]),
                                         torch.tensor(c["mask"]), beta=c["beta"], temperature=c["temperature"],
                                         teacher_top_k=c["top_k"], pointwise_clip=c["clip"])
        out["jsd"].append({"loss": r.loss.item(), "loss_sum": r.loss_sum.item(),
                           "count": r.valid_token_count.item()})
    for c in cases["responses"]:
        batch = rollout.RolloutBatch(input_ids=torch.tensor(c["input_ids"]),
                                     attention_mask=torch.tensor(c["attention_mask"]),
                                     response_start_idx=torch.tensor(c["start"]))
        r = rollout.ResponseTokenBatch.from_rollout(batch)
        out["responses"].append({"target_ids": r.target_ids.tolist(), "response_mask": r.response_mask.tolist()})
    for c in cases["generate"]:
        module = StandIn(c["continuation"])
        engine = types.SimpleNamespace(module=module)
        tokenizer = types.SimpleNamespace(pad_token_id=c["pad"], eos_token_id=c["eos"])
        sampling = rollout.SamplingConfig(max_new_tokens=len(c["continuation"][0]), n_samples_per_prompt=c["n"],
                                          temperature=c["temperature"], top_p=c.get("top_p", 1.0),
                                          top_k=c.get("top_k", -1))
        request = rollout.RolloutRequest(prompt_ids=torch.tensor(c["prompts"]),
                                         prompt_attention_mask=torch.tensor(c["mask"]))
        b = hybrid.HybridEngineRollout(engine, tokenizer).generate(request, sampling)
        out["generate"].append({"input_ids": b.input_ids.tolist(), "attention_mask": b.attention_mask.tolist(),
                                "response_start_idx": b.response_start_idx.tolist(), "kwargs": module.kwargs})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ds-python", help="a Python with deepspeed 0.19.8 installed")
    p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.job:  # inside DeepSpeed's Python
        import deepspeed.runtime.rollout as rollout
        import deepspeed.runtime.rollout.hybrid_engine_rollout as hybrid

        cases = json.load(sys.stdin)
        print("RESULTS " + json.dumps(answer(rollout, hybrid, cases)), flush=True)
        return
    if not args.ds_python:
        sys.exit("error: give --ds-python, a Python with deepspeed installed")
    cases = inputs()
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    run = subprocess.run([args.ds_python, os.path.abspath(__file__), "--job"], input=json.dumps(cases), env=env,
                         capture_output=True, text=True, check=True, cwd="/")
    line = next(x for x in run.stdout.splitlines() if x.startswith("RESULTS "))
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as fh:
        json.dump({"deepspeed": "0.19.8", "inputs": cases, "expected": json.loads(line[len("RESULTS "):])}, fh)
        fh.write("\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
