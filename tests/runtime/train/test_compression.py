"""compression_training (issue #26): init_compression / redundancy_clean against DeepSpeed 0.17.6
(tests/data/ds_compression/, made by scripts/make_ds_compression_fixtures.py), through plain
loops and through the engine at ZeRO 0 and 2, the engine's schedule, ZeRO-2 on 2 ranks with
save/resume/clean, and the one-line refusals.

Tolerances. DeepSpeed's side was computed on another machine, whose CPU kernels may sum a dot
product in another order or with fused multiply-adds: a few fp32 ulps (eps 1.2e-7) per
operation, which chained layers and optimizer steps carry forward. What is copied, masked or
counted is compared exactly (layer reduction's weights, the cut shapes, which weights are zero);
what is computed is compared within a tolerance that follows from its dtype and operations."""
import copy
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import compression_models as cm
from dist_harness import run_function
from hf_fixture import deepspeed_compat  # noqa: F401  (the deepspeed compatibility package)

from dslaunch.runtime import ConfigError
from dslaunch.runtime.compression import compression_schedule, init_compression, redundancy_clean
import repo_paths

HERE = str(repo_paths.TESTS)
FIXTURES = os.path.join(HERE, "data", "ds_compression")
sys.path.insert(0, str(repo_paths.SCRIPTS))

import compare_ds_compression as compare  # noqa: E402  (scripts/: our side of the engine cases)

# fp32 values of magnitude about 1 through 2-4 small layers (dot products of 4-16 terms) and 3 SGD
# steps: another CPU's summation order moves each by a few ulps; 1e-6 is about 8 ulps at 1.
# (A quantized value can still differ by a whole step where another CPU moves a weight across a
# rounding boundary: no tolerance covers that, and random weights rarely sit on one.)
FP32 = dict(rtol=1e-6, atol=1e-6)
# 12 Adam steps: Adam divides by the root of the second moment, so an ulp of a small gradient
# moves a step by more than an ulp; the engine cases' agreement is 1e-5.
ENGINE = dict(rtol=1e-5, atol=1e-5)


def _config(section, **extra):
    return dict({"train_batch_size": 16, "compression_training": section}, **extra)


def _load_scores(model, scores):
    """DeepSpeed draws topk scores at random in init_compression; its fixture holds them."""
    compare.load_scores(model, scores)


@pytest.mark.parametrize("case", sorted(cm.CASES))
def test_matches_deepspeed_0_17(case):
    """The same training and clean as DeepSpeed 0.17.6: losses, cleaned shapes and weights,
    and the cleaned model's output."""
    ref = torch.load(os.path.join(FIXTURES, f"{case}.pt"))
    cls, section = cm.CASES[case]
    config = _config(section)
    model = cls()
    model.load_state_dict(ref["initial"])
    init_compression(model, config)
    _load_scores(model, ref["scores"])
    x, y = cm.data(cls)
    losses = cm.train(model, x, y, compression_schedule(model).update)
    assert losses == pytest.approx(ref["losses"], rel=FP32["rtol"], abs=FP32["atol"])
    if case.startswith("act"):
        # DeepSpeed's cleaned model still quantizes its inputs; ours drops that in
        # redundancy_clean, so its ranges and output are compared just before
        state = {k: v.clone() for k, v in model.state_dict().items()}
        for key, value in ref["cleaned"].items():
            if "activation_quantizer" in key:
                torch.testing.assert_close(state[key], value, **FP32)
        with torch.no_grad():
            torch.testing.assert_close(model(x), ref["output"], **FP32)
    redundancy_clean(model, config)
    cleaned = model.state_dict()
    expected = {k: v for k, v in ref["cleaned"].items() if "activation_quantizer" not in k}
    assert sorted(cleaned) == sorted(expected)
    for key, value in expected.items():
        ours = state[key] if case.startswith("act") else cleaned[key]  # (before batch norm's extra forward)
        assert ours.shape == value.shape, key
        torch.testing.assert_close(ours, value, **FP32)
    if not case.startswith("act"):
        with torch.no_grad():
            torch.testing.assert_close(model(x), ref["output"], **FP32)
    # plain torch modules again: the state loads into a model built with the cut shapes
    assert all(type(m) in (nn.Linear, nn.Conv2d, nn.BatchNorm2d, cls) for m in model.modules())
    plain = copy.deepcopy(model)
    plain.load_state_dict(cleaned)
    assert compression_schedule(model) is None


