"""compile: engine.compile() and the config's `compile` section run the module through
torch.compile; a compiled engine trains like the eager one (parity over several steps)."""
import pytest

from dist_harness import run_function


def _train_all():
    return [_train(how) for how in (None, "method", "config")]


def _train(compile_how):
    import torch
    import torch._dynamo

    import dslaunch.runtime as deepspeed
    from dslaunch.runtime.strict import ConfigError

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "gradient_clipping": 1.0}
    if compile_how == "config":
        cfg["compile"] = {"enabled": True, "backend": "aot_eager", "fullgraph": True}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    refused = None
    if compile_how == "method":
        try:
            engine.compile(schedule=[(0, "z3")])
        except ConfigError as exc:
            refused = str(exc)
        engine.compile(backend="aot_eager", compile_kwargs={"dynamic": False})
    torch.manual_seed(1)
    losses = []
    for _ in range(10):
        loss = engine(torch.randn(8, 16)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    graphs = sum(torch._dynamo.utils.counters["stats"].values()) if compile_how else 0
    return losses, engine.is_compiled, graphs, refused, list(engine.module.state_dict())


@pytest.mark.timeout(300)
def test_compiled_engine_matches_eager():
    # aot_eager: dynamo's graph capture and AOTAutograd's joint graph, without inductor's C++ build
    eager, method, config = run_function(_train_all, nprocs=1, timeout=500)[0]
    assert eager[1] is False and method[1] is True and config[1] is True
    assert method[2] > 0 and config[2] > 0  # dynamo really captured graphs
    assert method[3].startswith("engine.compile(schedule=...): DeepCompile schedules are not supported")
    assert eager[4] == method[4] == config[4]  # in-place compile: the same state_dict names
    assert config[0] == pytest.approx(eager[0], rel=1e-6, abs=1e-7)
    assert method[0] == pytest.approx(eager[0], rel=1e-6, abs=1e-7)
