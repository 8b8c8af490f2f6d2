"""PyTorch-style backward (`loss.backward()`, `out.backward(grad)`, `engine.scale(loss).backward()`)
against real DeepSpeed 0.19.8.

Every case of tests/pystyle_workload.py (ZeRO 0-3, 1 and 2 ranks, accumulation 1 and 2,
fp32/bf16/fp16, CPU offload, no_sync, two engines with one loss, a model that returns its
loss and its output) runs here under dslaunch; scripts/make_ds_pystyle_fixtures.py ran the
same script under DeepSpeed and recorded tests/data/ds_pystyle/expected.json. Losses must
equal DeepSpeed's within the dtype's tolerance (TOL: 1e-6 in fp32), and where DeepSpeed
stops, we stop with its error (its message inside ours, its exception type among ours).

Where DeepSpeed's answer is wrong or missing, the case is listed with its reason
(pystyle_workload.DEEPSPEED_DIFFERS) and must give the answer DeepSpeed gives on the path it
gets right:
  - ZeRO stage 0: DeepSpeed refuses PyTorch-style backward ("Direct calls to tensor.backward()
    are not supported ... ZeRO stage 0"); here it trains, with DeepSpeed's ZeRO-1 losses of the
    same case (the same arithmetic: in fp32 DeepSpeed's stage-0 and stage-1 engine.backward
    losses are equal). Its 16-bit stage-0 engine.backward disagrees with its own ZeRO-1 on this
    script from the first update on (in fp16 it leaves the loss unscaled and divides the
    gradients by the loss scale), so those are held to ZeRO-1 as well.
  - A model that returns (loss, output): DeepSpeed hooks both outputs and divides the loss's
    gradient by the accumulation steps at the loss and again at the output (1/gas^2) at ZeRO 1
    and 2; here it is divided once, giving engine.backward's losses.
  - fp16 with a static loss scale: DeepSpeed lets loss.backward() run unscaled and divides the
    gradients by the scale at the step; here it asks for engine.scale(loss) as it does under
    a dynamic scale.
"""
import functools
import json
import os

import pytest

from dist_harness import run_function
import repo_paths

HERE = str(repo_paths.TESTS)
FIXTURE = os.path.join(HERE, "data", "ds_pystyle", "expected.json")
TOL = {"fp32": 1e-6, "bf16": 1e-3, "fp16": 1e-4}  # losses are about 1; bf16 and fp16 keep 8 and 11 bits

import pystyle_workload as W  # noqa: E402  (tests/ is on sys.path under pytest)

STAGE0_REFUSED = "Direct calls to tensor.backward() are not supported"


_twin = W.twin
DIFFERS = W.DEEPSPEED_DIFFERS  # name -> (the case whose DeepSpeed answer this one must give, why)


def _expected():
    with open(FIXTURE) as fh:
        return json.load(fh)


def train_body(names):
    import torch
    import torch.distributed as dist

    import dslaunch.runtime as deepspeed

    torch.set_num_threads(1)
    return {n: W.run_case(deepspeed, W.CASES[n], dist.get_rank(), dist.get_world_size()) for n in names}


@functools.lru_cache(maxsize=None)
def _ours(world: int):
    names = [n for n, c in W.CASES.items() if c["world"] == world]
    return run_function(train_body, nprocs=world, timeout=600, env={"PYTHONPATH": HERE},
                        kwargs=dict(names=names))[0]


def _reference(name: str, ds: dict):
    """DeepSpeed's answer this case must give, and what to say when it does not."""
    if name in DIFFERS:
        twin, why = DIFFERS[name]
        want, source = _reference(twin, ds)
        return want, f"{why}; held to {twin} ({source})"
    got = ds[name]
    if W.CASES[name]["stage"] == 0 and STAGE0_REFUSED in got.get("error", ""):
        twin = _twin(name, stage=1)
        want, source = _reference(twin, ds)
        return want, f"DeepSpeed refuses stage 0; held to {twin} ({source})"
    return got, "DeepSpeed 0.19.8"


