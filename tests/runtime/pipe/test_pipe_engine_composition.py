"""The pipeline engine holds a DeepSpeedEngine instead of being one, and still answers a
script as DeepSpeed 0.19.8's PipelineEngine (a DeepSpeedEngine subclass there) does:
isinstance(engine, DeepSpeedEngine) holds, the engine's surface (counters, optimizer,
scheduler, config accessors) is the held engine's, with writes landing there, parameters
and state_dict keys read "module.<name>", forward/backward/step/no_sync are refused in one
line, and train()/eval()/zero_grad() act on the module and its gradients.

One rank, a one-stage pipeline: the pipeline's training itself is proven against plain torch
in test_pipe_parity.py and test_pipe_schedules_parity.py.
"""
from dist_harness import run_function

# DeepSpeed 0.19.8's PipelineEngine's own public methods that dslaunch answers (read from
# deepspeed/runtime/pipe/engine.py); the rest of its surface is DeepSpeedEngine's
DS_PIPELINE_METHODS = ("reset_activation_shape", "train_batch", "eval_batch", "is_first_stage", "is_last_stage",
                       "get_pipeline_parallel_rank", "set_dataloader", "set_dataiterator", "set_batch_fn",
                       "is_gradient_accumulation_boundary", "forward", "backward", "step")


def _worker():
    import torch

    import dslaunch.runtime as ds
    from dslaunch.runtime.pipe import PipelineModule
    from dslaunch.runtime.pipe.module import PipelineError
    from dslaunch.runtime.train.engine import DeepSpeedEngine
    from dslaunch.runtime.train.pipe_engine import PipelineEngine

    torch.manual_seed(0)
    net = PipelineModule(layers=[torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)], num_stages=1,
                         loss_fn=torch.nn.MSELoss())
    names = [n for n, _ in net.named_parameters()]
    cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-2,
                                                        "warmup_num_steps": 4}}}
    engine, opt, _, sched = ds.initialize(model=net, config=cfg, model_parameters=net.parameters())
    out = {"is_engine": isinstance(engine, DeepSpeedEngine), "is_pipe": isinstance(engine, PipelineEngine),
           "is_module": isinstance(engine, torch.nn.Module),
           "subclassed": DeepSpeedEngine in type(engine).__mro__,
           "same_optimizer": opt is engine.optimizer, "same_scheduler": sched is engine.lr_scheduler,
           "methods": [m for m in DS_PIPELINE_METHODS if not callable(getattr(engine, m, None))],
           "param_names": [n for n, _ in engine.named_parameters()], "state_keys": list(engine.state_dict()),
           "want_names": ["module." + n for n in names], "module_is_net": engine.module is net}
    refused = {}
    for what, call in (("forward", lambda: engine(torch.zeros(2, 4))), ("backward", lambda: engine.backward(None)),
                       ("step", lambda: engine.step()), ("no_sync", lambda: engine.no_sync())):
        try:
            call()
            refused[what] = None
        except PipelineError as exc:
            refused[what] = str(exc)
    out["refused"] = refused
    data = [(torch.randn(2, 4), torch.randn(2, 1)) for _ in range(4)]
    loss = engine.train_batch(iter(data))
    out["loss_finite"] = bool(torch.isfinite(loss))
    out["counters"] = dict(engine.counters_state())  # read by the held engine's own method
    engine.global_steps = 11  # written through: the held engine's checkpoint counters see it
    out["written"] = engine.counters_state()["global_steps"]
    out["eval_returns_self"] = engine.eval() is engine
    out["module_training_after_eval"] = net.training
    out["train_returns_self"] = engine.train() is engine
    out["module_training_after_train"] = net.training
    net(torch.randn(2, 4)).sum().backward()
    engine.zero_grad()
    out["grads_after_zero"] = [p.grad is None or not bool(p.grad.any()) for p in net.parameters()]
    out["in_dir"] = "get_lr" in dir(engine) and "train_batch" in dir(engine)
    return out


def test_pipeline_engine_holds_an_engine_and_answers_as_deepspeeds_subclass():
    r = run_function(_worker, nprocs=1, timeout=240)[0]
    assert r["is_engine"] and r["is_pipe"] and r["is_module"]
    assert not r["subclassed"]  # composition: DeepSpeedEngine counts it by registration
    assert r["same_optimizer"] and r["same_scheduler"]
    assert r["methods"] == []
    assert r["param_names"] == r["want_names"] and r["state_keys"] == r["want_names"] and r["module_is_net"]
    for what, message in r["refused"].items():
        assert message is not None and message.startswith("pipeline: ") and "\n" not in message, what
        assert "train_batch()" in message, what
    assert r["loss_finite"]
    assert r["counters"]["global_steps"] == 1 and r["counters"]["micro_steps"] == 2
    assert r["written"] == 11
    assert r["eval_returns_self"] and r["module_training_after_eval"] is False
    assert r["train_returns_self"] and r["module_training_after_train"] is True
    assert all(r["grads_after_zero"])
    assert r["in_dir"]
