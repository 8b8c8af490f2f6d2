"""The pure parts of init_inference, in one process: the sharding plan for each supported
layout, the shard maths, config parsing, int8 rounding, and the refusals (as exceptions here;
the one-line exit 2 of an uncaught one is checked by test_inference_cli.py)."""
from __future__ import annotations

import os
import sys

import pytest
import torch
import repo_paths

sys.path.insert(0, str(repo_paths.TESTS))

pytest.importorskip("transformers", reason="the [hf] extra (scripts/setup_env.sh installs it)")

import dslaunch.runtime as deepspeed  # noqa: E402
from dslaunch.runtime.inference import InferenceConfigError, plan_tensor_parallel  # noqa: E402
from dslaunch.runtime.inference.config import parse_inference_config  # noqa: E402
from dslaunch.runtime.inference.plan import LayerShard, Style, split_ranges, vocab_range  # noqa: E402
from dslaunch.runtime.inference.quantize import dequantize_int8, group_size_for, quantize_int8  # noqa: E402
from inference_models import build, logits, policy, prompt  # noqa: E402

EXPECTED_ROWS = {
    "gpt2": ("attn.c_proj", "mlp.c_proj"),
    "llama": ("mlp.down_proj", "self_attn.o_proj"),
    "mistral": ("mlp.down_proj", "self_attn.o_proj"),
    "gpt_neo": ("attn.attention.out_proj", "mlp.c_proj"),
    "gptj": ("attn.out_proj", "mlp.fc_out"),
    "bert": ("attention.output.dense", "output.dense"),
    "t5": ("layer.0.SelfAttention.o", "layer.1.DenseReluDense.wo", "layer.1.EncDecAttention.o",
           "layer.2.DenseReluDense.wo"),
}


@pytest.mark.parametrize("kind", sorted(EXPECTED_ROWS))
def test_auto_plan_finds_the_row_parallel_points(kind):
    plan = plan_tensor_parallel(build(kind), 2)
    (block_cls, rows), = plan.row_points.items()
    assert rows == EXPECTED_ROWS[kind]
    styles = {s.style for s in plan.layers}
    assert {Style.COLUMN, Style.ROW, Style.VOCAB_EMBEDDING, Style.VOCAB_HEAD} <= styles
    assert all(a.local * 2 == a.full for a in plan.attrs)


def test_gpt2_fused_qkv_is_split_part_by_part_and_heads_divided():
    plan = plan_tensor_parallel(build("gpt2"), 2)
    c_attn = plan.by_name()["transformer.h.0.attn.c_attn"]
    assert (c_attn.style, c_attn.parts, c_attn.conv1d) == (Style.COLUMN, 3, True)
    # rank 1 keeps the second half of each of q, k and v (64 wide each)
    assert split_ranges(c_attn, 2, 1) == [(32, 64), (96, 128), (160, 192)]
    attrs = {(a.module, a.attr): a.local for a in plan.attrs}
    assert attrs[("transformer.h.0.attn", "num_heads")] == 2
    assert attrs[("transformer.h.0.attn", "split_size")] == 32


def test_t5_relative_bias_is_split_by_heads_and_policy_matches_auto():
    model = build("t5")
    auto = plan_tensor_parallel(model, 4)
    heads = [s for s in auto.layers if s.style is Style.HEAD_EMBEDDING]
    assert [s.name for s in heads] == ["encoder.block.0.layer.0.SelfAttention.relative_attention_bias",
                                       "decoder.block.0.layer.0.SelfAttention.relative_attention_bias"]
    explicit = plan_tensor_parallel(model, 4, policy("t5"))
    assert explicit.by_name() == auto.by_name()
    assert explicit.source == "injection_policy"


def test_shard_maths():
    assert vocab_range(1000, 3, 0) == (0, 334, 334)
    assert vocab_range(1000, 3, 2) == (668, 1000, 334)  # last rank padded by 2 rows
    row = LayerShard("x", Style.ROW, 256, 64)
    assert split_ranges(row, 4, 3) == [(192, 256)]


@pytest.mark.parametrize("kind,tp,message", [
    ("gpt2_6heads", 4, "does not divide the 6 heads"),
    ("llama_kv2", 4, "does not divide the 2 heads that model.layers.0.self_attn.k_proj projects to"),
])
def test_uneven_heads_are_refused(kind, tp, message):
    model = build("gpt2", n_head=6, n_embd=48) if kind == "gpt2_6heads" else build("llama", num_key_value_heads=2)
    with pytest.raises(InferenceConfigError, match=message):
        plan_tensor_parallel(model, tp)