def test_fixture_covers_every_case():
    ds = _expected()
    assert ds["deepspeed"] == "0.19.8"
    assert sorted(ds["cases"]) == sorted(W.CASES)


@pytest.mark.parametrize("name", sorted(W.CASES))
def test_case_against_deepspeed(name):
    ds = _expected()["cases"]
    case = W.CASES[name]
    ours = _ours(case["world"])[name]
    want, source = _reference(name, ds)
    if "error" in want:
        assert "error" in ours, (name, source, ours)
        assert want["error"] in ours["error"], (name, source, ours["error"])
        assert want["types"][0] in ours["types"], (name, source, ours["types"])
        return
    assert "losses" in ours, (name, source, ours)
    worst = max(abs(a - b) for a, b in zip(ours["losses"], want["losses"]))
    assert len(ours["losses"]) == len(want["losses"]) and worst <= TOL[case["dtype"]], \
        (name, source, ours["losses"], want["losses"])


@pytest.mark.parametrize("name", sorted(DIFFERS))
def test_deepspeed_differs_where_listed(name):
    """Each listed case is one where DeepSpeed's own answer really differs from the reference."""
    ds = _expected()["cases"]
    twin, _ = DIFFERS[name]
    own, ref = ds[name], ds[twin]
    if "losses" in own and "losses" in ref:
        assert max(abs(a - b) for a, b in zip(own["losses"], ref["losses"])) > 10 * TOL[W.CASES[name]["dtype"]]
    else:
        assert own != ref


def test_pytorch_style_equals_engine_backward_here():
    """On this side every style of a case gives engine.backward's losses exactly (the division
    by 2 at the outputs is exact), at every stage."""
    for world in (1, 2):
        ours = _ours(world)
        for name, case in W.CASES.items():
            if case["world"] != world or case["style"] == "engine" or "losses" not in ours[name]:
                continue
            ref = ours[_twin(name, style="engine")]
            assert ours[name]["losses"] == ref["losses"], name


def test_the_issues_rows_train():
    """The rows that trained silently wrong: ZeRO 1-3 with accumulation on 2 ranks, and ZeRO 2-3
    on 1 rank without accumulation, where nothing trained (every loss the same)."""
    for name in ("w2_s1_fp32_g2_tensor", "w2_s2_fp32_g2_tensor", "w2_s3_fp32_g2_tensor",
                 "w2_s2_fp32_g2_nonscalar", "w1_s2_fp32_g1_tensor", "w1_s3_fp32_g1_tensor"):
        losses = _ours(W.CASES[name]["world"])[name]["losses"]
        assert len(set(losses)) == len(losses), name


# -- in this process: what is refused, and containers of outputs ---------------------------------
def _engine(stage=1, extra=None, model=None):
    import dslaunch.runtime as deepspeed

    model = model or W.make_model()
    cfg = W.config(W._case(1, stage, "fp32", 1, "engine"))
    cfg.update(extra or {})
    return deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=cfg)[0]


def test_scale_refuses_what_is_no_scalar_loss():
    import torch

    engine = _engine()
    x, y = W.batch(0, 0, 1, torch.float32)
    out = engine(x)
    with pytest.raises(AssertionError, match="scalar tensor with grad_fn"):
        engine.scale(out)
    with pytest.raises(AssertionError, match="scalar tensor with grad_fn"):
        engine.scale(W._mse(out, y).detach())
    loss = W._mse(out, y)
    assert engine.scale(loss) is loss  # fp32: nothing to scale


