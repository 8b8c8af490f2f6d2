"""The precision workloads both sides run: scripts/make_ds_precision_fixtures.py under real
DeepSpeed 0.19.8 and tests/runtime/train/test_precision_vs_deepspeed.py under dslaunch.

`zero_init_buffers` (one process): the dtypes of the buffers of a model built inside
zero.Init under a bf16 config, after Init and after initialize, and of one partitioned by
Init(module=...).

`train` (the fp16/bf16 module cast, one process): a Linear with a rotary-style fp32 buffer `inv_freq` the forward multiplies in, a `route_bias`
buffer its class names for fp32 the way a transformers model does
(`_keep_in_fp32_modules_strict`), and an integer `count` buffer. Trained a few steps (one
process, SGD) under each config case; `train` returns the losses and every buffer's and
parameter's dtype after initialize.
"""
STEPS = 3
HIDDEN = 8

# name: (precision section, data_types, ZeRO stage)
CASES = {
    "bf16_default_z0": ({"bf16": {"enabled": True}}, {}, 0),
    "bf16_default_z3": ({"bf16": {"enabled": True}}, {}, 3),
    "bf16_buffer_bf16_z0": ({"bf16": {"enabled": True}}, {"buffer_dtype": "bf16"}, 0),
    "bf16_buffer_bf16_z2": ({"bf16": {"enabled": True}}, {"buffer_dtype": "bf16", "param_dtype": "bf16"}, 2),
    "bf16_keep_none_z0": ({"bf16": {"enabled": True}}, {"buffer_dtype": "bf16", "keep_in_fp32_modules": []}, 0),
    "bf16_keep_list_z0": ({"bf16": {"enabled": True}}, {"buffer_dtype": "bf16", "keep_in_fp32_modules": ["inv_*"]},
                          0),
    "fp16_default_z1": ({"fp16": {"enabled": True, "loss_scale": 128}}, {}, 1),
}


def make_net():
    import torch

    class Net(torch.nn.Module):
        _keep_in_fp32_modules_strict = ["route_bias"]

        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(HIDDEN, HIDDEN)
            # 1/10000^(i/d), as a rotary embedding's: its low digits are lost in bf16
            inv = 1.0 / (10000 ** (torch.arange(HIDDEN, dtype=torch.float32) / HIDDEN)) + 1.0
            self.register_buffer("inv_freq", inv)
            # arrives in bf16 (as from a checkpoint): the class asks for fp32
            self.register_buffer("route_bias", (torch.arange(HIDDEN, dtype=torch.float32) / 3 + 5).bfloat16())
            self.register_buffer("count", torch.zeros((), dtype=torch.long))

        def forward(self, x, y):
            h = self.linear(x.to(self.linear.weight.dtype))
            h = h.float() * self.inv_freq.float() + self.route_bias.float()
            return torch.nn.functional.mse_loss(h, y)

    torch.manual_seed(7)
    return Net()


def batch(step):
    import torch

    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(4, HIDDEN, generator=g), torch.randn(4, HIDDEN, generator=g)


def train(ds, name):
    """(losses, {tensor name: dtype}) of case `name`."""
    import torch

    precision, data_types, stage = CASES[name]
    net = make_net()
    cfg = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000, "zero_optimization": {"stage": stage},
           "zero_allow_untested_optimizer": True,
           "data_types": data_types, **precision}
    engine, _, _, _ = ds.initialize(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1), config=cfg)
    from engine_steps import train_steps

    dtypes = {n: str(t.dtype) for n, t in list(engine.module.named_buffers()) + list(engine.module.named_parameters())}
    return train_steps(engine, batch, STEPS), dtypes


# name: (bf16 section, gradient_accumulation_steps); ZeRO 1, grad_accum_dtype fp32, Adam
ACCUM_CASES = {
    "igu_unset_gas3": ({"enabled": True}, 3),
    "igu_false_gas3": ({"enabled": True, "immediate_grad_update": False}, 3),
    "igu_true_gas3": ({"enabled": True, "immediate_grad_update": True}, 3),
    "igu_true_gas1": ({"enabled": True, "immediate_grad_update": True}, 1),
}


def train_accumulation(ds, name, rank):
    """Losses of case `name` on this rank: bf16 gradients summed in fp32 over micro-batches
    (DeepSpeed's bf16 optimizer at ZeRO 1), each rank its own data."""
    import torch

    bf16, gas = ACCUM_CASES[name]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "steps_per_print": 1000,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": 1},
           "bf16": bf16, "data_types": {"grad_accum_dtype": "fp32"}}
    engine, _, _, _ = ds.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    g = torch.Generator().manual_seed(1 + rank)
    losses = []
    for _ in range(3 * gas):
        x, y = torch.randn(2, 16, generator=g).bfloat16(), torch.randn(2, 4, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


ZERO_INIT_CASES = {"bf16": {}, "bf16_buffer_fp32": {"buffer_dtype": "fp32"}}


def zero_init_buffers(ds):
    """{case: [buffer dtypes after Init, after initialize, built outside and Init(module=)]}."""
    import torch

    class Net(torch.nn.Module):
        _keep_in_fp32_modules_strict = ["keep"]

        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.register_buffer("inv", torch.ones(4))
            self.register_buffer("keep", torch.ones(4))
            self.register_buffer("later", torch.ones(4))

    def dtypes(module):
        return {n: str(b.dtype) for n, b in module.named_buffers()}

    out = {}
    for name, data_types in ZERO_INIT_CASES.items():
        cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
               "zero_allow_untested_optimizer": True, "bf16": {"enabled": True}, "data_types": data_types}
        with ds.zero.Init(config_dict_or_path=cfg):
            net = Net()
        after_init = dtypes(net)
        net.later.data = net.later.data.float()  # set by the script after Init: the engine keeps it
        engine, _, _, _ = ds.initialize(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1), config=cfg)
        outside = Net()
        ds.zero.Init(module=outside, config_dict_or_path=cfg)
        engine2, _, _, _ = ds.initialize(model=outside, optimizer=torch.optim.SGD(outside.parameters(), lr=0.1),
                                         config=cfg)
        out[name] = [after_init, dtypes(engine.module), dtypes(engine2.module)]
    return out
