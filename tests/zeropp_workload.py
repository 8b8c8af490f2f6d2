"""The training script of tests/runtime/zero/test_zeropp.py and scripts/make_ds_zeropp_fixtures.py (which
runs it under real DeepSpeed 0.19.8): a small transformer-like block trained with ZeRO-3 and
each ZeRO++ feature, on 4 ranks laid out as 2 hosts of 2 (rank // 2 is the host). Written
against DeepSpeed's API only: `ds` is `deepspeed` or `dslaunch.runtime`, with a process group
already started.

The hosts: dslaunch reads them from NODE_RANK (set below as the launcher would); DeepSpeed's
qgZ takes `get_accelerator().device_count()` ranks per host, which its CPU accelerator reads
from LOCAL_SIZE (set to 2 by the fixture script).

Sizes are chosen so that every 2-D weight qualifies for qgZ at 4 ranks (elements a multiple of
8, block counts that divide) while the biases and the norm take the plain reduce-scatter, and
the persistence threshold is 0 so every parameter is partitioned and gathered.
"""
from __future__ import annotations

import os
from typing import Dict

WORLD, PER_HOST = 4, 2
VOCAB, DIM, HIDDEN, SEQ, ROWS = 48, 32, 64, 8, 2  # ROWS sequences per rank and micro-batch
STEPS = 6
LR = 1e-2


def _case(**zero) -> dict:
    return {"zero": zero, "gas": zero.pop("gas", 1), "offload": zero.pop("offload", False)}


CASES: Dict[str, dict] = {
    "zero3": _case(),
    "qwz": _case(zero_quantized_weights=True),
    "qgz": _case(zero_quantized_gradients=True),
    "hpz": _case(zero_hpz_partition_size=2),
    "zeropp": _case(zero_quantized_weights=True, zero_quantized_gradients=True, zero_hpz_partition_size=2),
    "zeropp_gas2": _case(zero_quantized_weights=True, zero_quantized_gradients=True, zero_hpz_partition_size=2, gas=2),
    "zeropp_offload": _case(zero_quantized_weights=True, zero_quantized_gradients=True, zero_hpz_partition_size=2,
                            offload=True),
    "qwz_frozen": _case(zero_quantized_nontrainable_weights=True),
}


def model_class():
    import torch

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(VOCAB, DIM)
            self.up = torch.nn.Linear(DIM, HIDDEN)
            self.down = torch.nn.Linear(HIDDEN, DIM)
            self.norm = torch.nn.LayerNorm(DIM)
            self.frozen = torch.nn.Linear(DIM, DIM)
            self.frozen.requires_grad_(False)
            self.head = torch.nn.Linear(DIM, VOCAB, bias=False)

        def forward(self, x, y):
            h = self.emb(x)
            h = h + self.down(torch.relu(self.up(h)))
            h = self.norm(h + self.frozen(h))
            logits = self.head(h)
            return torch.nn.functional.cross_entropy(logits.view(-1, VOCAB).float(), y.view(-1))

    return Block


def config(case: dict) -> dict:
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0, **case["zero"]}
    if case["offload"]:
        zero["offload_optimizer"] = {"device": "cpu"}
        optimizer = {"type": "Adam", "params": {"lr": LR, "weight_decay": 0.0}}  # CPU Adam under offload
    else:
        optimizer = {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}}
    cfg = {"train_micro_batch_size_per_gpu": ROWS, "gradient_accumulation_steps": case["gas"],
           "optimizer": optimizer, "zero_optimization": zero}
    if case.get("bf16"):
        cfg["bf16"] = {"enabled": True}
    return cfg


def batches(rank: int, gas: int):
    """The same global micro-batches on both sides: STEPS * gas of them, this rank's rows."""
    import torch

    g = torch.Generator().manual_seed(1234)
    for _ in range(STEPS * gas):
        x = torch.randint(0, VOCAB, (WORLD, ROWS, SEQ), generator=g)
        y = torch.randint(0, VOCAB, (WORLD, ROWS, SEQ), generator=g)
        yield x[rank], y[rank]


def run_case(ds, case: dict, rank: int, comms_logger: bool = False) -> dict:
    """{"losses": mean loss over ranks and micro-batches per step} or {"error": one line}.
    `comms_logger`: turn on the config's comms logger (the byte counts of comm/traffic.py)."""
    import torch
    import torch.distributed as dist

    os.environ["NODE_RANK"] = str(rank // PER_HOST)
    torch.manual_seed(0)
    model = model_class()()
    try:
        cfg = config(case)
        if comms_logger:
            cfg["comms_logger"] = {"enabled": True, "prof_all": True}
        engine, _, _, _ = ds.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                       if p.requires_grad], config=cfg)
        losses, acc = [], torch.zeros(())
        for i, (x, y) in enumerate(batches(rank, case["gas"])):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            acc += loss.detach().float()
            if (i + 1) % case["gas"] == 0:
                dist.all_reduce(acc)
                losses.append(acc.item() / (WORLD * case["gas"]))
                acc = torch.zeros(())
        return {"losses": losses}
    except Exception as e:  # DeepSpeed's refusal (or failure) is part of the record
        lines = [ln for ln in str(e).splitlines() if ln.strip()]
        return {"error": f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]}