def engine_cases_body(stage):
    """Every engine case at ZeRO `stage` through dslaunch's engine, from DeepSpeed's initial
    weights and scores (in a process of its own: the engine starts a process group)."""
    fixture = torch.load(compare.FIXTURE)["cases"]
    return {case: compare.replay(case, stage, fixture[f"{case}/zero{stage}"]) for case in cm.ENGINE_CASES}


@pytest.mark.parametrize("stage", cm.ENGINE_STAGES)
def test_engine_matches_deepspeed_0_17(stage):
    """init_compression, deepspeed.initialize, 12 Adam steps and redundancy_clean, as DeepSpeed
    0.17.6's engine ran them: row pruning by l1 from step 2 (the l1 mask ranked on the weights
    at init_compression, as DeepSpeed did), alone, with sparse pruning and head pruning on the
    same layers, and on weights with many equal magnitudes and row norms. The masks as trained,
    the cut shapes and the zeros are DeepSpeed's exactly; losses, weights and outputs agree to
    1e-5."""
    fixture = torch.load(compare.FIXTURE)["cases"]
    ours = run_function(engine_cases_body, nprocs=1, timeout=240, kwargs={"stage": stage})[0]
    for case in cm.ENGINE_CASES:
        ref = fixture[f"{case}/zero{stage}"]
        mine = ours[case]
        assert mine["losses"] == pytest.approx(ref["losses"], rel=ENGINE["rtol"], abs=ENGINE["atol"]), case
        # the same weights, rows and heads kept, exactly
        assert sorted(mine["masks"]) == sorted(ref["masks"]), case
        for key, value in ref["masks"].items():
            assert torch.equal(mine["masks"][key], value), (case, key)
        assert sorted(mine["cleaned"]) == sorted(ref["cleaned"]), case
        for key, value in ref["cleaned"].items():
            assert mine["cleaned"][key].shape == value.shape, (case, key)
            assert torch.equal(mine["cleaned"][key] == 0, value == 0), (case, key)
            torch.testing.assert_close(mine["cleaned"][key], value, **ENGINE)
        torch.testing.assert_close(mine["output"], ref["output"], **ENGINE)
        assert compare.differences(mine, ref)["same_masks"]
    # rows 2 and after of the case are pruned: fc2 keeps 16 of its 32 rows, fc3 16 inputs
    cleaned = ours["row_l1_offset2"]["cleaned"]
    assert cleaned["fc2.weight"].shape == (16, 32) and cleaned["fc3.weight"].shape == (10, 16)


def test_engine_tie_case_has_ties_at_the_cut():
    """The ties case means something: equal values straddle the cut of both l1 rankings, so a
    ranking that broke ties otherwise than DeepSpeed would keep other weights and rows."""
    initial = torch.load(compare.FIXTURE)["cases"]["row_sparse_ties/zero0"]["initial"]
    for values in (initial["fc1.weight"].abs().flatten(), initial["fc2.weight"].abs().sum(dim=1)):
        ranked = values.sort(descending=True).values
        keep = values.numel() // 2
        assert ranked[keep - 1] == ranked[keep]


def test_row_and_head_cuts_keep_the_masked_outputs():
    """Cutting pruned rows / heads changes nothing but the shapes: outputs equal the masked model's."""
    for case in ("row_l1", "head_topk"):
        cls, section = cm.CASES[case]
        model = cm.fresh(cls)
        config = _config(section)
        init_compression(model, config)
        x, _ = cm.data(cls)
        compression_schedule(model).update(0)
        with torch.no_grad():
            masked = model(x)
            params = sum(p.numel() for p in model.parameters())
        redundancy_clean(model, config)
        with torch.no_grad():
            # the cut layers sum the same nonzero products in smaller matrices, maybe in another order
            torch.testing.assert_close(model(x), masked, **FP32)
        assert sum(p.numel() for p in model.parameters()) < params


