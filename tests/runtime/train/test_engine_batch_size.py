"""DeepSpeed's set_train_batch_size / set_train_micro_batch_size: the accumulation steps (or the
micro-batch) change from the call on, and training equals an engine configured that way from
the start; the pipeline engine runs the new number of micro-batches per train_batch()."""
import pytest
import torch

from dist_harness import run_function


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _config(accumulation, micro=2):
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accumulation,
            "steps_per_print": 1000, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def engine_body():
    import dslaunch.runtime as deepspeed

    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(2, 4, generator=g), torch.randn(2, 2, generator=g)) for _ in range(12)]

    def train(engine, batches):
        for x, y in batches:
            engine.backward((engine(x) - y).pow(2).mean())
            engine.step()

    out = {}
    model = _model()
    changed, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(2))
    train(changed, data[:4])  # two steps of 2 micro-batches
    changed.set_train_batch_size(8)  # 4 micro-batches of 2 on one rank
    out["sizes"] = (changed.train_batch_size(), changed.gradient_accumulation_steps(),
                    changed.train_micro_batch_size_per_gpu())
    train(changed, data[4:12])
    out["steps"] = changed.global_steps
    model2 = _model()
    reference, _, _, _ = deepspeed.initialize(model=model2, model_parameters=model2.parameters(), config=_config(2))
    train(reference, data[:4])
    model3 = _model()
    fresh, _, _, _ = deepspeed.initialize(model=model3, model_parameters=model3.parameters(), config=_config(4))
    with torch.no_grad():  # start from the weights the first two steps left
        for p, q in zip(model3.parameters(), model2.parameters()):
            p.copy_(q)
    train(fresh, data[4:12])
    out["equal"] = all(torch.equal(p, q) for p, q in zip(model.parameters(), model3.parameters()))
    errors = []
    for bad in (7, 0, 2.0, True):
        try:
            changed.set_train_batch_size(bad)
        except ValueError as exc:
            errors.append(str(exc))
    out["errors"] = errors
    changed.set_train_micro_batch_size(4)
    out["micro"] = (changed.train_batch_size(), changed.gradient_accumulation_steps(),
                    changed.train_micro_batch_size_per_gpu())
    return out


def test_set_train_batch_size_changes_the_accumulation_steps():
    out = run_function(engine_body, nprocs=1, timeout=120)[0]
    assert out["sizes"] == (8, 4, 2)
    assert out["steps"] == 4  # 2 steps of 2 micro-batches, then 2 of 4
    assert out["equal"]
    assert len(out["errors"]) == 4
    assert all(e.startswith("Train batch size must be divisible by micro-batch data parallelism") for e in out["errors"])
    assert out["micro"] == (16, 4, 4)


def pipe_body():
    import dslaunch.runtime as deepspeed
    from dslaunch.runtime.pipe import PipelineModule

    torch.manual_seed(0)
    model = PipelineModule(layers=[torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)], num_stages=2,
                           loss_fn=torch.nn.MSELoss())
    cfg = dict(_config(2), train_batch_size=4)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    g = torch.Generator().manual_seed(5)
    batches = iter([(torch.randn(2, 4, generator=g), torch.randn(2, 2, generator=g)) for _ in range(10)])
    engine.train_batch(batches)
    engine.set_train_batch_size(8)
    loss = engine.train_batch(batches)
    engine.set_has_attention_mask(True)
    return engine.micro_batches, engine.gradient_accumulation_steps(), float(loss), engine.has_attention_mask


def test_pipeline_runs_the_new_number_of_micro_batches():
    runs = run_function(pipe_body, nprocs=2, timeout=180)
    assert [r[:2] for r in runs] == [(4, 4), (4, 4)]
    # 2 + 4 micro-batches consumed from the 10: the loss is finite and the same on both stages
    assert runs[0][2] == runs[1][2] and runs[0][2] == runs[0][2]
    assert runs[0][3] is True
