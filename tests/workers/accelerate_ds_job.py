"""A small Accelerate training loop with a DeepSpeed plugin, for `accelerate launch` (2 processes).

    accelerate launch --use_deepspeed --deepspeed_config_file ds.json --num_processes 2 \
        accelerate_ds_job.py OUT_DIR

The DeepSpeed config (written by tests/compat/test_accelerate_deepspeed.py) either holds the
optimizer (AdamW, "auto" lr/weight decay filled from DummyOptim) and a WarmupDecayLR schedule
(filled from DummyScheduler), or none: then the script passes torch's AdamW and no schedule
(with offload_optimizer, Accelerate swaps it for deepspeed.ops.adam.DeepSpeedCPUAdam).
Each step, rank 0 also runs a plain-torch reference on the global batch (accelerator.gather
of every rank's micro batch) with torch's AdamW (and dslaunch's WarmupDecayLR); the job
records the largest difference between the engine's weights, read through
accelerator.get_state_dict (under ZeRO-3 gathered onto rank 0), and the reference's after
every optimizer step. After step 2 it saves accelerator.save_state; at the end it loads
that state back and replays steps 3-4, which must land on the same weights.
"""
import json
import os
import socket
import sys

import torch

LR, WD, STEPS, MICRO, GAS, CLIP = 1e-2, 0.01, 4, 4, 2, 1.0


def model_fn() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def main(out_dir: str) -> None:
    from accelerate import Accelerator
    from accelerate.utils import DummyOptim, DummyScheduler, InitProcessGroupKwargs

    # gloo: Accelerate names no backend for DeepSpeed on a machine without GPUs.
    kwargs = [] if torch.cuda.is_available() else [InitProcessGroupKwargs(backend="gloo")]
    acc = Accelerator(kwargs_handlers=kwargs)
    ds_config = acc.state.deepspeed_plugin.deepspeed_config
    config_optimizer = "optimizer" in ds_config
    g = torch.Generator().manual_seed(11)
    data = torch.utils.data.TensorDataset(torch.randn(MICRO * GAS * STEPS * 2, 8, generator=g),
                                          torch.randn(MICRO * GAS * STEPS * 2, 1, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=MICRO)
    model = model_fn()
    if config_optimizer:
        opt = DummyOptim(model.parameters(), lr=LR, weight_decay=WD)
        sched = DummyScheduler(opt, total_num_steps=STEPS * acc.num_processes, warmup_num_steps=2)
        engine, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
        engine, opt, loader = acc.prepare(model, opt, loader)
        sched = None

    ref = model_fn()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    from dslaunch.runtime.lr_schedules import WarmupDecayLR
    ref_sched = WarmupDecayLR(ref_opt, total_num_steps=STEPS, warmup_min_lr=0, warmup_max_lr=LR,
                              warmup_num_steps=2) if config_optimizer else None

    def weights():
        state = acc.get_state_dict(engine)  # ZeRO-3: gathered, on rank 0 only
        return None if state is None else {k: v.detach().clone().float() for k, v in state.items()}

    def micro_step(x, y):
        with acc.accumulate(engine):
            loss = torch.nn.functional.mse_loss(engine(x), y)
            acc.backward(loss)
            opt.step()
            if sched is not None:
                sched.step()
            opt.zero_grad()
        return loss

    batches = list(loader)
    losses, diffs, after_step = [], [], {}
    for micro, (x, y) in enumerate(batches, start=1):
        loss = micro_step(x, y)
        gx, gy = acc.gather(x), acc.gather(y)  # every rank's micro batch: the reference's global batch
        (torch.nn.functional.mse_loss(ref(gx), gy) / GAS).backward()
        if micro % GAS:
            continue
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        ref_opt.step()
        if ref_sched is not None:
            ref_sched.step()
        ref_opt.zero_grad()
        step = micro // GAS
        losses.append(float(acc.gather(loss.detach()[None]).mean()))
        after_step[step] = mine = weights()
        if mine is not None:
            diffs.append(max(float((mine[k] - v).abs().max()) for k, v in ref.state_dict().items()))
        if step == 2:
            acc.save_state(os.path.join(out_dir, "state"))
        if step == STEPS:
            break

    # back to step 2, then the same micro batches again
    acc.load_state(os.path.join(out_dir, "state"))
    for x, y in batches[2 * GAS:STEPS * GAS]:
        micro_step(x, y)
    replayed = weights()
    print(f"rank {acc.process_index} of {acc.num_processes} on {socket.gethostname()}", flush=True)
    if acc.is_main_process:
        final = after_step[STEPS]
        with open(os.path.join(out_dir, "out.json"), "w") as fh:
            json.dump({"losses": losses, "diffs": diffs, "num_processes": acc.num_processes,
                       "distributed_type": str(acc.distributed_type), "engine": type(engine).__name__,
                       "optimizer": type(engine.optimizer).__name__, "lr": engine.get_lr(),
                       "replay_diff": max(float((replayed[k] - v).abs().max()) for k, v in final.items()),
                       "sharded": [n for n, p in engine.module.named_parameters() if p.numel() == 0]}, fh)
    acc.end_training()


if __name__ == "__main__":
    main(sys.argv[1])
