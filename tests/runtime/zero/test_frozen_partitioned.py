"""ZeRO-3 partitions frozen parameters as DeepSpeed 0.19.8 does: by size alone (at most
stage3_param_persistence_threshold elements stays whole), gathered around their module's
forward and backward, released when their module's backward is done.

Before, a frozen parameter given to initialize without zero.Init was kept whole on every rank,
and one built under zero.Init stayed gathered from the second micro-step on (the end of the
backward released only the optimizer's parameters). Measured with real DeepSpeed 0.19.8 on a
frozen 512x512 base, 2 ranks: 0 elements of the frozen weight resident after a step, a
131072-element shard; here 262144 resident before. On this test's model (torch's Adam passed
in, both construction paths), DeepSpeed gives the same six losses to 7 digits, the same shards,
and the same release of mid1 and mid2 before inp's backward; it differs only in that the
persistent biases are not yet whole after the very first backward.

A frozen layer between trained ones (LoRA's shape) has inputs that need a gradient, so its
backward's end is known: its weight is released then, before the layers below it run their
backward, as DeepSpeed's post-backward hook releases it. A frozen layer none of whose inputs
needs a gradient is released at the end of the backward.

Reference for the losses and weights: the same script at ZeRO stage 0, 2 ranks, same data."""
import pytest
import torch

from dist_harness import run_function

DIM = 16


class Net(torch.nn.Module):
    """trained inp -> frozen mid1 -> frozen mid2 -> trained head; a frozen side branch on the raw
    input (no input of it needs a gradient)."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(DIM, DIM)
        self.mid1 = torch.nn.Linear(DIM, DIM)
        self.mid2 = torch.nn.Linear(DIM, DIM)
        self.side = torch.nn.Linear(DIM, DIM)
        self.head = torch.nn.Linear(DIM, DIM)
        for m in (self.mid1, self.mid2, self.side):
            m.requires_grad_(False)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.mid2(torch.tanh(self.mid1(h))))
        return self.head(h + self.side(x)).pow(2).mean()


FROZEN = ("mid1", "mid2", "side")


def train_body(stage: int, init: bool):
    import torch.distributed as dist

    import dslaunch.runtime as deepspeed
    from dslaunch.runtime.utils import safe_get_full_fp32_param
    from dslaunch.runtime.zero import GatheredParameters, ZeroParamStatus

    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": DIM}}
    torch.manual_seed(0)
    if init:
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            net = Net()
    else:
        net = Net()
    trained = [p for p in net.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=trained, config=cfg)
    frozen = {f"{n}.{k}": p for n in FROZEN for k, p in getattr(net, n).named_parameters()}

    def whole(p):
        return p.ds_status != ZeroParamStatus.NOT_AVAILABLE or p.data.numel() != 0

    seen = {"during_backward": []}
    if stage == 3:
        # runs once the gradient of inp's output is computed: mid1's and mid2's backward are done
        net.inp.register_full_backward_pre_hook(
            lambda m, g: seen["during_backward"].append(sorted(n for n in ("mid1.weight", "mid2.weight")
                                                               if whole(frozen[n]))))
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    losses, resident = [], []
    for _ in range(6):
        loss = engine(torch.randn(2, DIM, generator=g))
        engine.backward(loss)
        if stage == 3:
            resident.append(sorted(n for n, p in frozen.items() if whole(p)))
        engine.step()
        losses.append(loss.item())
    out = {"losses": losses,
           "weights": {n: safe_get_full_fp32_param(p).clone() for n, p in trained_named(net)}}
    if stage == 3:
        out["resident_after_backward"] = resident
        out["during_backward"] = seen["during_backward"]
        out["shards"] = {n: p.ds_tensor.numel() for n, p in frozen.items()}
        with GatheredParameters(list(frozen.values())):
            out["frozen"] = {n: p.detach().clone() for n, p in frozen.items()}
    else:
        out["frozen"] = {n: p.detach().clone() for n, p in frozen.items()}
    engine.destroy()
    return out


def trained_named(net):
    return [(n, p) for n, p in net.named_parameters() if p.requires_grad]


@pytest.mark.parametrize("init", [False, True], ids=["plain", "zero_init"])
def test_frozen_parameters_are_partitioned_and_released_as_deepspeed_does(init):
    want = run_function(train_body, nprocs=2, kwargs={"stage": 0, "init": False}, timeout=240)
    got = run_function(train_body, nprocs=2, kwargs={"stage": 3, "init": init}, timeout=240)
    for w, o in zip(want, got):
        assert o["losses"] == pytest.approx(w["losses"], rel=1e-6, abs=1e-7)
        for name in w["weights"]:
            torch.testing.assert_close(o["weights"][name], w["weights"][name], rtol=1e-5, atol=1e-6)
        for name in w["frozen"]:  # never stepped, gathered whole from the shards
            torch.testing.assert_close(o["frozen"][name], w["frozen"][name], rtol=0, atol=0)
        # every parameter has its half as shard (ds_tensor); the biases (16 elements, at the
        # threshold) are persistent: whole as well, after every backward the only ones whole
        assert o["shards"] == {"mid1.weight": 128, "mid1.bias": 8, "mid2.weight": 128, "mid2.bias": 8,
                               "side.weight": 128, "side.bias": 8}
        assert o["resident_after_backward"] == [["mid1.bias", "mid2.bias", "side.bias"]] * 6
        # mid1 and mid2 were released as their backward ended, before inp's began
        assert o["during_backward"] == [[]] * 6
