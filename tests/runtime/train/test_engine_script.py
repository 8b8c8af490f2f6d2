"""A training script written in the style of DeepSpeed's getting-started tutorial runs with
only its import changed, on 2 gloo ranks started like torchrun/dslaunch would (RANK,
WORLD_SIZE, MASTER_ADDR... in the environment) and as a plain single `python` process;
a bad config in such a script is one line on stderr and exit status 2."""
import json
import os
import re
import sys

import pytest

from dist_harness import run_function, run_script

SCRIPT = r'''
import argparse
import json

import torch
import dslaunch.runtime as deepspeed   # the only change from a DeepSpeed script


def add_argument():
    parser = argparse.ArgumentParser(description="toy regression")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--save_dir", type=str, default=None)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 32)
        self.fc2 = torch.nn.Linear(32, 1)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Points(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(256, 8, generator=g)
        self.y = self.x[:, :4].sum(dim=1, keepdim=True)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


args = add_argument()
deepspeed.init_distributed()
torch.manual_seed(0)
net = Net()
parameters = filter(lambda p: p.requires_grad, net.parameters())
model_engine, optimizer, trainloader, _ = deepspeed.initialize(
    args=args, model=net, model_parameters=parameters, training_data=Points())
device = deepspeed.accelerator.get_accelerator().device_name(model_engine.local_rank)
criterion = torch.nn.MSELoss()

epoch_losses = []
for epoch in range(args.epochs):
    running = 0.0
    for i, data in enumerate(trainloader):
        inputs, labels = data[0].to(device), data[1].to(device)
        outputs = model_engine(inputs)
        loss = criterion(outputs, labels)
        model_engine.backward(loss)
        model_engine.step()
        running += loss.item()
    epoch_losses.append(running / (i + 1))
    if args.save_dir:
        model_engine.save_checkpoint(args.save_dir, client_state={"epoch": epoch})

_, client = model_engine.load_checkpoint(args.save_dir) if args.save_dir else (None, None)
print("RESULT " + json.dumps({"rank": model_engine.global_rank, "world": model_engine.world_size,
                              "losses": epoch_losses, "steps": model_engine.global_steps,
                              "micro": model_engine.train_micro_batch_size_per_gpu(),
                              "gas": model_engine.gradient_accumulation_steps(),
                              "batches": len(trainloader), "client": client}))
'''


def _result(stdout):
    lines = [l for l in stdout.splitlines() if l.startswith("RESULT ")]
    assert lines, stdout
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


@pytest.mark.timeout(120)
def test_getting_started_script_on_two_ranks(tmp_path, script):
    cfg = tmp_path / "ds_config.json"
    cfg.write_text(json.dumps({"train_batch_size": 32, "gradient_accumulation_steps": 2, "steps_per_print": 4,
                               "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
                               "zero_optimization": {"stage": 0}}))
    save = tmp_path / "ckpt"
    runs = run_script([str(script), "--deepspeed", "--deepspeed_config", str(cfg), "--save_dir", str(save)],
                      nprocs=2, timeout=100)
    assert all(r.returncode == 0 for r in runs), runs[0].stderr[-3000:] + runs[1].stderr[-3000:]
    res = [_result(r.stdout) for r in runs]
    assert [r["rank"] for r in res] == [0, 1] and res[0]["world"] == 2
    assert res[0]["micro"] == 8 and res[0]["gas"] == 2
    assert res[0]["batches"] == 16  # 256 points / 2 ranks / micro batch 8: the sampler splits the data
    assert res[0]["steps"] == 3 * 16 // 2
    assert res[0]["losses"][-1] < res[0]["losses"][0] / 2
    assert res[0]["client"] == {"epoch": 2}
    # rank 0 logs every steps_per_print steps; rank 1 is quiet
    # the loader's length gives the epoch position; the loss is labelled as a window mean
    assert "step 4 (epoch 0 4/8) | loss " in runs[0].stdout and "(mean of 4 steps)" in runs[0].stdout
    assert "step 4" not in runs[1].stdout
    # rank 0 says once what is running
    assert len(re.findall(r"dslaunch: ZeRO stage 0 \| fp32 \| offload optimizer none, params none \| optimizer "
                          r"Adam \(FusedAdam, adam_w_mode\) stepped by dslaunch CPU Adam \(\w+\) for CPU parameters \| world 2 = data 2 x pipeline 1 x model 1 \| "
                          r"batch 32 = micro 8 x accumulation 2 x data 2", runs[0].stdout)) == 1
    assert "dslaunch: ZeRO" not in runs[1].stdout
    assert (save / "latest").read_text() == "global_step24"
    assert sorted(os.listdir(save)) == ["global_step16", "global_step24", "global_step8", "latest", "zero_to_fp32.py"]


@pytest.mark.timeout(120)
def test_plain_python_single_process_and_one_line_config_error(tmp_path, script):
    import subprocess

    cfg = tmp_path / "ds_config.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 16, "optimizer": {"type": "SGD",
                                                                                  "params": {"lr": 0.05}}}))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    ok = subprocess.run([sys.executable, str(script), "--deepspeed_config", str(cfg), "--epochs", "2"],
                        env=env, capture_output=True, text=True, timeout=100)
    assert ok.returncode == 0, ok.stderr[-3000:]
    res = _result(ok.stdout)
    assert res["world"] == 1 and res["batches"] == 16 and res["losses"][1] < res["losses"][0]

    cfg.write_text('{"train_batch_size": 16,\n "optimizer": {"type": "Adam", "params": {"lr": 0.01}},\n'
                   ' "zero_optimization": {"stage": 0, "overlap_com": true}}')
    bad = subprocess.run([sys.executable, str(script), "--deepspeed_config", str(cfg)],
                         env=env, capture_output=True, text=True, timeout=100)
    assert bad.returncode == 2
    errors = [l for l in bad.stderr.splitlines() if l.startswith("error:")]
    assert errors == [f"error: {cfg}: zero_optimization.overlap_com: unknown key; did you mean 'overlap_comm'?"]
    assert "Traceback" not in bad.stderr


def _batch_error_under_a_script_initialised_group():
    import torch

    import dslaunch.runtime as deepspeed

    model = torch.nn.Linear(2, 2)
    try:
        deepspeed.initialize(model=model, model_parameters=model.parameters(),
                             config={"train_batch_size": 3, "train_micro_batch_size_per_gpu": 2})
    except deepspeed.ConfigError as exc:
        return str(exc)
    return None


def test_batch_error_names_a_process_group_the_script_made():
    # the harness calls torch's init_process_group itself, as a torchrun script would
    msg = run_function(_batch_error_under_a_script_initialised_group, nprocs=2, timeout=120)[0]
    assert msg is not None and "data-parallel size 2 (the default process group the script initialised itself)" in msg, msg