def test_channel_l1_cuts_the_smallest_channels_with_their_batch_norm():
    """Channel pruning by L1 norm (DeepSpeed 0.17.6 cannot run this method: the reference is
    the per-channel L1 norm): conv1 keeps its 4 largest output channels, bn1 and conv2's
    inputs are cut to match, and the cut model computes what the masked one did."""
    section = cm.technique({"method": "l1", "schedule_offset": 0},
                           g=cm.group({"dense_ratio": 0.5}, ["conv1"], [["bn1", "conv2"]]))
    config = _config({"channel_pruning": section})
    model = cm.fresh(cm.CNN).eval()
    norms = model.conv1.weight.detach().abs().sum(dim=(1, 2, 3))
    keep = torch.zeros(8, dtype=torch.bool)
    keep[norms.topk(4).indices] = True
    weight, bn_mean = model.conv1.weight.detach().clone(), model.bn1.running_mean.clone()
    init_compression(model, config)
    compression_schedule(model).update(0)
    x, _ = cm.data(cm.CNN)
    assert torch.equal(model.conv1.weight.detach().abs().sum(dim=(1, 2, 3)) != 0, keep)
    redundancy_clean(model, config)
    assert model.conv1.weight.shape == (4, 3, 3, 3) and model.conv2.weight.shape == (6, 4, 3, 3)
    assert model.bn1.num_features == 4 and model.bn1.weight.shape == (4,)
    assert torch.equal(model.conv1.weight, weight[keep]) and torch.equal(model.bn1.running_mean, bn_mean[keep])
    plain = cm.CNN()
    plain.conv1, plain.bn1 = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)
    plain.conv2 = nn.Conv2d(4, 6, 3, padding=1)
    plain.load_state_dict(model.state_dict())


def test_layer_reduction_matches_deepspeed_0_17():
    """A 2-layer student from layers 1 and 3 of a 4-layer teacher, and from the teacher's emb
    and head, as DeepSpeed 0.17.6; without a teacher the model keeps and renumbers its own
    layers 1 and 3 and drops the others."""
    ref = torch.load(os.path.join(FIXTURES, "layer_reduction.pt"))
    config = _config(cm.LAYER_REDUCTION)
    teacher, student = cm.Stack(4), cm.Stack(2)
    teacher.load_state_dict(ref["teacher"])
    student.load_state_dict(ref["student_before"])
    init_compression(student, config, teacher_model=teacher)
    for key, value in ref["student"].items():  # copies of the teacher's tensors: exact
        assert torch.equal(student.state_dict()[key], value), key
    x, _ = cm.data(cm.MLP)
    with torch.no_grad():
        # computed here and on DeepSpeed's machine: 4 fp32 layers of 8-16 term dot products
        torch.testing.assert_close(student(x), ref["output"], **FP32)
    alone = cm.Stack(4)
    alone.load_state_dict(ref["teacher"])
    lr = dict(cm.LAYER_REDUCTION["layer_reduction"], other_module_name=[])
    init_compression(alone, _config({"layer_reduction": lr}))
    assert len(alone.layers) == 2
    with torch.no_grad():
        torch.testing.assert_close(alone(x), ref["output"], **FP32)


def test_gradual_sparse_schedule_reaches_the_ratio():
    """l1 sparse pruning from schedule_offset to schedule_offset_end every stride steps, in equal
    parts; what is pruned stays pruned."""
    section = cm.technique({"method": "l1", "schedule_offset": 2, "schedule_offset_end": 6,
                            "schedule_offset_stride": 2}, g=cm.group({"dense_ratio": 0.25}, ["fc1"]))
    model = cm.fresh(cm.MLP)
    init_compression(model, _config({"sparse_pruning": section}))
    schedule = compression_schedule(model)
    zeros = []
    previous = None
    for step in range(8):
        schedule.update(step)
        mask = model.fc1.weight != 0
        if previous is not None:
            assert not (mask & ~previous).any()
        previous = mask
        zeros.append(int((~mask).sum()))
    # 128 weights: dense 1 until step 2, then 0.75, 0.5, 0.25 at steps 2, 4, 6
    assert zeros == [0, 0, 32, 32, 64, 64, 96, 96]


def test_excluded_modules_are_never_pruned():
    section = cm.technique({"method": "l1", "schedule_offset": 0, "excluded_modules": ["fc2"]},
                           g=cm.group({"dense_ratio": 0.5}, ["fc"]))
    model = cm.fresh(cm.MLP)
    init_compression(model, _config({"sparse_pruning": section}))
    compression_schedule(model).update(0)
    assert int((model.fc1.weight == 0).sum()) == 64 and int((model.fc2.weight == 0).sum()) == 0
    assert [p.target.name for p in compression_schedule(model).parts] == ["fc1"]


