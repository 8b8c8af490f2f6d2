"""An engine with no optimizer (no "optimizer" section, no initialize(optimizer=)), as
DeepSpeed 0.19.8 allows at ZeRO stages 0 and 3: forward and evaluation give the plain
module's outputs; backward and step are refused in one line with DeepSpeed's error type
(AssertionError); stages 1-2 refuse it at initialize, as DeepSpeed asserts "zero stage N
requires an optimizer". Checkpoints are refused in one line (their files carry the weights
with the optimizer's state); save_16bit_model writes the weights."""
import pytest
import torch

from dist_harness import run_function


def body(root):
    import os

    import torch

    import dslaunch.runtime as deepspeed

    out = {}
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(2))
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        want = model(x).detach()
        want_state = {k: v.clone() for k, v in model.state_dict().items()}
        cfg = {"train_micro_batch_size_per_gpu": 3, "zero_optimization": {"stage": stage}}
        if stage == 3:
            cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
        try:
            engine, opt, _, sched = deepspeed.initialize(model=model, config=cfg)
        except AssertionError as exc:
            out[stage] = {"init": f"{type(exc).__name__}: {exc}"}
            continue
        r = {"optimizer": opt, "scheduler": sched, "forward": torch.equal(engine(x).detach(), want)}
        engine.eval()
        with torch.no_grad():
            r["eval"] = torch.equal(engine(x), want)
        engine.train()
        loss = engine(x).sum()
        for what, call in (("backward", lambda: engine.backward(loss)), ("step", engine.step),
                           ("save", lambda: engine.save_checkpoint(os.path.join(root, str(stage))))):
            try:
                call()
                r[what] = None
            except (AssertionError, deepspeed.CheckpointError) as exc:
                r[what] = f"{type(exc).__name__}: {exc}"
        engine.save_16bit_model(os.path.join(root, f"w{stage}"), "model.pt")
        saved = torch.load(os.path.join(root, f"w{stage}", "model.pt"))
        r["weights"] = sorted(saved) == sorted(want_state) and all(torch.equal(saved[k], v) for k, v in want_state.items())
        out[stage] = r
    return out

def test_forward_only_engine(tmp_path):
    out = run_function(body, nprocs=1, kwargs={"root": str(tmp_path)}, timeout=240)[0]
    for stage in (1, 2):
        assert out[stage] == {"init": f"OptimizerRequiredError: optimizer: none given, and ZeRO stage {stage} requires "
                                      "an optimizer; add an \"optimizer\" section to the config or pass optimizer="}
    for stage in (0, 3):
        r = out[stage]
        assert r["optimizer"] is None and r["scheduler"] is None
        assert r["forward"] and r["eval"], stage
        for what in ("backward", "step"):
            assert r[what] == ("OptimizerRequiredError: optimizer: none given (no \"optimizer\" section, no "
                               f"initialize(optimizer=)), so this engine runs forward only; {what}() needs one"), stage
        assert r["save"].startswith("CheckpointError: save_checkpoint: this engine has no optimizer (forward only)")
        assert r["weights"], stage


def test_initialize_without_a_model_is_one_line_and_an_assertion_error():
    # DeepSpeed asserts here (its TestNoModel catches AssertionError), before any process group
    import dslaunch.runtime as deepspeed
    from dslaunch.runtime.core.errors import ModelRequiredError

    config = {"train_batch_size": 1}
    with pytest.raises(AssertionError, match=r"^initialize: model= is required$") as err:
        deepspeed.initialize(model=None, config=config)
    assert isinstance(err.value, ModelRequiredError) and isinstance(err.value, ValueError)
    # the model in args' place, as `initialize(model, config=...)` puts it
    with pytest.raises(AssertionError, match=r"a model was passed as the first argument, which is args"):
        deepspeed.initialize(torch.nn.Linear(2, 2), config=config)
