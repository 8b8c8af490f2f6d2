"""shard_model_for_training on tiny Hugging Face models (built from configs, fp32, dropout 0)
against the unsharded model on one process.

One 2-rank gloo job (tp=2, the group from tensor_parallel_group) shards, per case, a copy of
the same model: Llama and Mistral through their own Hugging Face tp plan, Llama through a
DeepSpeed-style partition_config, GPT-2 (Conv1D, tied LM head), T5 (relative-position heads,
embeddings shared by three modules), GPT-Neo, GPT-J and BERT through the structural plan. For each: logits and loss equal the unsharded model's, the gradients and,
after one SGD step taken by each rank on its own shards, the weights reassembled by
full_state_dict equal the one-process ones (1e-5). (Not Adam: its first step is lr * g/|g|,
which turns fp32 rounding in the gradients of near-zero entries into visible differences.) The flight record of Llama's forward and backward shows every
collective on the tensor group. It also checks that ranks seeded differently shard rank 0's
model, that a full state dict loads into a sharded model (load_full_state_dict), the RNG
convention (model_parallel_cuda_manual_seed), and that tensor_parallel_group refuses a size
that does not divide the world.

Single-process tests: the plans (which layer is split how) and the one-line errors, also
as a script's exit status 2.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import repo_paths

sys.path.insert(0, str(repo_paths.TESTS))

from dist_harness import run_function  # noqa: E402


def _last_seqs(comm):
    """The last sequence number per group in this rank's flight record (a ring of 64 entries)."""
    last = {}
    for e in comm.flight_record():
        last[e["group"]] = max(last.get(e["group"], 0), e["seq"])
    return last


def _since(comm, last):
    return [e for e in comm.flight_record() if e["seq"] > last.get(e["group"], 0)]

pytest.importorskip("transformers", reason="the [hf] extra (scripts/setup_env.sh installs it)")

TOL = 1e-5
NO_DROPOUT = {"gpt2": dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), "llama": {}, "mistral": {},
              "t5": dict(dropout_rate=0.0), "gpt_neo": dict(embed_dropout=0.0, attention_dropout=0.0, resid_dropout=0.0),
              "gptj": dict(embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0),
              "bert": dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)}
LLAMA_SPECS = {
    "layer_specs": [
        {"patterns": [r".*\.self_attn\.o_proj\.weight$", r".*\.mlp\.down_proj\.weight$"], "partition_type": "row"},
        {"patterns": [r".*\.self_attn\.[qkv]_proj\.weight$", r".*\.mlp\.(gate|up)_proj\.weight$"],
         "partition_type": "column"},
        {"patterns": [r".*lm_head\.weight$"], "partition_type": "column", "gather_output": True},
        {"patterns": [r".*embed_tokens\.weight$"], "partition_type": "row"},
    ],
}
CASES = {"llama/hf-plan": ("llama", None), "llama/partition_config": ("llama", LLAMA_SPECS),
         "mistral/hf-plan": ("mistral", None), "gpt2/automatic": ("gpt2", None), "t5/automatic": ("t5", None),
         "gpt_neo/automatic": ("gpt_neo", None), "gptj/automatic": ("gptj", None), "bert/automatic": ("bert", None)}