def test_policy_naming_a_missing_module_is_refused():
    from transformers.models.t5.modeling_t5 import T5Block

    model = build("t5")
    with pytest.raises(InferenceConfigError, match=r"no module named 'SelfAttention.oo' in T5Block; did you "
                                                    r"mean 'layer.0.SelfAttention.o'"):
        plan_tensor_parallel(model, 2, {T5Block: ("SelfAttention.oo",)})
    with pytest.raises(InferenceConfigError, match="the model has no GPT2Block module"):
        plan_tensor_parallel(model, 2, {"GPT2Block": ("attn.c_proj",)})
    with pytest.raises(InferenceConfigError, match="is a T5LayerNorm, not a Linear"):
        plan_tensor_parallel(model, 2, {T5Block: ("layer.0.layer_norm",)})
    # checked even at tp 1 (nothing to split, but the policy still names the model's modules)
    with pytest.raises(InferenceConfigError, match="SelfAttention.oo"):
        deepspeed.init_inference(model, injection_policy={T5Block: ("SelfAttention.oo",)}, dtype=torch.float)


def test_config_parsing_follows_deepspeed_names():
    cfg = parse_inference_config({"dtype": "fp16", "tensor_parallel": {"tp_size": 1}}, {"max_tokens": 64})
    assert (cfg.dtype, cfg.tp_size, cfg.max_out_tokens) == (torch.float16, 1, 64)
    assert parse_inference_config(None, {"mp_size": 4}).tp_size == 4
    assert parse_inference_config().dtype == torch.float16  # DeepSpeed's default
    for setting in ((True, 8), (8, True)):  # the seed writes (groups, extra); DeepSpeed's code (extra, groups)
        cfg = parse_inference_config(None, {"dtype": torch.int8, "quantization_setting": setting})
        assert (cfg.quant.weight.q_groups, cfg.mlp_extra_grouping) == (8, True)
    for bad, message in [
        ({"dtype": torch.int16}, "dtype torch.int16 is not supported"),
        ({"dtype": "fp8"}, "dtype 'fp8' is not supported"),
        ({"mp_sise": 2}, "unknown argument 'mp_sise'; did you mean 'mp_size'"),
        ({"mp_size": 2, "tensor_parallel": {"tp_size": 4}}, "mp_size=2 disagrees with tensor_parallel.tp_size=4"),
        ({"enable_cuda_graph": True}, "enable_cuda_graph=True is not supported"),
        ({"quant": {"weight": {"num_bits": 4}}}, "only 8-bit weights"),
        ({"max_out_tokens": 0}, "max_out_tokens: must be a positive int"),
    ]:
        with pytest.raises(InferenceConfigError, match=message):
            parse_inference_config(None, bad)
    with pytest.raises(InferenceConfigError, match="dtype is 'fp16' in config but"):
        parse_inference_config({"dtype": "fp16"}, {"dtype": torch.float})