def test_bits_fall_from_start_to_target_bits():
    """One bit less every quantization_period steps from schedule_offset: each group of rows
    holds at most 2**bits distinct values."""
    section = cm.technique({"quantize_weight_in_forward": True, "schedule_offset": 1, "quantize_groups": 1},
                           g=cm.group({"start_bits": 4, "target_bits": 2, "quantization_period": 2}, ["fc2"]))
    model = cm.fresh(cm.MLP)
    init_compression(model, _config({"weight_quantization": section}))
    levels = []
    for step in range(7):
        compression_schedule(model).update(step)
        levels.append(len(torch.unique(model.fc2.weight.detach())))
    assert levels[0] == 12 * 16
    assert [min(n, 16) for n in levels[1:]] == [16, 16, 8, 8, 4, 4]


def test_asymmetric_grid_starts_at_the_minimum_of_positive_weights():
    """Asymmetric quantization of a group whose values are all positive: DeepSpeed 0.17.6's grid
    starts at the multiple of the scale nearest the minimum (here 4 x 0.075 = 0.3), with 16
    levels up to 0.3 + 15 x 0.075 = 1.425. A grid whose zero point is clamped into [0, 15] (torch's
    fake-quant op) would start at 0 and round 1.5 down to 1.125."""
    section = cm.technique({"quantize_weight_in_forward": True, "schedule_offset": 0, "quantize_groups": 1,
                            "quantization_type": "asymmetric"},
                           g=cm.group({"start_bits": 4, "target_bits": 4}, ["fc"]))
    model = nn.Sequential()
    model.add_module("fc", nn.Linear(4, 1, bias=False))
    with torch.no_grad():
        model.fc.weight.copy_(torch.tensor([[0.3, 0.5, 1.1, 1.5]]))
    init_compression(model, _config({"weight_quantization": section}))
    compression_schedule(model).update(0)
    torch.testing.assert_close(model.fc.weight.detach(), torch.tensor([[0.3, 0.525, 1.125, 1.425]]))


def test_embedding_weights_quantized_per_token():
    """An embedding gets one scale per token (DeepSpeed's rule), whatever quantize_groups says."""
    section = cm.technique({"quantize_weight_in_forward": True, "schedule_offset": 0, "quantize_groups": 1},
                           g=cm.group({"start_bits": 2, "target_bits": 2}, ["emb"]))
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("emb", nn.Embedding(10, 32))
    raw = model.emb.weight.detach().clone()
    init_compression(model, _config({"weight_quantization": section}))
    compression_schedule(model).update(0)
    quantized = model.emb.weight.detach()
    for row, q in zip(raw, quantized):
        scale = 2 * row.abs().max() / 4
        assert torch.equal(q, (row / scale).round().clamp(-2, 1) * scale)


def _engine_run(section, zero=0, optimizer=("SGD", cm.LR)):
    import dslaunch.runtime as deepspeed

    model = cm.fresh(cm.MLP)
    config = _config(section, optimizer={"type": optimizer[0], "params": {"lr": optimizer[1]}}, steps_per_print=100,
                     zero_optimization={"stage": zero})
    init_compression(model, config)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine, config


def engine_schedule_body():
    section = {"sparse_pruning": cm.technique({"method": "l1", "schedule_offset": 2},
                                              g=cm.group({"dense_ratio": 0.5}, ["fc"]))}
    engine, _ = _engine_run(section)
    x, y = cm.data(cm.MLP)
    losses, zeros = [], []
    for _ in range(cm.STEPS):
        zeros.append(int((engine.module.fc1.weight == 0).sum()))
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return zeros, losses


def test_engine_drives_the_schedule_like_a_plain_loop():
    """deepspeed.initialize steps the schedule: step 0 at initialize, then after each optimizer
    step; the losses equal a plain torch loop that updates the schedule itself. The engine runs
    in a process of its own (its process group must not outlive it in pytest's)."""
    section = {"sparse_pruning": cm.technique({"method": "l1", "schedule_offset": 2},
                                              g=cm.group({"dense_ratio": 0.5}, ["fc"]))}
    zeros, losses = run_function(engine_schedule_body, nprocs=1, timeout=120)[0]
    assert zeros == [0, 0, 64]
    x, y = cm.data(cm.MLP)
    model = cm.fresh(cm.MLP)
    init_compression(model, _config(section))
    # the engine's process runs one thread, this one maybe more (another summation order)
    assert losses == pytest.approx(cm.train(model, x, y, compression_schedule(model).update),
                                   rel=FP32["rtol"], abs=FP32["atol"])


