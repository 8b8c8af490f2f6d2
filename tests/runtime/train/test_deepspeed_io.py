"""DeepSpeed's engine.deepspeed_io: the loader initialize(training_data=...) returns is built by
it (a script that wraps the method sees that call, as under DeepSpeed), and a script's own
call gives each data-parallel rank its share: shuffled on the train route, in order on eval,
or through the script's sampler. The reference is a torch DataLoader over torch's
DistributedSampler, which is what DeepSpeed's loader iterates."""
import torch
from torch.utils.data import DataLoader, DistributedSampler, SequentialSampler, TensorDataset

from dist_harness import run_function


def _dataset():
    return TensorDataset(torch.arange(10, dtype=torch.float32).view(10, 1), torch.arange(10))


def _reference(dataset, rank, world, batch, shuffle):
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=shuffle)
    return [b[1].tolist() for b in DataLoader(dataset, batch_size=batch, sampler=sampler)]


def io_body():
    import dslaunch.runtime as deepspeed
    from dslaunch.runtime.train.engine import DeepSpeedEngine

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    data = _dataset()
    seen = []
    original = DeepSpeedEngine.deepspeed_io

    def wrapped(*args, **kwargs):  # DeepSpeed's unit tests wrap it this way (no_child_process_in_deepspeed_io)
        kwargs["num_local_io_workers"] = 0
        seen.append(kwargs)
        return original(*args, **kwargs)

    DeepSpeedEngine.deepspeed_io = wrapped
    try:
        model = torch.nn.Linear(1, 1)
        engine, _, loader, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), training_data=data,
            collate_fn=lambda items: torch.stack([i for _, i in items]),
            config={"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
                    "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    finally:
        DeepSpeedEngine.deepspeed_io = original
    out = {"wrapped_calls": len(seen), "train": [b.tolist() for b in loader],
           "train_reference": _reference(data, rank, world, 2, True)}
    out["eval"] = [b.tolist() for b in engine.deepspeed_io(data, route="eval")]
    out["eval_reference"] = _reference(data, rank, world, 2, False)
    own = engine.deepspeed_io(data, batch_size=3, data_sampler=SequentialSampler(data), collate_fn=None)
    out["own_sampler"] = [b.tolist() for b in own]
    plain = engine.deepspeed_io(data, batch_size=4, route="predict", collate_fn=lambda items: [i for _, i in items])
    out["batch_size"] = [len(b) for b in plain]
    errors = []
    for call in (lambda: engine.deepspeed_io([1, 2, 3]), lambda: engine.deepspeed_io(data, route="bogus")):
        try:
            call()
        except ValueError as exc:
            errors.append(str(exc))
    out["errors"] = errors
    return out


def test_deepspeed_io_equals_torchs_distributed_loader_and_initialize_goes_through_it():
    results = run_function(io_body, nprocs=2, timeout=120)
    for rank, out in enumerate(results):
        assert out["wrapped_calls"] == 1, rank
        assert out["train"] == out["train_reference"], rank
        assert out["eval"] == out["eval_reference"] == [list(range(10))[rank::2][i:i + 2] for i in (0, 2, 4)], rank
        assert out["own_sampler"] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]], rank
        assert out["batch_size"] == [4, 1], rank
        assert len(out["errors"]) == 2 and all("\n" not in e for e in out["errors"]), out["errors"]
        assert "must be a torch Dataset, got list" in out["errors"][0]
        assert "route 'bogus'" in out["errors"][1]
