"""DeepSpeed's stage-3 pattern for reading the optimizer state of this rank's partition:
`engine.optimizer._set_fp32_optimizer_param_groups(); engine.optimizer.optimizer.state_dict();
engine.optimizer._clear_fp32_optimizer_param_groups()` (its universal-checkpoint tests and
Megatron-style tools do this). Here the groups always hold the fp32 partitions, so the calls
change nothing, and the state they bracket is the partition laid out as DeepSpeed's: each
parameter's ceil(numel / world) slice, in order. Checked against the whole per-parameter
state (safe_get_full_optimizer_state)."""
from dist_harness import run_function


def _partition_state():
    import math

    import torch

    import dslaunch.runtime as deepspeed
    from dslaunch.runtime.zero.fragments import safe_get_full_optimizer_state

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 1))
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 3}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    torch.manual_seed(1 + torch.distributed.get_rank())
    for _ in range(2):
        engine.backward(engine(torch.randn(2, 5)).pow(2).mean())
        engine.step()
    engine.optimizer._set_fp32_optimizer_param_groups()
    sd = engine.optimizer.optimizer.state_dict()
    engine.optimizer._clear_fp32_optimizer_param_groups()
    flat = sd["state"][0]["exp_avg"]
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    mismatches, off = 0, 0
    for p in model.parameters():
        full = safe_get_full_optimizer_state(p, "exp_avg").reshape(-1)
        chunk = math.ceil(full.numel() / world)
        mine = full[rank * chunk:(rank + 1) * chunk]
        mismatches += int(not torch.equal(flat[off:off + mine.numel()], mine))
        off += chunk
    shapes = [{n: tuple(s) for n, s in group.items()} for group in engine._get_zero_param_shapes()]
    return len(sd["param_groups"][0]["params"]), flat.numel(), off, mismatches, shapes


def test_the_bracketed_state_is_this_ranks_partition_in_deepspeeds_layout():
    for groups, numel, expected, mismatches, shapes in run_function(_partition_state, nprocs=2, timeout=180):
        assert groups == 1 and numel == expected and mismatches == 0
        # the layout's parameter shapes, in the partition's order (what a checkpoint's param_shapes holds)
        assert shapes == [{"0.weight": (3, 5), "0.bias": (3,), "1.weight": (1, 3), "1.bias": (1,)}]


def _shapes_at(stage, sub_group_size=None):
    import torch

    import dslaunch.runtime as deepspeed

    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 1))
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": stage}}
    if sub_group_size is not None:
        cfg["zero_optimization"]["sub_group_size"] = sub_group_size
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    try:
        return [{n: tuple(s) for n, s in group.items()} for group in engine._get_zero_param_shapes()]
    except Exception as exc:  # noqa: BLE001 (stage 0's refusal is the result)
        return str(exc)


def test_the_zero_param_shapes_at_stages_0_to_2():
    want = [{"0.weight": (3, 5), "0.bias": (3,), "1.weight": (1, 3), "1.bias": (1,)}]
    assert run_function(_shapes_at, nprocs=2, kwargs={"stage": 2}, timeout=120)[0] == want
    assert run_function(_shapes_at, nprocs=2, kwargs={"stage": 1}, timeout=120)[0] == want
    assert "ZeRO stage 0 partitions nothing" in run_function(_shapes_at, nprocs=1, kwargs={"stage": 0}, timeout=120)[0]


def test_the_zero3_param_shapes_split_per_sub_group():
    # DeepSpeed closes a sub-group once its partitions (ceil(numel / 2) each here: 8, 2, 2, 1)
    # reach sub_group_size, and at the group's last parameter; `want` is what DeepSpeed 0.19.8's
    # engine._get_zero_param_shapes() returned for this model and config on 2 CPU ranks
    got = run_function(_shapes_at, nprocs=2, kwargs={"stage": 3, "sub_group_size": 3}, timeout=120)
    want = [{"0.weight": (3, 5)}, {"0.bias": (3,), "1.weight": (1, 3)}, {"1.bias": (1,)}]
    assert got[0] == got[1] == want


def _sub_groups():
    import torch

    import dslaunch.runtime as deepspeed
    from dslaunch.runtime.zero.fragments import safe_get_local_fp32_param

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 1))
    groups = [{"params": [model[0].weight, model[1].weight]}, {"params": [model[0].bias, model[1].bias],
                                                                 "weight_decay": 0.0}]
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": 4}}
    listed = [[id(p) for p in g["params"]] for g in groups]  # torch's optimizer takes these dicts over
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)
    torch.manual_seed(1 + torch.distributed.get_rank())
    for _ in range(3):
        engine.backward(engine(torch.randn(2, 5)).pow(2).mean())
        engine.step()
    out = {"members": [[id(p) for p in g] for g in optimizer.fp16_groups] == listed,
           "steps": [int(optimizer.optimizer.state[flat]["step"]) for flat in optimizer.fp32_partitioned_groups_flat],
           "global_steps": engine.global_steps}
    # each sub-group's flat partition is its parameters' local fp32 slices, in order
    out["flat_is_slices"] = all(
        torch.equal(flat, torch.cat([safe_get_local_fp32_param(p) for p in members]))
        for flat, members in zip(optimizer.fp32_partitioned_groups_flat, optimizer.fp16_groups))
    return out


def test_the_zero3_sub_groups_name_the_parameters_and_the_flat_partition_that_keys_the_state():
    # DeepSpeed's TestZeroAdamOptimizerStepCount pattern: optimizer.fp16_groups[i]'s flat fp32
    # partition is optimizer.fp32_partitioned_groups_flat[i], the key of its Adam state
    for r in run_function(_sub_groups, nprocs=2, timeout=120):
        assert r["members"] and r["flat_is_slices"], r
        assert r["steps"] == [r["global_steps"]] * 2 and r["global_steps"] == 3, r
