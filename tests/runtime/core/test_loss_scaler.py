"""The fp16 loss scaler's state machine (one class, DeepSpeed's constructor), driven by
overflow flags directly and, through the engine in one process, by gradients poisoned with
inf/NaN."""
import pytest

from dist_harness import run_function
from dslaunch.runtime.config import FP16Config
from dslaunch.runtime.loss_scaler import DynamicLossScaler, LossScaler, LossScaleStuck, make_loss_scaler


def drive(scaler, pattern):
    """pattern: string of 'o' (overflow) and '.' (clean); returns the scale after each step."""
    out = []
    for ch in pattern:
        scaler.update(ch == "o")
        out.append(scaler.scale)
    return out


def test_hysteresis_delays_backoff_then_halves():
    s = DynamicLossScaler(init_scale=2 ** 4, scale_window=100, min_scale=1, delayed_shift=2)
    assert drive(s, "ooo") == [16, 8, 4]  # first overflow only spends hysteresis
    assert s.state.skipped_steps == 3


def test_growth_after_window_of_clean_steps_and_refill():
    s = DynamicLossScaler(init_scale=2 ** 3, scale_window=3, min_scale=1, delayed_shift=2)
    # overflow at iter 0 (hysteresis 2->1), 1 (halve to 4); clean at 2..5; iter 5 is the third
    # clean step after the first one -> grow. DeepSpeed 0.19.8's DynamicLossScaler(8, 3, 1, 2,
    # False) gives the same sequence.
    assert drive(s, "oo....") == [8, 4, 4, 4, 4, 8]
    assert s.state.hysteresis_left == 2  # refilled on growth
    assert drive(s, "o") == [8]  # hysteresis again absorbs one overflow


def test_consecutive_hysteresis_refills_on_every_clean_step():
    s = DynamicLossScaler(init_scale=2 ** 3, scale_window=1000, delayed_shift=2, consecutive_hysteresis=True)
    assert drive(s, "o.o.o") == [8, 8, 8, 8, 8]
    s2 = DynamicLossScaler(init_scale=2 ** 3, scale_window=1000, delayed_shift=2, consecutive_hysteresis=False)
    assert drive(s2, "o.o.o") == [8, 8, 4, 4, 2]


def test_stuck_at_min_scale_is_a_clear_error():
    s = DynamicLossScaler(init_scale=2 ** 1, scale_window=1000, min_scale=1, delayed_shift=1)
    assert drive(s, "o") == [1]
    with pytest.raises(LossScaleStuck, match=r"overflow even at the minimum loss scale 1 \(fp16.min_loss_scale\)"):
        s.update(True)


def test_static_scale_and_factory_and_state_round_trip():
    st = make_loss_scaler(FP16Config(enabled=True, loss_scale=128.0))
    assert isinstance(st, LossScaler) and not st.dynamic
    assert drive(st, "o..") == [128, 128, 128] and st.state.skipped_steps == 1
    dyn = make_loss_scaler(FP16Config(enabled=True, initial_scale_power=5, loss_scale_window=2, hysteresis=1))
    drive(dyn, "o.")
    copy = make_loss_scaler(FP16Config(enabled=True, initial_scale_power=5, loss_scale_window=2, hysteresis=1))
    copy.load_state_dict(dyn.state_dict())
    assert drive(copy, "..") == drive(dyn, "..")


