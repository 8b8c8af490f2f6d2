"""zero.Init with parameters that start on the meta device: `torch.nn.utils.skip_init` (and a
model built under `torch.device("meta")`, then `to_empty`) make their real Parameters in
`to_empty`, after the module's __init__. Those are partitioned there, as DeepSpeed's Init does:
each has its `ds_tensor` (ceil(numel / world) elements) and no full copy. Values written
through GatheredParameters(modifier_rank=0) then train exactly as the same values in a model
built without Init (2 ranks, 3 steps, per-step losses compared)."""
import torch

from dist_harness import run_function

CFG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 0.05}},
       "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


class _Net(torch.nn.Module):
    def __init__(self, device=None):
        super().__init__()
        self.a = torch.nn.utils.skip_init(torch.nn.Linear, 6, 5)
        with torch.device("meta") if device is None else torch.device(device):
            self.b = torch.nn.Linear(5, 3)
        if device is None:
            self.b.to_empty(device="cpu")

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))).pow(2).mean()


def _reference_values():
    g = torch.Generator().manual_seed(3)
    return {"a.weight": torch.randn(5, 6, generator=g), "a.bias": torch.randn(5, generator=g),
            "b.weight": torch.randn(3, 5, generator=g), "b.bias": torch.randn(3, generator=g)}


def _train(engine, rank):
    losses = []
    for i in range(3):
        x = torch.randn(2, 6, generator=torch.Generator().manual_seed(10 * i + rank))
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def meta_body():
    import dslaunch.runtime as deepspeed
    import torch.distributed as dist

    rank = dist.get_rank()
    ref = _reference_values()
    with deepspeed.zero.Init(config_dict_or_path=CFG):
        net = _Net()
    out = {"ds_numel": {n: p.ds_tensor.numel() for n, p in net.named_parameters()},
           "held": {n: p.numel() for n, p in net.named_parameters()}}
    with deepspeed.zero.GatheredParameters(list(net.parameters()), modifier_rank=0):
        if rank == 0:
            for n, p in net.named_parameters():
                p.data.copy_(ref[n])
    engine, _, _, _ = deepspeed.initialize(model=net, config=CFG)
    out["losses"] = _train(engine, rank)
    engine.destroy()
    plain = _Net(device="cpu")
    with torch.no_grad():
        for n, p in plain.named_parameters():
            p.copy_(ref[n])
    engine, _, _, _ = deepspeed.initialize(model=plain, config=CFG)
    out["reference"] = _train(engine, rank)
    return out


def test_skip_init_and_meta_parameters_are_partitioned_when_materialised():
    for r in run_function(meta_body, nprocs=2, timeout=180):
        assert r["ds_numel"] == {"a.weight": 15, "a.bias": 3, "b.weight": 8, "b.bias": 2}, r
        assert set(r["held"].values()) == {0}, r  # no rank holds a full copy
        assert r["losses"] == r["reference"], r
