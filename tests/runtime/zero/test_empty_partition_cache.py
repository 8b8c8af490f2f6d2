"""engine.empty_partition_cache(), DeepSpeed's call between phases: at ZeRO-3 a forward
in grad mode with no backward after it leaves a small model's parameters gathered for a
backward that never comes; the call frees every full copy, the persistent ones too (the
biases here, as DeepSpeed's TestZeroPartitionCache expects), and training goes on as if it had
not been made: the next forward gathers them again. At stages 0-2 parameters are never split, so
it changes nothing."""
from dist_harness import run_function


def _count_whole(model):
    """How many parameters hold their full data here (one never split by ZeRO counts as whole)."""
    return sum(p.data.numel() == p.ds_numel if hasattr(p, "ds_numel") else True for p in model.parameters())


def _run(stage, evaluate):
    import torch

    import dslaunch.runtime as deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)])
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 16}}  # biases persist
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    torch.manual_seed(1 + torch.distributed.get_rank())
    batches = [torch.randn(2, 16) for _ in range(4)]
    losses, whole = [], []
    for step, x in enumerate(batches):
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
        if evaluate and step == 1:
            engine(batches[0])  # a forward whose backward never runs (grad mode on)
            whole.append(_count_whole(model))
            engine.empty_partition_cache()
            whole.append(_count_whole(model))
    return losses, whole


def _all():
    return {(stage, ev): _run(stage, ev) for stage in (2, 3) for ev in (False, True)}


def test_empty_partition_cache_frees_gathered_params_and_changes_no_number():
    out = run_function(_all, nprocs=2, timeout=240)[0]
    for stage in (2, 3):
        assert out[(stage, True)][0] == out[(stage, False)][0]  # the same training either way
    # ZeRO-3: all 6 parameters whole after the evaluation forward, none after the call (not even
    # the 3 persistent biases)
    assert out[(3, True)][1] == [6, 0]
    # ZeRO-2 never splits a parameter: nothing to free
    assert out[(2, True)][1] == [6, 6]


def _forward_only():
    import torch

    import dslaunch.runtime as deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)])
    cfg = {"train_micro_batch_size_per_gpu": 2,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 16}}
    engine, _, _, _ = deepspeed.initialize(model=model, config=cfg)  # no optimizer: forward only
    whole = []
    for _ in range(3):
        engine(torch.randn(2, 16)).sum()  # grad mode on, as DeepSpeed's TestZeroPartitionCache[False]
        whole.append(_count_whole(model))
    engine.empty_partition_cache()
    whole.append(_count_whole(model))
    return whole


def test_an_engine_without_optimizer_releases_after_each_forward():
    """No backward can follow (engine.backward needs an optimizer), so a grad-mode forward
    keeps nothing gathered for one: only the 3 persistent biases stay whole, as in DeepSpeed,
    until empty_partition_cache frees them too."""
    assert run_function(_forward_only, nprocs=2, timeout=120)[0] == [3, 3, 3, 0]


def _as_found(tmp):
    import torch

    import dslaunch.runtime as deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)])
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 16}}  # biases persist
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    counts = [_count_whole(model)]
    engine.empty_partition_cache()
    engine.save_checkpoint(tmp, tag="t")
    counts.append(_count_whole(model))
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        counts.append(_count_whole(model))
    counts.append(_count_whole(model))
    loss = engine(torch.randn(2, 16)).pow(2).mean()  # the next forward makes the persistent ones whole again
    engine.backward(loss)
    engine.step()
    counts.append(_count_whole(model))
    return counts


def test_save_and_gathered_parameters_leave_freed_persistent_params_freed(tmp_path):
    """After empty_partition_cache, a checkpoint save and a GatheredParameters block gather every
    parameter and free them all again, persistent ones too, as DeepSpeed leaves them (its save does
    not gather). Before, both left the persistent biases whole, so DeepSpeed's checkpoint tests
    compared a whole saved model with an empty loaded one (TestZeROCheckpoint at stage 3)."""
    out = run_function(_as_found, nprocs=2, timeout=180, kwargs={"tmp": str(tmp_path)})[0]
    assert out == [3, 0, 6, 0, 3]