def engine_overflow_body():
    import torch

    import dslaunch.runtime as deepspeed

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    cfg = {"train_batch_size": 2, "steps_per_print": 1000,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.01, "warmup_num_steps": 10,
                                                           "warmup_type": "linear"}},
           "fp16": {"enabled": True, "initial_scale_power": 4, "hysteresis": 1, "loss_scale_window": 2}}
    engine, optim, _, sched = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    # DeepSpeed's names on the optimizer initialize returns: its fp16 wrapper's loss_scale_config,
    # its ZeRO optimizer's loss_scaler and dynamic_loss_scale, all views of the engine's scaler
    config, scaler = optim.loss_scale_config, optim.loss_scaler
    views = [(optim.dynamic_loss_scale, config.dynamic_loss_scale, config.use_grad_scaling, config.scale_window,
              config.min_loss_scale, config.scale_factor, scaler.scale_window, scaler.delayed_shift)]
    poison = {1: float("inf"), 2: float("nan")}
    trace = []
    for step in range(5):
        before = model.weight.detach().clone()
        x = torch.ones(2, 4, dtype=torch.float16)
        loss = model(x).float().pow(2).mean()
        if step in poison:
            loss = loss * poison[step]
        engine.backward(loss)
        engine.step()
        changed = not torch.equal(before, model.weight.detach())
        assert engine.was_step_applied() == changed
        trace.append((engine.loss_scale(), engine.skipped_steps, sched.last_batch_iteration, changed))
        assert config.cur_scale == scaler.cur_scale == scaler.loss_scale == engine.loss_scale()
        views.append((config.cur_iter, config.last_overflow_iter, scaler.cur_iter, scaler.last_overflow_iter))
    config.cur_scale = 64.0  # written through the view: the engine scales the next loss by it
    views.append(engine.loss_scale())

    # a static scale: DeepSpeed's ZeRO optimizer says dynamic_loss_scale False, loss_scaler.loss_scale
    static = torch.nn.Linear(4, 1)
    _, optim, _, _ = deepspeed.initialize(model=static, model_parameters=static.parameters(), config={
        "train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "fp16": {"enabled": True, "loss_scale": 138.0}, "zero_optimization": {"stage": 1},
        "zero_allow_untested_optimizer": True})
    views.append((optim.dynamic_loss_scale, optim.loss_scaler.loss_scale, optim.loss_scaler.dynamic,
                  optim.loss_scale_config.dynamic_loss_scale, optim.loss_scale_config.scale_window))
    return trace, views


def test_engine_skips_poisoned_steps_and_backs_off():
    trace, views = run_function(engine_overflow_body, nprocs=1, timeout=60)[0]
    # (scale, skipped, scheduler's last_batch_iteration (-1 before its first step, as
    # DeepSpeed's), weights changed)
    assert trace == [
        (16.0, 0, 0, True),
        (8.0, 1, 0, False),    # inf: skipped, scheduler not stepped, scale halved
        (4.0, 2, 0, False),    # nan: same
        (4.0, 2, 1, True),
        (4.0, 2, 2, True),     # DeepSpeed 0.19 grows only after window (2) clean steps past the first
    ]
    assert views == [
        (True, True, True, 2, 1.0, 2.0, 2, 1),
        # (cur_iter, last_overflow_iter) of loss_scale_config and loss_scaler after each step:
        # DeepSpeed 0.19.8's DynamicLossScaler(16, 2, 1, 1) given the same overflow flags
        (1, -1, 1, -1), (2, 1, 2, 1), (3, 2, 3, 2), (4, 2, 4, 2), (5, 2, 5, 2),
        64.0,
        (False, 138.0, False, False, None),
    ]


def growth_step_body():
    """Weights after each step under a dynamic scale that grows every 2 clean steps, and
    under the static scale it starts at, for ZeRO stages 0-2."""
    import torch

    import dslaunch.runtime as deepspeed

    out = {}
    for stage in (0, 1, 2):
        for fp16 in ({"initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 1}, {"loss_scale": 256}):
            torch.manual_seed(0)
            model = torch.nn.Linear(4, 2)
            cfg = {"train_batch_size": 2, "steps_per_print": 1000, "zero_allow_untested_optimizer": True,
                   "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": stage},
                   "fp16": {"enabled": True, **fp16}}
            engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
            g = torch.Generator().manual_seed(1)
            trace = []
            for _ in range(5):
                x = torch.randn(2, 4, generator=g).half()
                engine.backward(engine(x).float().pow(2).mean())
                engine.step()
                trace.append((engine.loss_scale(), model.weight.detach().float().clone()))
            out[(stage, "loss_scale" in fp16)] = trace
    return out


def test_a_growing_scale_unscales_the_step_by_the_scale_it_was_computed_with():
    """DeepSpeed 0.19.8 raises the scale before it unscales the step's gradients, so each step
    where the scale grows moves the weights by half the gradient; here the scale a step used
    unscales it, and a dynamic scale that never overflows trains what its static start does."""
    out = run_function(growth_step_body, nprocs=1, timeout=120)[0]
    for stage in (0, 1, 2):
        dynamic, static = out[(stage, False)], out[(stage, True)]
        assert [s for s, _ in dynamic] == [256.0, 256.0, 512.0, 512.0, 1024.0]  # it grew (twice)
        for (_, a), (_, b) in zip(dynamic, static):
            assert torch_equal(a, b), stage


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)
