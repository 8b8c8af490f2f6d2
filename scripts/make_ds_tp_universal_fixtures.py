"""Make tests/data/ds_tp_universal/ with real DeepSpeed (0.19.8, CPU, 2 gloo ranks): a
tensor-parallel (AutoTP, autotp_size 2, ZeRO-1) checkpoint DeepSpeed saved, and what DeepSpeed's
own ds_to_universal main(args) made of it.

    DS_ACCELERATOR=cpu /work/ds-venv/bin/python scripts/make_ds_tp_universal_fixtures.py

The model is an attention block in the shape AutoTP's default specs know (q/k/v column-parallel,
o row-parallel, a norm AutoTP leaves whole) plus an lm_head whose 11 rows split unevenly (6/5),
two Adam steps on fixed inputs. Written:
- ckpt/t/            DeepSpeed's checkpoint folder as it saved it (model states per tensor rank,
                     ZeRO-1 optimizer shards), unchanged;
- expected.json      per parameter, DeepSpeed's converted zero/<param>/<state>.pt: the tensor
                     (nested lists) and its cat_dim, and step.pt; plus each tensor rank's
                     weights after the steps.
tests/runtime/train/checkpoint/test_universal_tp_convert.py converts ckpt/t with our main(args)
and compares.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "ds_tp_universal")
HIDDEN, VOCAB = 8, 11


class Attn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = torch.nn.Linear(HIDDEN, HIDDEN)
        self.k_proj = torch.nn.Linear(HIDDEN, HIDDEN)
        self.v_proj = torch.nn.Linear(HIDDEN, HIDDEN)
        self.o_proj = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        return self.o_proj(self.q_proj(x) + self.k_proj(x) + self.v_proj(x))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = Attn()
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.lm_head = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, x):
        return self.lm_head(self.norm(self.self_attn(x))).pow(2).mean()


def config():
    return {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
            "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
            "zero_optimization": {"stage": 1},
            "tensor_parallel": {"autotp_size": 2, "partition_config": {"use_default_specs": False, "layer_specs": [
                {"patterns": [r".*\.(q|k|v)_proj\.weight$"], "partition_type": "column"},
                {"patterns": [r".*\.o_proj\.weight$"], "partition_type": "row"},
                {"patterns": [r".*lm_head\.weight$"], "partition_type": "column", "gather_output": True}]}}}


def worker(rank, world, port, args, result_path):
    from bench_ranks import rank_env, write_result

    rank_env(rank, world, port)
    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.checkpoint.ds_to_universal import main as convert

    deepspeed.init_distributed("gloo")
    torch.manual_seed(7)
    net = Net()
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config())
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        x = torch.randn(2, HIDDEN, generator=g)
        loss = engine(x)
        engine.backward(loss)
        engine.step()
    root = args["root"]
    engine.save_checkpoint(root, tag="t")
    local = {name: p.data.tolist() for name, p in engine.module.named_parameters()}
    dist.barrier()
    if rank == 0:
        convert(SimpleNamespace(input_folder=os.path.join(root, "t"), output_folder=os.path.join(root, "t_universal"),
                                num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                                inject_missing_state=False))
    dist.barrier()
    write_result(result_path, rank, local)


def main() -> None:
    try:
        import deepspeed
    except ImportError as exc:
        sys.exit(f"error: run this with a Python that has deepspeed installed ({exc})")
    from bench_ranks import spawn

    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(tempfile.gettempdir(), "ds-tp-universal-fixture-ext"))
    with tempfile.TemporaryDirectory() as root:
        ranks = spawn(worker, 2, {"root": root})
        local = {n: [r[n] for r in ranks] for n in ranks[0]}  # each tensor rank's weights after the steps
        universal = os.path.join(root, "t_universal", "zero")
        params = {}
        for name in sorted(os.listdir(universal)):
            folder = os.path.join(universal, name)
            if not os.path.isdir(folder):
                continue
            rec = {}
            for f in sorted(os.listdir(folder)):
                value = torch.load(os.path.join(folder, f), weights_only=False)
                if f == "step.pt":
                    rec["step"] = float(value)
                else:
                    rec[f[:-3]] = {"param": value["param"].tolist(), "cat_dim": value.get("cat_dim")}
            params[name] = rec
        shutil.rmtree(OUT, ignore_errors=True)
        shutil.copytree(os.path.join(root, "t"), os.path.join(OUT, "ckpt", "t"))
    with open(os.path.join(OUT, "expected.json"), "w") as fh:
        json.dump({"deepspeed": deepspeed.__version__, "universal": params, "local": local}, fh)
    print(f"wrote {OUT}: {len(params)} parameters")


if __name__ == "__main__":
    main()