def zero2_body(root):
    """2 ranks, ZeRO-2: 2 steps, save, 2 more steps; a fresh engine resumes from the save and
    runs the same 2 steps; both clean. Returns what must match across ranks and runs."""
    section = {"sparse_pruning": cm.technique({"method": "topk", "schedule_offset": 1},
                                              g=cm.group({"dense_ratio": 0.5}, ["fc1"])),
               "row_pruning": cm.technique({"method": "l1", "schedule_offset": 2},
                                           g=cm.group({"dense_ratio": 0.5}, ["fc2"], [["out"]])),
               "weight_quantization": cm.technique({"quantize_weight_in_forward": True, "schedule_offset": 1},
                                                   g=cm.group({"start_bits": 8, "target_bits": 6,
                                                               "quantization_period": 1}, ["out"]))}
    rank = int(os.environ["RANK"])
    x, y = cm.data(cm.MLP)
    mine = slice(8 * rank, 8 * rank + 8)

    def step(engine):
        engine.backward(torch.nn.functional.mse_loss(engine(x[mine]), y[mine]))
        engine.step()

    engine, config = _engine_run(section, zero=2, optimizer=("Adam", 0.01))
    for _ in range(2):
        step(engine)
    engine.save_checkpoint(root, tag="t")
    for _ in range(2):
        step(engine)
    resumed, _ = _engine_run(section, zero=2, optimizer=("Adam", 0.01))
    resumed.load_checkpoint(root, tag="t")
    for _ in range(2):
        step(resumed)
    out = {}
    for name, e in (("first", engine), ("resumed", resumed)):
        redundancy_clean(e.module, config)
        out[name] = {k: v.detach().clone() for k, v in e.module.state_dict().items()}
    return out


def test_zero2_two_ranks_save_resume_clean(tmp_path):
    outs = run_function(zero2_body, nprocs=2, kwargs={"root": str(tmp_path)}, timeout=240)
    first = outs[0]["first"]
    assert first["fc2.weight"].shape == (6, 16) and first["out.weight"].shape == (4, 6)
    # exact: every rank computes the same masks on the same gathered weights, and the resumed
    # run repeats the same operations on the same machine with the same thread count
    for out in outs:
        for run in ("first", "resumed"):
            assert sorted(out[run]) == sorted(first)
            for key in first:
                assert torch.equal(out[run][key], first[key]), (run, key)