def _autotp_job():
    import copy

    import torch

    from dslaunch.runtime import comm
    from dslaunch.runtime.activation_checkpointing.checkpointing import (get_cuda_rng_tracker,
                                                                         model_parallel_cuda_manual_seed)
    from dslaunch.runtime.tensor_parallel import (TensorParallelError, full_state_dict, is_tensor_parallel_shard,
                                                  load_full_state_dict, shard_model_for_training,
                                                  tensor_parallel_group)
    from inference_models import build, prompt

    tpg = tensor_parallel_group(2)
    ids = prompt(batch=2, length=8)
    out = {}

    def forward(model, kind):
        return model(input_ids=ids, labels=ids)

    for case, (kind, spec) in CASES.items():
        ref = build(kind, **NO_DROPOUT[kind]).train()
        model = copy.deepcopy(ref)
        plan = shard_model_for_training(model, tpg.group, tpg.size, tpg.rank, partition_config=spec)
        before = _last_seqs(comm)
        got = forward(model, kind)
        got.loss.backward()
        record = _since(comm, before)
        want = forward(ref, kind)
        want.loss.backward()
        grads = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}
        for n, p in model.named_parameters():  # reassemble the gradients like parameters
            p.data, grads[n] = grads[n], p.data
        full_grads = full_state_dict(model)
        for n, p in model.named_parameters():
            p.data = grads[n]
        dense_grads = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in ref.named_parameters()}
        grad_diff = max(((full_grads[k] - g).abs().max().item(), k) for k, g in dense_grads.items())
        for m in (ref, model):  # one SGD step, each rank on its own shards
            torch.optim.SGD(m.parameters(), lr=0.1).step()
        full, dense = full_state_dict(model), ref.state_dict()
        worst = max(((full[k] - dense[k]).abs().max().item(), k) for k in dense)
        out[case] = {
            "plan": plan.summary(),
            "kinds": sorted({d.kind for d in plan.decisions}),
            "logits": (got.logits - want.logits).abs().max().item(),
            "loss": abs(got.loss.item() - want.loss.item()),
            "grads": grad_diff,
            "weights after step": worst,
            "same keys": sorted(full) == sorted(dense),
            "local params": sum(p.numel() for p in model.parameters()),
            "full params": sum(p.numel() for p in ref.parameters()),
            "collectives": sorted({(e["op"], e["group"]) for e in record}),
            "collective count": len(record),
            "marked": all(is_tensor_parallel_shard(p) == (p.numel() < dense_grads[n].numel())
                          for n, p in model.named_parameters()),
        }

    # ranks that built the model with different seeds shard rank 0's model (broadcast first)
    ref = build("llama", seed=1).train()  # what the group's rank 0 builds
    model = build("llama", seed=1 + tpg.rank).train()
    shard_model_for_training(model, tpg.group, tpg.size, tpg.rank)
    out["different seeds"] = abs(forward(model, "llama").loss.item() - forward(ref, "llama").loss.item())

    # a full state dict loaded into a sharded model (resuming at another tp size): each rank cuts its slices
    for kind in ("gpt2", "t5"):
        ref = build(kind, seed=7, **NO_DROPOUT[kind]).train()
        model = build(kind, seed=8, **NO_DROPOUT[kind]).train()
        shard_model_for_training(model, tpg.group, tpg.size, tpg.rank)
        load_full_state_dict(model, ref.state_dict())
        out[f"load full {kind}"] = abs(forward(model, kind).loss.item() - forward(ref, kind).loss.item())
    try:
        load_full_state_dict(model, {k: v for k, v in ref.state_dict().items() if k != "lm_head.weight"})
    except TensorParallelError as exc:
        out["load error"] = str(exc)

    # partition_config's grad_allreduce: a replicated parameter's gradient summed over the group
    # (here a norm whose every rank already has the full gradient, so the sum is twice it)
    ref = build("llama").train()
    model = copy.deepcopy(ref)
    spec = {"layer_specs": LLAMA_SPECS["layer_specs"] + [
        {"patterns": [r"model\.norm\.weight$"], "partition_type": "skip", "grad_allreduce": True}]}
    plan = shard_model_for_training(model, tpg.group, tpg.size, tpg.rank, partition_config=spec)
    forward(model, "llama").loss.backward()
    forward(ref, "llama").loss.backward()
    out["grad_allreduce"] = {"names": plan.grad_allreduce,
                             "ratio": (model.model.norm.weight.grad / ref.model.norm.weight.grad).tolist()[:4]}

    # Megatron's seeds: the default generator agrees across the group, the tracker's differs
    model_parallel_cuda_manual_seed(1234)
    replicated = torch.rand(4)
    with get_cuda_rng_tracker().fork():
        sharded = torch.rand(4)
    torch.manual_seed(1234)
    expect_default = torch.rand(4)
    torch.manual_seed(1234 + 2718 + tpg.rank)
    expect_tracked = torch.rand(4)
    out["rng"] = {"replicated": replicated.tolist(), "sharded": sharded.tolist(),
                  "default ok": torch.equal(replicated, expect_default),
                  "tracked ok": torch.equal(sharded, expect_tracked)}
    from dslaunch.runtime.tensor_parallel import groups

    groups.reset()
    try:
        tensor_parallel_group(3)
    except TensorParallelError as exc:
        out["world error"] = str(exc)
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return run_function(_autotp_job, nprocs=2, timeout=300)