# DeepSpeed 0.19.8's engine.optimizer, one CPU rank, torch 2.13, Adam: (stage, precision) ->
# (its class, isinstance ZeROOptimizer, isinstance DeepSpeedOptimizer, needs_scaler()); at stage
# 0 its FP16_UnfusedOptimizer has no needs_scaler (here it answers as the engine would refuse)
DEEPSPEED_OPTIMIZER_ROLES = {
    (0, "fp32"): ("AdamW", False, False, None), (0, "bf16"): ("FP16_UnfusedOptimizer", False, True, None),
    (0, "fp16"): ("FP16_UnfusedOptimizer", False, True, None),
    (1, "fp32"): ("DeepSpeedZeroOptimizer", True, True, False), (1, "bf16"): ("DeepSpeedZeroOptimizer", True, True, False),
    (1, "fp16"): ("DeepSpeedZeroOptimizer", True, True, True), (2, "fp32"): ("DeepSpeedZeroOptimizer", True, True, False),
    (2, "bf16"): ("DeepSpeedZeroOptimizer", True, True, False), (2, "fp16"): ("DeepSpeedZeroOptimizer", True, True, True),
    (3, "fp32"): ("DeepSpeedZeroOptimizer_Stage3", True, True, False),
    (3, "bf16"): ("DeepSpeedZeroOptimizer_Stage3", True, True, False),
    (3, "fp16"): ("DeepSpeedZeroOptimizer_Stage3", True, True, True),
}


@pytest.mark.parametrize("stage,precision", sorted(DEEPSPEED_OPTIMIZER_ROLES))
def test_optimizer_answers_deepspeeds_base_classes_and_needs_scaler(stage, precision):
    """`isinstance(engine.optimizer, ZeROOptimizer)` and `engine.optimizer.needs_scaler()`, which
    PyTorch-style scripts (and DeepSpeed's tests of them) ask before choosing engine.scale."""
    import torch
    from dslaunch.runtime.base_optimizer import DeepSpeedOptimizer, ZeROOptimizer
    from dslaunch.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    extra = {} if precision == "fp32" else {precision: {"enabled": True}}
    engine = _engine(stage=stage, extra=extra)
    cls, zero, base, needs = DEEPSPEED_OPTIMIZER_ROLES[stage, precision]
    # of DeepSpeed's concrete classes only the stage-3 optimizer answers (its members are here)
    assert isinstance(engine.optimizer, DeepSpeedZeroOptimizer_Stage3) is (cls == "DeepSpeedZeroOptimizer_Stage3")
    assert isinstance(engine.optimizer, ZeROOptimizer) is zero
    assert isinstance(engine.optimizer, DeepSpeedOptimizer) is base
    assert engine.optimizer.needs_scaler() is (precision == "fp16" if needs is None else needs)
    assert not isinstance(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1), ZeROOptimizer)
    with pytest.raises(TypeError, match="ZeROOptimizer is DeepSpeed's internal optimizer wrapper"):
        ZeROOptimizer()


def test_no_sync_is_refused_where_deepspeed_refuses_it():
    import torch

    engine = _engine(stage=1)
    with engine.no_sync():
        with pytest.raises(AssertionError, match="no_sync context manager reentry is unsupported"):
            with engine.no_sync():
                pass
        x, y = W.batch(0, 0, 1, torch.float32)
        W._mse(engine(x), y).backward()
        with pytest.raises(AssertionError, match=r"It is illegal to call Engine.step\(\) inside no_sync"):
            engine.step()
    engine.step()  # outside the block the step reduces and applies what the block accumulated
    assert engine.global_steps == 1


@pytest.mark.parametrize("stage", [0, 1])
def test_safe_get_full_grad_inside_no_sync_is_the_local_sum(stage):
    """DeepSpeed 0.19.8 (2 ranks, measured): inside no_sync, safe_get_full_grad returns
    param.grad as it stands, this rank's unreduced sum of the block's backwards; its
    test_no_sync_ctxt reads it there."""
    import copy

    import torch
    from dslaunch.runtime.zero.fragments import safe_get_full_grad

    model = W.make_model()
    plain = copy.deepcopy(model)
    engine = _engine(stage=stage, model=model)
    batches = [W.batch(0, k, 1, torch.float32) for k in range(2)]
    with engine.no_sync():
        for x, y in batches:
            W._mse(engine(x), y).backward()
            W._mse(plain(x), y).backward()
        for (name, p), q in zip(engine.module.named_parameters(), plain.parameters()):
            got = safe_get_full_grad(p)
            assert got is not None, name
            torch.testing.assert_close(got.float(), q.grad, rtol=1e-6, atol=1e-7)
    engine.step()
    assert engine.global_steps == 1


