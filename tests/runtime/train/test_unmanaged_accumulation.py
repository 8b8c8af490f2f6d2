"""managed_gradient_accumulation: false (DeepSpeed 0.19's unmanaged mode): the script's step()
is the accumulation boundary. Checked against the managed engine on the same data, which the
differential test compares with DeepSpeed: N backwards then one step equal managed
accumulation over N micro-batches, at ZeRO 0-3, also when N changes from step to step."""
import pytest
import torch

from dist_harness import run_function


def _engine(deepspeed, stage, managed, overlap=None, accumulation=4):
    torch.manual_seed(42)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    zero = {"stage": stage}
    if overlap is not None:
        zero["overlap_comm"] = overlap
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": accumulation, "steps_per_print": 1000,
           "managed_gradient_accumulation": managed, "zero_optimization": zero,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine, model


def _params(deepspeed, engine, model):
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return [p.detach().clone() for p in model.parameters()]


def body(stage):
    import dslaunch.runtime as deepspeed

    rank = torch.distributed.get_rank()
    g = torch.Generator().manual_seed(7 + rank)
    batches = [(torch.randn(1, 4, generator=g), torch.randn(1, 2, generator=g)) for _ in range(12)]

    def loss(engine, i):
        x, y = batches[i]
        return (engine(x) - y).pow(2).mean()

    out = {}
    # fixed window: managed steps every micro-batch, unmanaged steps after 4 backwards
    managed, m_model = _engine(deepspeed, stage, True)
    applied = []
    for i in range(12):
        managed.backward(loss(managed, i))
        managed.step()
        applied.append(managed.was_step_applied())
    out["managed_applied"] = applied
    unmanaged, u_model = _engine(deepspeed, stage, False)
    out["boundary_outside_step"] = unmanaged.is_gradient_accumulation_boundary()
    samples = []
    for cycle in range(3):
        for micro in range(4):
            unmanaged.backward(loss(unmanaged, cycle * 4 + micro))
        unmanaged.step()
        samples.append(unmanaged.global_samples)
    out["fixed_equal"] = all(torch.equal(a, b) for a, b in zip(_params(deepspeed, managed, m_model),
                                                                _params(deepspeed, unmanaged, u_model)))
    out["fixed_samples"] = samples
    out["fixed_steps"] = unmanaged.global_steps
    try:
        unmanaged.set_gradient_accumulation_boundary(True)
        out["set_boundary"] = None
    except AssertionError as exc:
        out["set_boundary"] = str(exc)

    # a varying number of backwards per step, against the managed engine told the same boundaries
    counts = [2, 5, 3]
    unmanaged, u_model = _engine(deepspeed, stage, False)
    managed, m_model = _engine(deepspeed, stage, True)
    i, samples = 0, []
    for n in counts:
        for _ in range(n):
            unmanaged.backward(loss(unmanaged, i) / n, scale_wrt_gas=False)
            i += 1
        unmanaged.step()
        samples.append((unmanaged.global_samples, unmanaged.was_step_applied()))
    i = 0
    for n in counts:
        for micro in range(n):
            managed.set_gradient_accumulation_boundary(micro == n - 1)
            managed.backward(loss(managed, i) / n, scale_wrt_gas=False)
            i += 1
        managed.step()
    out["varying_equal"] = all(torch.equal(a, b) for a, b in zip(_params(deepspeed, managed, m_model),
                                                                  _params(deepspeed, unmanaged, u_model)))
    out["varying_samples"] = samples
    return out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_unmanaged_steps_equal_managed_accumulation(stage):
    for out in run_function(body, nprocs=2, kwargs={"stage": stage}, timeout=240):
        assert out["managed_applied"] == [False, False, False, True] * 3
        assert out["boundary_outside_step"] is False
        assert out["fixed_equal"], "4 backwards + step() differ from managed accumulation over 4 micro-batches"
        # micro-batch 1 x 2 data-parallel ranks per backward
        assert out["fixed_samples"] == [8, 16, 24] and out["fixed_steps"] == 3
        assert "managed_gradient_accumulation=False" in out["set_boundary"]
        assert out["varying_equal"], "2, 5 and 3 backwards per step differ from managed with those boundaries"
        assert out["varying_samples"] == [(4, True), (14, True), (20, True)]