@pytest.mark.parametrize("case", list(CASES))
def test_sharded_model_trains_like_the_unsharded_one(two_ranks, case):
    for r in two_ranks:
        res = r[case]
        assert res["same keys"], res
        assert res["logits"] < TOL and res["loss"] < TOL, res
        assert res["grads"][0] < TOL, res["grads"]
        assert res["weights after step"][0] < TOL, res["weights after step"]
        assert res["local params"] < 0.75 * res["full params"], res  # really sharded
        assert res["marked"]  # exactly the split parameters carry tensor_model_parallel
    assert two_ranks[0][case]["plan"] == two_ranks[1][case]["plan"]


def test_plans_use_the_expected_layer_kinds(two_ranks):
    kinds = {case: two_ranks[0][case]["kinds"] for case in CASES}
    assert kinds["llama/hf-plan"] == ["column", "row", "vocab-head"]  # embed_tokens replicated, lm_head gathered
    assert kinds["llama/partition_config"] == ["column", "row", "vocab-embedding", "vocab-head"]
    assert kinds["gpt2/automatic"] == ["column", "row", "vocab-embedding", "vocab-head"]  # tied, both split
    assert "head-embedding" in kinds["t5/automatic"]
    assert kinds["mistral/hf-plan"] == kinds["llama/hf-plan"]
    for case in ("gpt_neo/automatic", "gptj/automatic", "bert/automatic"):
        assert {"column", "row"} <= set(kinds[case]), (case, kinds[case])
    assert "the model's Hugging Face tp plan" in two_ranks[0]["llama/hf-plan"]["plan"]


def test_every_collective_runs_on_the_tensor_group(two_ranks):
    for case in CASES:
        ops = two_ranks[0][case]["collectives"]
        # the tensor axis of a mesh over these 2 ranks at tp 2 spans the world: the mesh uses
        # the default group itself for it (an axis over every rank is the world, not a copy)
        assert ops and {g for _, g in ops} == {"world"}, (case, ops)
    # Llama via its tp plan, 2 layers: forward 2 row sums per layer + the LM head's gather;
    # backward one all-reduce per column layer's input (q, k, v, gate, up) + the LM head's
    assert two_ranks[0]["llama/hf-plan"]["collective count"] == 2 * 2 + 1 + 2 * 5 + 1


def test_ranks_built_with_different_seeds_shard_rank_zeros_model(two_ranks):
    assert two_ranks[0]["different seeds"] < TOL and two_ranks[1]["different seeds"] < TOL


def test_a_full_state_dict_loads_into_a_sharded_model(two_ranks):
    for r in two_ranks:
        assert r["load full gpt2"] < TOL and r["load full t5"] < TOL, r
    assert two_ranks[0]["load error"] == ("tensor parallel: the state dict lacks lm_head.weight (1 missing, "
                                          "0 unexpected)")


def test_grad_allreduce_sums_a_replicated_gradient_over_the_group(two_ranks):
    for r in two_ranks:
        assert r["grad_allreduce"]["names"] == ["model.norm.weight"]
        assert r["grad_allreduce"]["ratio"] == pytest.approx([2.0] * 4, rel=1e-5)


def test_model_parallel_seed_agrees_where_replicated_and_differs_where_sharded(two_ranks):
    a, b = two_ranks[0]["rng"], two_ranks[1]["rng"]
    assert a["default ok"] and b["default ok"] and a["tracked ok"] and b["tracked ok"]
    assert a["replicated"] == b["replicated"] and a["sharded"] != b["sharded"]


def test_tp_size_must_divide_the_world(two_ranks):
    assert two_ranks[0]["world error"] == "tensor parallel: tp size 3 does not divide the world size 2"


# ---------------------------------------------------------------- one process: plans and errors

def _plan(kind, tp, spec=None, **overrides):
    from dslaunch.runtime.tensor_parallel import plan_training_shards
    from inference_models import build

    return plan_training_shards(build(kind, **overrides), tp, spec)


