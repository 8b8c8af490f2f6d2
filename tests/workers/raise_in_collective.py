"""Test worker: rank 0 raises while rank 1 waits in a collective, in a script that uses
dslaunch.runtime. The launcher must name rank 0 and show its traceback, never rank 1's
follow-on gloo error.

    raise_in_collective.py CASE [DIR]
CASES
    zero0 | zero1 | zero2 | zero3 | pipe
                 a real engine of that kind on 2 gloo ranks: one step on both, then rank 0
                 raises and rank 1 takes the next step (it waits in a collective)
    slow_exit    the race decided against rank 0: rank 0 raises and then takes 3 s in an
                 exit handler; rank 1 waits for DIR/raised (written by rank 0's excepthook,
                 after the runtime's), prints a gloo-style follow-on traceback and exits 1
                 first
    kill_in_save DIR
                 rank 0 is killed (SIGKILL) while it writes a checkpoint and rank 1 fails in the
                 save's collectives. The race is decided against rank 0: before it dies, rank
                 0 stops the supervisor (SIGSTOP), and rank 1 wakes it (SIGCONT) only after its
                 runtime has announced its exception, so the supervisor sees rank 0's death and
                 rank 1's announcement at once. (A helper wakes the supervisor after 60 s
                 whatever happens, so a broken run ends.)
"""
import atexit
import sys
import time
from pathlib import Path

import torch

import dslaunch.runtime as deepspeed

args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
case = args[0]
if case == "slow_exit":
    import os

    marker = Path(args[1]) / "raised"
    if os.environ["RANK"] == "0":
        previous = sys.excepthook

        def hook(*exc):
            previous(*exc)
            marker.touch()

        sys.excepthook = hook
        atexit.register(time.sleep, 3.0)  # the runtime's handler is registered first, so runs after this
        raise RuntimeError("rank 0 broke on purpose")
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    print("Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
          "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1",
          file=sys.stderr, flush=True)
    sys.exit(1)

torch.manual_seed(0)
if case == "pipe":
    net = deepspeed.pipe.PipelineModule(layers=[torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)], num_stages=2,
                                        loss_fn=torch.nn.MSELoss(), partition_method="uniform")
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, _, _, _ = deepspeed.initialize(model=net, config=cfg)
else:
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1 if case == "kill_in_save" else int(case[-1])},
           "zero_allow_untested_optimizer": True, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
rank = engine.global_rank
batch = (torch.ones(2, 4), torch.zeros(2, 4))


def step():
    if case == "pipe":
        engine.train_batch(iter([batch] * 2))
    else:
        loss = torch.nn.functional.mse_loss(engine(batch[0]), batch[1])
        engine.backward(loss)
        engine.step()


step()  # one whole step on both ranks first
if case == "kill_in_save":
    import os
    import signal
    import subprocess

    supervisor = os.getppid()
    if rank == 0:
        def die(*_args, **_kwargs):
            subprocess.Popen(["sh", "-c", f"sleep 60; kill -CONT {supervisor}"], start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            os.kill(supervisor, signal.SIGSTOP)
            os.kill(os.getpid(), signal.SIGKILL)

        torch.save = die  # the first file of the save
    else:
        previous = sys.excepthook

        def wake(*exc):
            previous(*exc)  # the runtime's hook: the announcement, then the traceback
            os.kill(supervisor, signal.SIGCONT)

        sys.excepthook = wake
    engine.save_checkpoint(args[1])
    print("not reached", flush=True)
    sys.exit(0)
if rank == 0:
    raise RuntimeError("rank 0 broke on purpose")
step()  # rank 1 waits in a collective for rank 0
print("not reached", flush=True)