def refusal_body():
    import dslaunch.runtime as deepspeed
    from dslaunch.runtime.strict import ConfigError

    out = {}
    for stage in (0, 1):
        try:
            _engine(deepspeed, stage, False, overlap=True)
            out[stage] = None
        except AssertionError as exc:
            out[stage] = (str(exc), isinstance(exc, ConfigError))
    engine, _ = _engine(deepspeed, 2, False, overlap=True)
    out["stage2_overlap"] = engine.managed_gradient_accumulation()
    engine, _ = _engine(deepspeed, 1, False, overlap=False)
    out["stage1_no_overlap"] = engine.managed_gradient_accumulation()
    engine, _ = _engine(deepspeed, 1, False)
    out["stage1_default"] = engine.managed_gradient_accumulation()
    from dslaunch.runtime.pipe import PipelineModule

    model = PipelineModule(layers=[torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)], num_stages=1,
                           loss_fn=torch.nn.MSELoss())
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
           "managed_gradient_accumulation": False, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    try:
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        out["pipeline"] = None
    except AssertionError as exc:
        out["pipeline"] = str(exc)
    return out


def test_unmanaged_refuses_what_deepspeed_refuses():
    out = run_function(refusal_body, nprocs=1, timeout=120)[0]
    for stage in (0, 1):
        message, is_config_error = out[stage]
        assert "overlap_comm only with ZeRO stage 2" in message and is_config_error
        assert "\n" not in message
    # an overlap_comm the config does not give is no request for overlap: accepted, as DeepSpeed's
    # default (off below stage 3)
    assert out["stage2_overlap"] is False and out["stage1_no_overlap"] is False and out["stage1_default"] is False
    assert "not supported with pipeline parallelism" in out["pipeline"]


def shared_loss_body(stage):
    """One loss over two engines, the backward run by the script on the outputs of
    engine.module(...) and finished by each engine's _backward_epilogue() (DeepSpeed's test of
    several models), against the same loss over the engines' own outputs (loss.backward())."""
    import dslaunch.runtime as deepspeed

    rank = torch.distributed.get_rank()
    g = torch.Generator().manual_seed(3 + rank)
    batches = [(torch.randn(2, 4, generator=g), torch.randn(2, 2, generator=g)) for _ in range(3)]
    result = {}
    for manual in (True, False):
        pair = [_engine(deepspeed, stage, True, accumulation=1) for _ in range(2)]
        engines = [e for e, _ in pair]
        for x, y in batches:
            if manual:
                losses = [(e.module(x) - y).pow(2).mean() for e in engines]
            else:
                losses = [(e(x) - y).pow(2).mean() for e in engines]
            sum(loss / (i + 1) for i, loss in enumerate(losses)).backward()
            if manual:
                for e in engines:
                    e._backward_epilogue()
            for e in engines:
                e.step()
        result[manual] = [_params(deepspeed, e, m) for e, m in pair]
    return all(torch.equal(a, b) for ea, eb in zip(result[True], result[False]) for a, b in zip(ea, eb))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_manual_epilogue_after_a_shared_loss_equals_the_engines_own_backward(stage):
    # one micro-step per step: stage 1 refuses this path with more (below)
    assert run_function(shared_loss_body, nprocs=2, kwargs={"stage": stage}, timeout=240) == [True, True]


def manual_epilogue_refusal_body():
    import dslaunch.runtime as deepspeed

    out = {}
    for stage in (0, 1):
        engine, model = _engine(deepspeed, stage, True)
        x, y = torch.randn(2, 4), torch.randn(2, 2)
        (engine.module(x) - y).pow(2).mean().backward()
        try:
            engine._backward_epilogue()
            out[stage] = None
        except AssertionError as exc:
            out[stage] = str(exc)
    return out


def test_manual_epilogue_is_refused_where_the_hooks_need_the_prologue():
    out = run_function(manual_epilogue_refusal_body, nprocs=1, timeout=120)[0]
    assert "ZeRO stage 0" in out[0] and "engine.backward(loss)" in out[0]
    assert "ZeRO stage 1 with gradient_accumulation_steps > 1" in out[1]