def test_int8_rounding_error_is_at_most_half_a_step():
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(0))
    for group in (16, 64, 128):
        q, scale = quantize_int8(w, group)
        assert q.dtype == torch.int8 and scale.shape == (48, 128 // group)
        err = (dequantize_int8(q, scale, torch.float32) - w).abs().reshape(48, -1, group)
        assert (err <= scale.unsqueeze(-1) / 2 + 1e-7).all()
    assert group_size_for(768, 384, None) == 64
    assert group_size_for(64, 16, None) == 16  # cut down to the shard's width
    assert group_size_for(256, 64, 4) == 64 and group_size_for(256, 64, 4, extra_grouping=True) == 32


def test_int8_kernel_equals_the_torch_op(monkeypatch):
    from dslaunch.runtime.inference import int8_kernel

    assert int8_kernel.kernel_isa() in ("avx512", "avx2", "scalar")  # CI has a compiler: it must build
    g = torch.Generator().manual_seed(0)
    for rows, n, k, group in ((1, 96, 64, 64), (3, 40, 48, 16), (2, 7, 40, 40), (16, 33, 128, 32)):
        q, scale = quantize_int8(torch.randn(n, k, generator=g), group)
        x = torch.randn(rows, k, generator=g)
        reference = torch.nn.functional.linear(x, dequantize_int8(q, scale, torch.float32))
        kernel = int8_kernel._kernel(x, q, scale, group)
        assert kernel is not None and torch.allclose(kernel, reference, rtol=1e-5, atol=1e-5)
    x = torch.randn(17, 64, generator=g)  # more rows than a decode step: the torch op
    assert int8_kernel._kernel(x, q, scale, 32) is None
    monkeypatch.setenv("DSLAUNCH_INT8_KERNEL", "0")
    assert int8_kernel._kernel(torch.randn(1, 128), q, scale, 32) is None


def test_single_process_engine_runs_the_module_in_each_dtype():
    ids = prompt()
    ref = logits(build("gpt2"), ids)
    engine = deepspeed.init_inference(build("gpt2"), dtype=torch.float)
    assert isinstance(engine, deepspeed.InferenceEngine)
    assert torch.equal(engine(input_ids=ids).logits, ref)  # tp 1 fp32: the model itself
    assert engine.config.n_embd == 64 and engine.device.type == "cpu"  # attributes fall through to the module
    for dtype, tol in ((torch.bfloat16, 0.1), (torch.float16, 0.02)):
        engine = deepspeed.init_inference(build("gpt2"), dtype=dtype)
        assert all(p.dtype == dtype for p in engine.module.parameters())
        assert (engine(input_ids=ids).logits.float() - ref).abs().max() < tol
    with pytest.raises(deepspeed.inference.MaxTokensError, match="exceed max_out_tokens=20"):
        deepspeed.init_inference(build("gpt2"), dtype=torch.float, max_out_tokens=20).generate(
            ids, max_new_tokens=15)


def test_checkpoint_forms_load_into_a_meta_model(tmp_path):
    """DeepSpeed's inference json, a training checkpoint folder (`latest`, `module` wrapper), a Hugging
    Face save_pretrained folder (safetensors) and a plain state_dict all fill a meta-device model."""
    import json

    from dslaunch.runtime.checkpoint import CheckpointError

    ref = build("gpt2")
    sd = ref.state_dict()
    keys = sorted(sd)
    torch.save({k: sd[k] for k in keys[: len(keys) // 2]}, tmp_path / "part1.pt")
    torch.save({k: sd[k] for k in keys[len(keys) // 2:]}, tmp_path / "part2.pt")
    (tmp_path / "ds.json").write_text(json.dumps({"type": "ds_model", "checkpoints": ["part1.pt", "part2.pt"],
                                                  "version": 1.0}))
    (tmp_path / "train" / "step5").mkdir(parents=True)
    (tmp_path / "train" / "latest").write_text("step5")
    torch.save({"module": sd, "global_steps": 5}, tmp_path / "train" / "step5" / "mp_rank_00_model_states.pt")
    ref.save_pretrained(tmp_path / "hf")
    torch.save(sd, tmp_path / "plain.bin")
    expected = logits(ref, prompt())
    for form in ("ds.json", "train", "hf", "plain.bin"):
        with deepspeed.OnDevice(dtype=torch.float, device="meta"):
            skeleton = build("gpt2", seed=7)
        engine = deepspeed.init_inference(skeleton, dtype=torch.float, checkpoint=str(tmp_path / form))
        assert torch.allclose(logits(engine.module, prompt()), expected, atol=1e-6), form
        assert engine.module.lm_head.weight is engine.module.transformer.wte.weight  # the tie survives
    with deepspeed.OnDevice(dtype=torch.float, device="meta"):
        skeleton = build("gpt2")
    with pytest.raises(CheckpointError, match="the checkpoint lacks .* tensors of a meta-device model"):
        deepspeed.init_inference(skeleton, dtype=torch.float, checkpoint=str(tmp_path / "part1.pt"))
    (tmp_path / "mega.json").write_text(json.dumps({"type": "Megatron", "checkpoints": ["x"], "version": 1}))
    with pytest.raises(CheckpointError, match="checkpoint type 'Megatron' is not supported"):
        deepspeed.init_inference(build("gpt2"), dtype=torch.float, checkpoint=str(tmp_path / "mega.json"))
    with pytest.raises(CheckpointError, match="missing.pt: checkpoint file not found"):
        deepspeed.init_inference(build("gpt2"), dtype=torch.float, checkpoint=str(tmp_path / "missing.pt"))


def test_on_device_cpu_casts_the_dtype_and_keeps_ties():
    """OnDevice(dtype=torch.half, device="cpu"), as DeepSpeed's test_init_on_device builds a
    model: parameters already on the device still take the dtype; a tied weight stays one tensor."""
    import dslaunch.runtime as ds

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = torch.nn.Embedding(8, 4)
            self.head = torch.nn.Linear(4, 8, bias=False)
            self.head.weight = self.wte.weight
            self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    with ds.OnDevice(dtype=torch.half, device="cpu"):
        model = Tied()
    assert {(p.device.type, p.dtype) for p in model.parameters()} == {("cpu", torch.half)}
    assert model.head.weight is model.wte.weight and model.steps.dtype == torch.long


@pytest.mark.parametrize("how, message", [
    ("dotdot", "\"checkpoints\" entry '../outside.pt' leads outside {work}; a checkpoint descriptor may name only "
               "files under its base_dir (pass init_inference(base_dir=...) to choose that folder)"),
    ("absolute", "\"checkpoints\" entry '{tmp}/outside.pt' leads outside {work}"),
    ("base_dir", "base_dir '{tmp}' leads outside {work}"),
    ("list", "{work}/ds.json: checkpoint descriptor must be a JSON object, not a JSON list"),
    ("fifo", "{work}/ds.json: checkpoint descriptor is a FIFO, not a regular file"),
    ("latest", "{work}/train/latest names '../x', which contains a path separator; refusing to follow it"),
    ("index", "{work}/hf/model.safetensors.index.json: \"weight_map\" file '../outside.safetensors' leads outside "
              "{work}/hf"),
])
@pytest.mark.timeout(120)
def test_checkpoint_descriptors_cannot_lead_outside_their_folder(tmp_path, how, message):
    """A descriptor, `latest` or safetensors index names files by `..` or an absolute path:
    all were followed (a full model loaded from outside); a list descriptor was an
    AttributeError and a FIFO hung. One line each, the same rule the training loader keeps."""
    import json

    from safetensors.torch import save_file

    from dslaunch.runtime.checkpoint import CheckpointError

    work = tmp_path / "work"
    work.mkdir()
    sd = build("gpt2").state_dict()
    torch.save(sd, tmp_path / "outside.pt")  # a complete model: the old loader took it without a word
    descriptor = work / "ds.json"
    target = str(descriptor)
    if how in ("dotdot", "absolute", "base_dir"):
        entry = {"dotdot": "../outside.pt", "absolute": str(tmp_path / "outside.pt"), "base_dir": "outside.pt"}[how]
        body = {"type": "ds_model", "checkpoints": [entry], "version": 1.0}
        if how == "base_dir":
            body["base_dir"] = str(tmp_path)
        descriptor.write_text(json.dumps(body))
    elif how == "list":
        descriptor.write_text(json.dumps([{"type": "ds_model", "checkpoints": ["../outside.pt"]}]))
    elif how == "fifo":
        os.mkfifo(descriptor)  # nobody writes to it
    elif how == "latest":
        (work / "train").mkdir()
        (work / "train" / "latest").write_text("../x")
        (work / "x").mkdir()
        torch.save({"module": sd}, work / "x" / "mp_rank_00_model_states.pt")
        target = str(work / "train")
    else:
        (work / "hf").mkdir()
        save_file({k: v.clone().contiguous() for k, v in sd.items()}, work / "outside.safetensors")
        (work / "hf" / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": {k: "../outside.safetensors" for k in sd}}))
        target = str(work / "hf")
    with deepspeed.OnDevice(dtype=torch.float, device="meta"):
        skeleton = build("gpt2", seed=7)
    with pytest.raises(CheckpointError) as info:
        deepspeed.init_inference(skeleton, dtype=torch.float, checkpoint=target)
    text = str(info.value)
    assert message.format(work=work, tmp=tmp_path) in text and "\n" not in text, text


def test_init_inference_base_dir_chooses_the_folder_a_descriptor_may_name(tmp_path):
    """The script, not the descriptor, widens the folder: base_dir=... names it."""
    import json

    ref = build("gpt2")
    torch.save(ref.state_dict(), tmp_path / "outside.pt")
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "ds.json").write_text(json.dumps({"type": "ds_model", "checkpoints": ["outside.pt"]}))
    with deepspeed.OnDevice(dtype=torch.float, device="meta"):
        skeleton = build("gpt2", seed=7)
    engine = deepspeed.init_inference(skeleton, dtype=torch.float, checkpoint=str(tmp_path / "work" / "ds.json"),
                                      base_dir=str(tmp_path))
    assert torch.allclose(logits(engine.module, prompt()), logits(ref, prompt()), atol=1e-6)
