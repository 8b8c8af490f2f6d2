"""DeepSpeed's `pipeline.use_reentrant`: which function checkpoints the layers of a pipeline
with activation_checkpoint_interval > 0. false: deepspeed.checkpointing.non_reentrant_checkpoint;
true: the reentrant deepspeed.checkpointing.checkpoint, whose first segment only gets
gradients when its inputs require grad, so the engine makes the first stage's floating inputs
require grad, as DeepSpeed does. Every setting trains the first layer like plain torch (the
reference, in the same process): without the input marking the reentrant one would leave it
untouched."""
import pytest

from dist_harness import run_function


def _train(use_reentrant):
    import torch

    import dslaunch.runtime as deepspeed
    from dslaunch.runtime.pipe import PipelineModule
    from dslaunch.runtime.train.activation_checkpointing import checkpointing

    def layers():
        torch.manual_seed(0)
        return [torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)]

    reference = torch.nn.Sequential(*layers())
    model = PipelineModule(layers=layers(), num_stages=1, loss_fn=torch.nn.MSELoss(), activation_checkpoint_interval=1)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "gradient_clipping": 0.0, "pipeline": {}}
    if use_reentrant is not None:
        cfg["pipeline"]["use_reentrant"] = use_reentrant
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    torch.manual_seed(1)
    batches = [(torch.randn(2, 4), torch.randn(2, 2)) for _ in range(2)]
    engine.train_batch(iter(batches))
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x, y in batches:
        (torch.nn.functional.mse_loss(reference(x), y) / 2).backward()
    opt.step()
    func = model.activation_checkpoint_func
    name = None if func is None else ("non_reentrant_checkpoint" if func is checkpointing.non_reentrant_checkpoint
                                      else "checkpoint" if func is checkpointing.checkpoint else "other")
    diff = max(float((a - b).abs().max()) for a, b in zip(model.parameters(), reference.parameters()))
    moved = float((model.forward_funcs[0].weight - layers()[0].weight).abs().max())
    try:
        engine.coalesce_grad_reduction()
        refusal = None
    except NotImplementedError as exc:
        refusal = str(exc)
    assert engine.pipeline_parallelism is True, "DeepSpeed's flag on a pipeline engine"
    assert refusal and "not supported under pipeline parallelism" in refusal, refusal
    return name, engine._reentrant_activation_checkpointing(), diff, moved, list(model.is_checkpointable_results)


@pytest.mark.parametrize("use_reentrant,func,reentrant", [(False, "non_reentrant_checkpoint", False),
                                                          (True, "checkpoint", True), (None, None, False)])
def test_each_setting_trains_every_layer_like_torch(use_reentrant, func, reentrant):
    name, is_reentrant, diff, moved, blocks = run_function(_train, nprocs=1, kwargs={"use_reentrant": use_reentrant},
                                                           timeout=120)[0]
    assert (name, is_reentrant) == (func, reentrant)
    assert diff < 1e-6 and moved > 0  # the first layer trained, as in torch
    assert blocks == [True, False, True, True]  # Tanh holds no parameter: not checkpointed


def _refused():
    import torch

    import dslaunch.runtime as deepspeed
    from dslaunch.runtime.pipe import PipelineModule

    model = PipelineModule(layers=[torch.nn.Linear(2, 2)], num_stages=1, loss_fn=torch.nn.MSELoss())
    try:
        deepspeed.initialize(model=model, model_parameters=model.parameters(),
                             config={"train_micro_batch_size_per_gpu": 1, "pipeline": {"use_reentrant": "no"},
                                     "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    except Exception as exc:  # noqa: BLE001 (the refusal is the result)
        return str(exc)


def test_a_value_that_is_no_bool_is_refused_in_one_line():
    msg = run_function(_refused, nprocs=1, timeout=120)[0]
    assert "pipeline.use_reentrant" in msg and "\n" not in msg
