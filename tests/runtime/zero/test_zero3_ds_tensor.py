"""DeepSpeed's per-parameter ZeRO-3 attributes `ds_tensor` (this rank's partition) and `ds_persist`
(kept whole throughout), read through the public interface on two ranks and checked against a
one-process reference: the partition is the slice DeepSpeed's layout gives of the full flat
parameter (ceil(numel / world) elements per rank, the last rank's tail zero padding)."""
import math


def _build(seed: int):
    import torch

    torch.manual_seed(seed)
    # weight: 15 elements, so 8 per rank with one element of padding on rank 1; bias: 3, persistent
    return torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))


def _expected_slice(full, rank: int, world: int):
    import torch

    chunk = math.ceil(full.numel() / world)
    flat = full.detach().reshape(-1).float()
    out = torch.zeros(chunk)
    piece = flat[rank * chunk:(rank + 1) * chunk]
    out[:piece.numel()] = piece
    return out


def _ds_tensor_run(bf16: bool):
    import torch

    import dslaunch.runtime as deepspeed
    from dslaunch.runtime.core import comm

    rank, world = comm.get_rank(), comm.get_world_size()
    reference = {n: p.detach().clone() for n, p in _build(0).named_parameters()}  # one process, no ZeRO
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 3}}
    if bf16:
        config["bf16"] = {"enabled": True}
    engine, _, _, _ = deepspeed.initialize(model=_build(0), config=config)
    params = dict(engine.module.named_parameters())
    dtype = torch.bfloat16 if bf16 else torch.float32
    seen = {"persist": {n: p.ds_persist for n, p in params.items()},
            "sizes": {n: (p.ds_tensor.numel(), p.ds_tensor.ds_numel, p.ds_tensor.dtype == dtype)
                      for n, p in params.items()}}
    # at the start: the reference's slice (in the compute dtype)
    seen["initial"] = all(torch.equal(p.ds_tensor.float(), _expected_slice(reference[n].to(dtype), rank, world))
                          for n, p in params.items() if not p.ds_persist)
    torch.manual_seed(1 + rank)
    x, y = torch.randn(2, 5, dtype=dtype), torch.randint(0, 2, (2,))
    loss = torch.nn.functional.cross_entropy(engine(x).float(), y)
    engine.backward(loss)
    engine.step()
    # after the step: still the slice of the (now updated) full parameter, and it did change
    with deepspeed.zero.GatheredParameters(list(params.values())):
        full = {n: p.detach().clone() for n, p in params.items()}
    seen["after step"] = all(torch.equal(p.ds_tensor.float(), _expected_slice(full[n], rank, world))
                             for n, p in params.items() if not p.ds_persist)
    seen["changed"] = not torch.equal(full["0.weight"].float(), reference["0.weight"].to(dtype).float())
    # DeepSpeed's tests write a partition through ds_tensor.data: what the next gather sees
    w = params["0.weight"]
    w.ds_tensor.data = torch.full_like(w.ds_tensor.data, float(rank + 1))
    with deepspeed.zero.GatheredParameters([w]):
        seen["written"] = w.detach().reshape(-1).float().tolist()
    return seen


def _check(results, world: int = 2):
    for rank, seen in enumerate(results):
        # numel <= stage3_param_persistence_threshold stays whole, as DeepSpeed's ds_persist says
        assert seen["persist"] == {"0.weight": False, "0.bias": True, "2.weight": False, "2.bias": True}
        assert seen["sizes"]["0.weight"][:2] == (8, 8) and seen["sizes"]["2.weight"][:2] == (3, 3)
        assert all(same_dtype for _, _, same_dtype in seen["sizes"].values())
        assert seen["initial"] and seen["after step"] and seen["changed"], seen
        assert seen["written"] == [1.0] * 8 + [2.0] * 7


def test_ds_tensor_is_this_ranks_partition_fp32():
    """fp32: the shard is the master partition itself; ds_tensor follows every step."""
    from dist_harness import run_function

    _check(run_function(_ds_tensor_run, nprocs=2, kwargs={"bf16": False}, timeout=180))


def test_ds_tensor_is_this_ranks_partition_bf16():
    """bf16 with fp32 masters: ds_tensor is the bf16 shard the step refreshes."""
    from dist_harness import run_function

    _check(run_function(_ds_tensor_run, nprocs=2, kwargs={"bf16": True}, timeout=180))
