"""The reduction keys through the config, at every ZeRO stage, on 2 gloo ranks:
prescale_gradients, gradient_predivide_factor, gradient_allreduce_op, communication_data_type
and data_types.grad_accum_dtype do what DeepSpeed documents.

Every gradient collective's input is recorded (dslaunch.runtime.comm wrapped), so the
effect is seen where it happens: with predivide factor f each rank hands the sum g / f
(with prescaling g / N) where the default hands g, and the mean comes out the same (the
factors here are powers of two, so exactly the same losses); with gradient_allreduce_op
"sum" the reduced gradients are N times the mean ones, exactly; communication_data_type
is the dtype on the wire; grad_accum_dtype is the dtype of the stage-1/2/3 partitions.
"""
import pytest
import torch

from dist_harness import run_function

from dslaunch.runtime.config import DeepSpeedConfig
from dslaunch.runtime.strict import ConfigError

GRAD_LABELS = ("stage0 grads", "stage1 grads", "stage2 grads", "stage3 reduce grads")


def _train(stage, extra, bf16=False, steps=2):
    import dslaunch.runtime as deepspeed
    from dslaunch.runtime import comm

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 40, "allgather_bucket_size": 40,
                                 "stage3_param_persistence_threshold": 0}, **extra}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    seen = []
    originals = {name: getattr(comm, name) for name in ("all_reduce", "reduce", "reduce_scatter_tensor")}

    def spy(name):
        def call(*args, **kwargs):
            label = kwargs.get("label") or comm.scope_label() or ""  # stage 2 labels its reduces by block
            if label.startswith(GRAD_LABELS):
                t = args[1] if name == "reduce_scatter_tensor" else args[0]
                seen.append(t.detach().clone())
            return originals[name](*args, **kwargs)
        return call

    for name in originals:
        setattr(comm, name, spy(name))
    try:
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        rank = comm.get_rank()
        g = torch.Generator().manual_seed(7 + rank)
        losses = []
        s = engine.strategy
        reduced = []
        if stage < 3 and not bf16:  # the first step's reduced gradients, as step() reduces them (before clipping)
            reduce = s.reduce_gradients

            def keep_reduced():
                reduce()
                if not reduced:
                    reduced.extend(t.detach().clone() for t in ([b.flat for b in s.buckets] if stage == 0 else
                                                                 [grp.grad for grp in s.groups]))
            s.reduce_gradients = keep_reduced
        for _ in range(steps):
            x = torch.randn(4, 6, generator=g).to(engine.compute_dtype if bf16 else torch.float32)
            y = torch.randint(0, 3, (4,), generator=g)
            loss = torch.nn.functional.cross_entropy(engine(x).float(), y)
            engine.backward(loss)
            # the reduced partitions as the step will read them (stage 1's live only until then)
            parts = [grp.grad for grp in s.groups] if stage in (1, 2) else [grp["grad"] for grp in s.groups] \
                if stage == 3 else []
            engine.step()
            losses.append(float(loss))
        return {"losses": losses, "wire": seen, "partition_dtypes": sorted({str(t.dtype) for t in parts}),
                "reduced": reduced}
    finally:
        for name, fn in originals.items():
            setattr(comm, name, fn)


def _matrix():
    out = {}
    for stage in (0, 1, 2, 3):
        out[(stage, "default")] = _train(stage, {})
        out[(stage, "predivide")] = _train(stage, {"gradient_predivide_factor": 4.0})
        out[(stage, "prescale")] = _train(stage, {"prescale_gradients": True})
        if stage < 3:
            out[(stage, "sum")] = _train(stage, {"gradient_allreduce_op": "sum"})
        out[(stage, "comm bf16")] = _train(stage, {"communication_data_type": "bf16"})
        out[(stage, "bf16 model")] = _train(stage, {}, bf16=True)
        out[(stage, "bf16 model, comm fp32")] = _train(stage, {"communication_data_type": "fp32"}, bf16=True)
        if stage >= 1:
            out[(stage, "bf16 model, accum fp32")] = _train(stage, {"data_types": {"grad_accum_dtype": "fp32"}},
                                                            bf16=True)
            out[(stage, "accum bf16")] = _train(stage, {"data_types": {"grad_accum_dtype": "bf16"}})
    return out


