"""A small Accelerate training loop with a DeepSpeed plugin, for `accelerate launch` (2 processes).

    accelerate launch --use_deepspeed --deepspeed_config_file ds.json --num_processes 2 \
        accelerate_ds_job.py OUT_JSON

The DeepSpeed config (written by tests/test_accelerate_deepspeed.py) holds the optimizer
(AdamW, "auto" lr/weight decay filled from DummyOptim) and a WarmupDecayLR schedule
(filled from DummyScheduler), ZeRO stage and accumulation 2. Each step, rank 0 also runs a
plain-torch reference on the global batch (accelerator.gather of every rank's micro batch)
with torch's AdamW and dslaunch's WarmupDecayLR; the job records the largest difference
between the engine's weights and the reference's after every optimizer step.
"""
import json
import socket
import sys

import torch

LR, WD, STEPS, MICRO, GAS, CLIP = 1e-2, 0.01, 4, 4, 2, 1.0


def model_fn() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def main(out_path: str) -> None:
    from accelerate import Accelerator
    from accelerate.utils import DummyOptim, DummyScheduler, InitProcessGroupKwargs

    # gloo: Accelerate names no backend for DeepSpeed on a machine without GPUs.
    kwargs = [] if torch.cuda.is_available() else [InitProcessGroupKwargs(backend="gloo")]
    acc = Accelerator(kwargs_handlers=kwargs)
    g = torch.Generator().manual_seed(11)
    data = torch.utils.data.TensorDataset(torch.randn(MICRO * GAS * STEPS * 2, 8, generator=g),
                                          torch.randn(MICRO * GAS * STEPS * 2, 1, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=MICRO)
    model = model_fn()
    opt = DummyOptim(model.parameters(), lr=LR, weight_decay=WD)
    sched = DummyScheduler(opt, total_num_steps=STEPS * acc.num_processes, warmup_num_steps=2)
    engine, opt, loader, sched = acc.prepare(model, opt, loader, sched)

    ref = model_fn()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    from dslaunch.runtime.lr_schedules import WarmupDecayLR
    ref_sched = WarmupDecayLR(ref_opt, total_num_steps=STEPS, warmup_min_lr=0, warmup_max_lr=LR, warmup_num_steps=2)

    losses, diffs, micro = [], [], 0
    for x, y in loader:
        with acc.accumulate(engine):
            loss = torch.nn.functional.mse_loss(engine(x), y)
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
        gx, gy = acc.gather(x), acc.gather(y)  # every rank's micro batch: the reference's global batch
        (torch.nn.functional.mse_loss(ref(gx), gy) / GAS).backward()
        micro += 1
        if micro % GAS == 0:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
            ref_opt.step()
            ref_sched.step()
            ref_opt.zero_grad()
            losses.append(float(acc.gather(loss.detach()[None]).mean()))
            mine = acc.unwrap_model(engine).state_dict()
            diffs.append(max(float((mine[k] - v).abs().max()) for k, v in ref.state_dict().items()))
    print(f"rank {acc.process_index} of {acc.num_processes} on {socket.gethostname()}", flush=True)
    if acc.is_main_process:
        with open(out_path, "w") as fh:
            json.dump({"losses": losses, "diffs": diffs, "num_processes": acc.num_processes,
                       "distributed_type": str(acc.distributed_type), "engine": type(engine).__name__,
                       "optimizer": type(engine.optimizer).__name__,
                       "lr": engine.get_lr()}, fh)
    acc.end_training()


if __name__ == "__main__":
    main(sys.argv[1])