BAD = {
    "pattern": ({"sparse_pruning": cm.technique({"schedule_offset": 0}, g=cm.group({"dense_ratio": 0.5}, ["fc9"]))},
                "compression_training.sparse_pruning.different_groups.g.modules: 'fc9' matches no Linear/Conv2d "
                "module of the model"),
    "ratio": ({"row_pruning": cm.technique({}, g=cm.group({"dense_ratio": 1.5}, ["fc1"]))},
              "config: compression_training.row_pruning.different_groups.g.params.dense_ratio: must be in (0, 1], got 1.5"),
    "related": ({"row_pruning": cm.technique({}, g=cm.group({"dense_ratio": 0.5}, ["fc1"], [["out"]]))},
                "compression_training.row_pruning.different_groups.g.related_modules: out takes 12 inputs, but fc1 "
                "gives 16 rows; they cannot be cut together"),
    "heads": ({"head_pruning": cm.technique({}, g=cm.group({"dense_ratio": 0.5}, ["fc2"]))},
              "config: compression_training.head_pruning.shared_parameters.num_heads: required when head_pruning is enabled"),
    "activation": ({"activation_quantization": cm.technique({}, g=cm.group({"bits": 6}, ["fc2"]))},
                   "config: compression_training.activation_quantization.different_groups.g.params.bits: must be 4 "
                   "or 8 (as DeepSpeed), got 6"),
    "rounding": ({"weight_quantization": cm.technique(
        {"quantize_weight_in_forward": True, "rounding": "stochastic"},
        g=cm.group({"start_bits": 8, "target_bits": 8}, ["fc2"]))},
        "config: compression_training.weight_quantization.shared_parameters.rounding: only nearest rounding is "
        "supported, got 'stochastic'"),
    "channel_related": ({"channel_pruning": cm.technique({}, g=cm.group({"dense_ratio": 0.5}, ["conv2"],
                                                                         [["bn1"]]))},
                        "compression_training.channel_pruning.different_groups.g.related_modules: bn1 takes 8 "
                        "channels, but conv2 gives 6; they cannot be cut together"),
    "teacher_layer": ({"layer_reduction": dict(cm.LAYER_REDUCTION["layer_reduction"], teacher_layer=[1])},
                      "config: compression_training.layer_reduction.teacher_layer: needs keep_number_layer (2) layer "
                      "indices, got [1]"),
    "row_offset_end": ({"row_pruning": cm.technique({"schedule_offset": 2, "schedule_offset_end": 6},
                                                    g=cm.group({"dense_ratio": 0.5}, ["fc2"]))},
                       "config: compression_training.row_pruning.shared_parameters.schedule_offset_end: DeepSpeed "
                       "0.17.6 ignores this key for row pruning (it masks the rows once, at schedule_offset), so "
                       "removing it changes nothing; remove it"),
    "row_offset_stride": ({"row_pruning": cm.technique({"schedule_offset_stride": 2},
                                                       g=cm.group({"dense_ratio": 0.5}, ["fc2"]))},
                          "config: compression_training.row_pruning.shared_parameters.schedule_offset_stride: "
                          "DeepSpeed 0.17.6 ignores this key for row pruning (it masks the rows once, at "
                          "schedule_offset), so removing it changes nothing; remove it"),
    "moq": ({"weight_quantization": cm.technique({}, g=cm.group({"start_bits": 8, "target_bits": 8}, ["fc2"]))},
            "config: compression_training.weight_quantization.shared_parameters.quantize_weight_in_forward: only the "
            "fake-quant-in-forward path is supported (quantize_weight_in_forward true); DeepSpeed's in-place MoQ "
            "quantizer is not"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_one_line(case):
    section, line = BAD[case]
    with pytest.raises(ConfigError) as err:
        init_compression(cm.fresh(cm.CNN if case.startswith("channel") else cm.MLP), _config(section))
    assert str(err.value) == line


def test_deepspeed_compression_compress_and_exit_2(deepspeed_compat, tmp_path):
    """`deepspeed.compression.compress` is this module through the compatibility package; a bad
    config there stops the script with one line and exit 2."""
    script = tmp_path / "bad.py"
    script.write_text("import sys\nsys.path.insert(0, %r)\nimport compression_models as cm\n"
                      "import dslaunch.runtime.compression as ours\n"
                      "from deepspeed.compression.compress import init_compression, redundancy_clean\n"
                      "print(init_compression is ours.init_compression, redundancy_clean is ours.redundancy_clean)\n"
                      "init_compression(cm.MLP(), {'train_batch_size': 1, 'compression_training': %r})\n"
                      % (HERE, BAD["pattern"][0]))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env=deepspeed_compat.env())
    assert run.returncode == 2, run.stderr
    assert run.stdout == "True True\n"
    assert run.stderr.strip().splitlines() == ["error: " + BAD["pattern"][1]]


def missing_init_body(section):
    import dslaunch.runtime as deepspeed

    model = cm.fresh(cm.MLP)
    try:
        deepspeed.initialize(model=model, model_parameters=model.parameters(),
                             config=_config(section, optimizer={"type": "SGD", "params": {"lr": 0.1}}))
    except ConfigError as exc:
        return str(exc)
    return "initialize accepted a model without init_compression"


def test_zero3_and_missing_init_refused():
    import dslaunch.runtime as deepspeed

    section = {"sparse_pruning": cm.technique({}, g=cm.group({"dense_ratio": 0.5}, ["fc1"]))}
    with pytest.raises(ConfigError, match="ZeRO-3 partitions them"):
        deepspeed.DeepSpeedConfig.load(_config(section, zero_optimization={"stage": 3}))
    # initialize starts a process group: in a process of its own, not pytest's
    assert "call deepspeed.compression.compress.init_compression" in run_function(
        missing_init_body, nprocs=1, timeout=120, kwargs=dict(section=section))[0]