def test_reduction_keys_at_every_stage():
    results = run_function(_matrix, nprocs=2, timeout=600)
    for rank, res in enumerate(results):
        for stage in (0, 1, 2, 3):
            base = res[(stage, "default")]
            assert base["wire"], f"stage {stage}: no gradient collective recorded"
            for name, divisor in (("predivide", 4.0), ("prescale", 2.0)):
                run = res[(stage, name)]
                assert len(run["wire"]) == len(base["wire"])
                for got, plain in zip(run["wire"], base["wire"]):
                    assert torch.equal(got, plain / divisor), (stage, name, rank)
                # the mean is unchanged: powers of two divide exactly
                assert run["losses"] == base["losses"], (stage, name)
            if stage < 3:  # gradient_allreduce_op "sum": each rank hands g, and the sum is not divided
                run = res[(stage, "sum")]
                first = len(base["wire"]) // 2  # the first of the two steps: same parameters in both runs
                for got, plain in zip(run["wire"][:first], base["wire"][:first]):
                    assert torch.equal(got, plain), (stage, rank)
                assert len(run["reduced"]) == len(base["reduced"]) > 0
                for summed, mean in zip(run["reduced"], base["reduced"]):
                    assert torch.equal(summed, mean * 2), (stage, rank)
            assert {t.dtype for t in base["wire"]} == {torch.float32}
            assert {t.dtype for t in res[(stage, "comm bf16")]["wire"]} == {torch.bfloat16}
            assert res[(stage, "comm bf16")]["losses"] == pytest.approx(base["losses"], abs=2e-2)
            assert {t.dtype for t in res[(stage, "bf16 model")]["wire"]} == {torch.bfloat16}
            assert {t.dtype for t in res[(stage, "bf16 model, comm fp32")]["wire"]} == {torch.float32}
            if stage >= 1:  # stage 1's partition too, from the boundary backward to the step
                # the model dtype by default, as DeepSpeed's gradient_accumulation_dtype
                assert res[(stage, "bf16 model")]["partition_dtypes"] == ["torch.bfloat16"]
                accum = res[(stage, "bf16 model, accum fp32")]
                assert accum["partition_dtypes"] == ["torch.float32"]
                assert accum["losses"] == pytest.approx(res[(stage, "bf16 model")]["losses"], abs=5e-2)
                # an fp32 model summing in bf16 (DeepSpeed takes it at stages 1-3): bf16 partitions,
                # fp32 on the wire (the model's dtype)
                low = res[(stage, "accum bf16")]
                assert low["partition_dtypes"] == ["torch.bfloat16"]
                assert {t.dtype for t in low["wire"]} == {torch.float32}
                assert low["losses"] == pytest.approx(base["losses"], abs=5e-2)


@pytest.mark.parametrize("cfg, message", [
    ({"prescale_gradients": True, "gradient_predivide_factor": 2.0}, "gradient_predivide_factor: has no effect"),
    ({"gradient_predivide_factor": 0}, "gradient_predivide_factor: must be > 0"),
    ({"gradient_allreduce_op": "max"}, "Invalid gradient_allreduce_op 'max': use 'mean' or 'sum'"),
    ({"gradient_allreduce_op": "sum", "zero_optimization": {"stage": 3}},
     "gradient_allreduce_op: \"sum\" is not supported with ZeRO stage 3"),
    ({"gradient_allreduce_op": "Sum", "prescale_gradients": True}, "prescale_gradients: has no effect with"),
    ({"gradient_allreduce_op": "sum", "gradient_predivide_factor": 2.0}, "gradient_predivide_factor: has no effect"),
    ({"communication_data_type": "int8"}, "communication_data_type: unknown dtype 'int8'"),
    ({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}},
     "data_types.grad_accum_dtype: stage 0 accumulates gradients in the model dtype (bf16)"),
    ({"data_types": {"grad_accum_dtype": "bf16"}}, "data_types.grad_accum_dtype: stage 0"),
])
def test_reduction_keys_refuse_what_they_cannot_do(cfg, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        DeepSpeedConfig.load({"train_batch_size": 2, **cfg})


def test_grad_accum_refusals_are_deepspeeds_exception_type_too():
    # DeepSpeed raises NotImplementedError for the mixes it refuses (its own tests expect that
    # type); the refusal here is both that and the one-line ConfigError
    with pytest.raises(NotImplementedError, match="data_types.grad_accum_dtype: stage 0"):
        DeepSpeedConfig.load({"train_batch_size": 2, "data_types": {"grad_accum_dtype": "bf16"}})
    with pytest.raises(ConfigError, match="^config: data_types.grad_accum_dtype: stage 0"):
        DeepSpeedConfig.load({"train_batch_size": 2, "data_types": {"grad_accum_dtype": "bf16"}})