def test_llama_plan_divides_attention_attributes_and_splits_grouped_query_heads():
    plan = _plan("llama", 4)
    by_name = {d.name: d.kind for d in plan.decisions}
    assert by_name["model.layers.0.self_attn.k_proj"] == "column" and by_name["lm_head"] == "vocab-head"
    assert "model.embed_tokens" not in by_name


@pytest.mark.parametrize("kind,tp,spec,overrides,message", [
    ("llama", 8, None, {}, "tensor parallel: tp size 8 does not divide the 4 heads that model.layers.0.self_attn.k_proj "
                           "projects to (LlamaAttention)"),
    ("llama", 2, None, dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=3),
     "tensor parallel: tp size 2 does not divide the 3 heads that model.layers.0.self_attn.k_proj projects to "
     "(LlamaAttention)"),
    ("gpt2", 2, None, dict(n_embd=48, n_head=3),
     "tensor parallel: tp size 2 does not divide the 3 heads that transformer.h.0.attn.c_attn projects to "
     "(GPT2Attention)"),
    ("llama", 2, {"layer_specs": [{"patterns": [r".*\.attn\.c_proj\.weight$"], "partition_type": "row"}]}, {},
     "tensor parallel: partition_config.layer_specs[0]: pattern '.*\\\\.attn\\\\.c_proj\\\\.weight$' matches no "
     "parameter of LlamaForCausalLM (names look like 'model.embed_tokens.weight')"),
    ("llama", 2, {"layer_specs": [{"patterns": ["x"], "partition": "row"}]}, {},
     "tensor parallel: partition_config.layer_specs[0]: unknown key 'partition'"),
    ("llama", 2, {"layer_specs": [{"patterns": ["x"], "partition_type": "diagonal"}]}, {},
     "tensor parallel: partition_config.layer_specs[0].partition_type: 'diagonal' is not one of column, row, skip"),
    ("llama", 2, {"layer_specs": [{"patterns": [r".*down_proj\.weight$"], "partition_type": "row"}],
                  "strict_mode": True}, {}, "tensor parallel: partition_config: strict_mode and no spec matches"),
    ("llama", 2, {"layer_specs": LLAMA_SPECS["layer_specs"], "tp_size": 4}, {},
     "tensor parallel: partition_config.tp_size is 4 but the tensor-parallel size is 2"),
])
def test_what_cannot_be_split_is_one_line(kind, tp, spec, overrides, message):
    from dslaunch.runtime.tensor_parallel import TensorParallelError

    with pytest.raises(TensorParallelError) as info:
        _plan(kind, tp, spec, **overrides)
    text = str(info.value)
    assert text.startswith(message) and "\n" not in text, text


def test_fused_shape_specs():
    from dslaunch.runtime.tensor_parallel import TensorParallelError, parse_partition_config

    cfg = parse_partition_config({"layer_specs": [{"patterns": ["a"], "shape": [[32, 16, 16], -1],
                                                   "partition_dim": 0}]})
    assert cfg.layer_specs[0].part_widths(64, "qkv") == (32, 16, 16)
    cfg = parse_partition_config({"layer_specs": [{"patterns": ["a"], "shape": [2, -1]}]})
    assert cfg.layer_specs[0].part_widths(64, "gate_up") == (32, 32)
    with pytest.raises(TensorParallelError, match="partition_dim: 1 is not supported for a column layer"):
        parse_partition_config({"layer_specs": [{"patterns": ["a"], "partition_dim": 1}]})


def test_a_script_gets_one_line_and_exit_2(tmp_path):
    script = tmp_path / "bad_tp.py"
    script.write_text(textwrap.dedent(f'''
        import sys
        sys.path.insert(0, {str(repo_paths.TESTS)!r})
        import dslaunch.runtime as deepspeed
        from inference_models import build
        deepspeed.tensor_parallel.plan_training_shards(build("gpt2", n_embd=48, n_head=3), 2)
    '''))
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines() == [
        "error: tensor parallel: tp size 2 does not divide the 3 heads that transformer.h.0.attn.c_attn projects to "
        "(GPT2Attention)"]
