"""The torch_autocast workload both sides run: scripts/make_ds_autocast_fixtures.py under real
DeepSpeed 0.19.8 and tests/runtime/train/test_torch_autocast_module.py under dslaunch.

A tiny Linear + LayerNorm network (one process, ZeRO 0, SGD) trained a few steps with
`torch_autocast` bf16: its forward records whether autocast is on inside the engine and the
dtype a Linear gives, and `train` returns the losses, those records and each parameter's
reduction dtype as `deepspeed.runtime.torch_autocast.get_comm_dtype` reports it.
"""
STEPS = 3
HIDDEN = 8


def make_net():
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(HIDDEN, HIDDEN)
            self.norm = torch.nn.LayerNorm(HIDDEN)
            self.seen = []

        def forward(self, x, y):
            h = self.linear(x)
            self.seen.append([torch.is_autocast_enabled("cpu"), str(h.dtype)])
            return torch.nn.functional.mse_loss(self.norm(h).float(), y)

    torch.manual_seed(7)
    return Net()


def batch(step):
    import torch

    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(4, HIDDEN, generator=g), torch.randn(4, HIDDEN, generator=g)


def train(ds, torch_autocast, autocast_config):
    """(losses, what the forward saw, {parameter: comm dtype}) under `autocast_config`."""
    import torch

    net = make_net()
    cfg = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000, "torch_autocast": autocast_config}
    engine, _, _, _ = ds.initialize(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1), config=cfg)
    from engine_steps import train_steps

    losses = train_steps(engine, batch, STEPS)
    comm = {name: str(torch_autocast.get_comm_dtype(p)) for name, p in engine.module.named_parameters()}
    return losses, net.seen, comm