def test_outputs_in_containers_are_divided_once():
    """A dict output holding the loss and the output it came from, and a namedtuple: each
    gradient the script sends in is divided by gas once (engine.backward's gradients)."""
    import collections

    import torch

    Pair = collections.namedtuple("Pair", "loss out")

    class Net(torch.nn.Module):
        def __init__(self, kind):
            super().__init__()
            self.kind = kind
            self.lin = torch.nn.Linear(6, 4)

        def forward(self, x, y):
            out = self.lin(x)
            loss = W._mse(out, y)
            return {"loss": loss, "out": out} if self.kind == "dict" else Pair(loss, out)

    grads = {}
    for kind in ("dict", "tuple"):
        for style in ("engine", "tensor"):
            torch.manual_seed(0)
            engine = _engine(stage=0, extra={"gradient_accumulation_steps": 2, "train_batch_size": 2 * W.ROWS},
                             model=Net(kind))
            x, y = W.batch(0, 0, 1, torch.float32)
            res = engine(x, y)
            loss = res["loss"] if kind == "dict" else res.loss
            assert isinstance(res, dict if kind == "dict" else Pair)
            engine.backward(loss) if style == "engine" else loss.backward()
            grads[kind, style] = engine.module.lin.weight.grad.clone()
            engine.destroy()
    for kind in ("dict", "tuple"):
        assert torch.equal(grads[kind, "tensor"], grads[kind, "engine"]), kind


def test_outputs_without_gradients_are_returned_as_they_are():
    import torch

    engine = _engine()
    x, _ = W.batch(0, 0, 1, torch.float32)
    with torch.no_grad():
        out = engine(x)
    assert out.grad_fn is None


def test_pipeline_refuses_as_deepspeed_does():
    """DeepSpeed's pipeline engine runs only train_batch/eval_batch: engine(batch), backward and
    step are refused, so PyTorch-style backward has nothing to hook. no_sync is refused too
    (DeepSpeed accepts it and reduces anyway)."""
    import torch

    import dslaunch.runtime as deepspeed
    from dslaunch.runtime.pipe import PipelineModule
    from dslaunch.runtime.pipe.module import PipelineError

    torch.manual_seed(0)
    net = PipelineModule(layers=[torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4)], num_stages=1,
                         loss_fn=torch.nn.MSELoss())
    cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}}}
    engine = deepspeed.initialize(model=net, model_parameters=list(net.parameters()), config=cfg)[0]
    x = torch.randn(2, 6)
    with pytest.raises(PipelineError, match="only|not available"):
        engine(x)
    with pytest.raises(PipelineError, match="not available"):
        engine.no_sync()


def test_outputs_changed_in_place_still_count():
    """`loss *= k; loss.backward()` and an output scaled in place before the loss: the gradient
    is still divided (and the prologue and epilogue run), as engine.backward of the same loss."""
    import torch

    weights = {}
    for style in ("engine", "tensor"):
        engine = _engine(stage=2, extra={"gradient_accumulation_steps": 2, "train_batch_size": 2 * W.ROWS})
        for micro in range(2):
            x, y = W.batch(micro, 0, 1, torch.float32)
            out = engine(x)
            out.mul_(0.5)
            loss = W._mse(out, y)
            loss *= 3.0
            engine.backward(loss) if style == "engine" else loss.backward()
            engine.step()
        weights[style] = [p.detach().clone() for p in engine.module.parameters()]
        engine.destroy()
    assert all(torch.equal(a, b) for a, b in zip(weights["engine"], weights["tensor"]))
