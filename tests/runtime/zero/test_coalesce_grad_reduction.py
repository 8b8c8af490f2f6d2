"""engine.coalesce_grad_reduction(), DeepSpeed 0.19's one reduction for many backwards at
ZeRO stages 1-3: inside the block each rank sums its own gradients, and leaving it reduces
them once. Against the reference of the same script without the block (each backward's
gradients reduced as it goes), in fp32 so the two differ only in summation order; with the
gradient collectives counted, since issuing fewer of them is the point."""
import pytest

from dist_harness import run_function


def _train(stage, coalesce, extra=(), steps=2, chunks=4, raise_at=None):
    import contextlib

    import torch

    import dslaunch.runtime as deepspeed
    from dslaunch.runtime.core import comm

    zero = {"stage": stage, "overlap_comm": "overlap" in extra, "reduce_bucket_size": 40 if "small" in extra else 5e8}
    if "offload" in extra:
        zero["offload_optimizer"] = {"device": "cpu"}
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "zero_optimization": zero,
           "gradient_clipping": 0.5 if "clip" in extra else 0.0}
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    calls = {"backward": 0, "exit": 0, "raise": 0}
    phase = {"now": None}

    def counted(fn):
        def wrapper(*args, **kwargs):
            if phase["now"] is not None:
                calls[phase["now"]] += 1
            return fn(*args, **kwargs)
        return wrapper

    comm.reduce = counted(comm.reduce)
    comm.reduce_scatter_tensor = counted(comm.reduce_scatter_tensor)
    torch.manual_seed(10 + torch.distributed.get_rank())
    batches = [(torch.randn(2, 6), torch.randint(0, 3, (2,))) for _ in range(steps * chunks)]
    for step in range(steps):
        block = engine.coalesce_grad_reduction() if coalesce else contextlib.nullcontext()
        try:
            with block:
                phase["now"] = "backward"
                for i in range(chunks):
                    x, y = batches[step * chunks + i]
                    engine.set_gradient_accumulation_boundary(i == chunks - 1)
                    engine.backward(torch.nn.functional.cross_entropy(engine(x), y))
                    if raise_at is not None and step == 0 and i == raise_at:
                        phase["now"] = "raise"  # what leaving the block by an exception issues
                        raise KeyError("the script's own error")
                phase["now"] = "exit"
        except KeyError:
            phase["now"] = "backward"  # the script carries on, outside the block, with the rest of the chunks
            for i in range(raise_at + 1, chunks):
                x, y = batches[step * chunks + i]
                engine.set_gradient_accumulation_boundary(i == chunks - 1)
                engine.backward(torch.nn.functional.cross_entropy(engine(x), y))
        phase["now"] = None
        engine.step()
    return [p.detach().clone() for p in model.parameters()], calls


def _compare(stage, extra):
    ref, ref_calls = _train(stage, False, extra)
    got, got_calls = _train(stage, True, extra)
    return max(float((a - b).abs().max()) for a, b in zip(ref, got)), ref_calls, got_calls


@pytest.mark.parametrize("stage,extra", [(1, ()), (2, ()), (3, ()), (2, ("overlap", "small")), (3, ("small",)),
                                         (1, ("offload", "clip")), (2, ("offload", "clip")), (3, ("clip",))])
def test_one_reduction_per_block_gives_the_same_weights(stage, extra):
    out = run_function(_compare, nprocs=2, kwargs={"stage": stage, "extra": extra}, timeout=240)
    for diff, ref_calls, got_calls in out:
        assert diff < 1e-6, diff  # the same sums, added in another order
        # inside the block no gradient collective at all; leaving it reduces everything once
        assert got_calls["backward"] == 0 and got_calls["exit"] > 0, got_calls
        if stage > 1:  # without the block stages 2 and 3 reduce in every backward
            assert ref_calls["backward"] > got_calls["exit"], (ref_calls, got_calls)


def _after_a_raise(stage, raise_at):
    ref, _ = _train(stage, False)
    got, calls = _train(stage, True, raise_at=raise_at)
    return max(float((a - b).abs().max()) for a, b in zip(ref, got)), calls


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("raise_at", [1, 3])
def test_a_block_that_raises_reduces_nothing_and_loses_no_gradient(stage, raise_at):
    # raise_at 1: the failed block's two backwards are reduced with the later ones, outside it;
    # raise_at 3: after the block's last backward, so the step itself reduces them; then a second step
    for diff, calls in run_function(_after_a_raise, nprocs=2, kwargs={"stage": stage, "raise_at": raise_at},
                                    timeout=240):
        assert diff < 1e-6, diff
        assert calls["raise"] == 0, calls


def _refusals():
    import torch

    import dslaunch.runtime as deepspeed

    out = {}

    def engine_at(stage, **more):
        model = torch.nn.Linear(4, 2)
        cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 0.1}},
               "zero_optimization": {"stage": stage}, **more}
        return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]

    def attempt(name, fn):
        try:
            fn()
            out[name] = None
        except Exception as exc:  # noqa: BLE001 (the refusal's type and line are the result)
            out[name] = (isinstance(exc, AssertionError), isinstance(exc, NotImplementedError), str(exc))

    def enter(engine):
        with engine.coalesce_grad_reduction():
            pass

    attempt("stage0", lambda: enter(engine_at(0)))
    e2 = engine_at(2)

    def step_inside():
        with e2.coalesce_grad_reduction():
            e2.step()
    attempt("step_inside", step_inside)
    e1 = engine_at(1)

    def no_sync_inside():
        with e1.coalesce_grad_reduction():
            with e1.no_sync():
                pass
    attempt("no_sync_inside", no_sync_inside)

    def inside_no_sync():
        with e1.no_sync():
            with e1.coalesce_grad_reduction():
                pass
    attempt("inside_no_sync", inside_no_sync)
    attempt("unmanaged", lambda: enter(engine_at(1, managed_gradient_accumulation=False)))
    attempt("empty_block", lambda: enter(e1))
    # DeepSpeed's pattern: the boundary said before the block is what it is after it
    e1.set_gradient_accumulation_boundary(False)
    with e1.coalesce_grad_reduction():
        e1.backward(e1(torch.randn(1, 4)).sum())
    out["boundary_after"] = e1._is_gradient_accumulation_boundary
    steps = e1.global_steps
    e1.set_gradient_accumulation_boundary(True)
    e1.step()
    out["stepped"] = e1.global_steps - steps
    return out


def test_the_refusals_are_deepspeeds_types_in_one_line():
    out = run_function(_refusals, nprocs=1, timeout=120)[0]
    assert out["stage0"][1] and "requires ZeRO stage 1/2/3, got stage 0" in out["stage0"][2]
    assert out["step_inside"][0] and "inside no_sync" in out["step_inside"][2]
    assert out["no_sync_inside"][0] and "no_sync context manager reentry" in out["no_sync_inside"][2]
    assert out["inside_no_sync"][0] and "cannot be nested inside another no_sync" in out["inside_no_sync"][2]
    assert out["unmanaged"][0] and "managed_gradient_accumulation=False" in out["unmanaged"][2]
    assert out["empty_block"] is None  # nothing to reduce
    assert out.pop("boundary_after") is False and out.pop("stepped") == 1
    for name, value in out.items():
        assert value is None or "\n" not in value[2], (name, value)
