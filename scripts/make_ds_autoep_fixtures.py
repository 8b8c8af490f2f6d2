"""Make tests/data/ds_autoep/expected.json with real DeepSpeed (0.19.8, CPU, gloo): the losses of
tiny Hugging Face MoE models trained with AutoEP (the `expert_parallel` config section).

    DS_ACCELERATOR=cpu python scripts/make_ds_autoep_fixtures.py [--cases a,b]

with a Python that has DeepSpeed 0.19.8 and transformers 5.17.0 (the DeepSpeed venv has no
transformers; a venv whose .pth file adds the DeepSpeed venv's site-packages, with
transformers installed into it, keeps that venv unchanged).

`train` is the training script both engines run (tests/runtime/moe/test_autoep.py runs it with
`import dslaunch.runtime as deepspeed`). The models are transformers' own classes built from
small configs (2 layers, hidden 32, 4 experts, top-2, no hub access), every parameter given a
value of its own by name. The router is rigged as in make_ds_hf_moe_fixtures.py: token
embeddings carry +-3 in channel 0 (+ for ids in the upper half of the vocabulary) and every MoE
layer's router scores expert 3 by 10 x channel 0; even parts (ranks, or micro-batches of one
process) read lower-half ids only, so expert 3 gets no tokens from them and the all-to-alls send
empty blocks at every step.

Models (transformers 5.17.0 classes):
  mixtral, qwen2_moe (+ shared expert and its gate), qwen3_moe, olmoe (no norm of the top-k;
  DeepSpeed has no OLMoE preset and tries them all, which is ambiguous: preset_model "mixtral"),
  deepseek_v3 (sigmoid scores, e_score_correction_bias, 2 expert groups choosing 1, scaled
  routing, shared expert, a dense first layer): the multi-rank cases
  deepseek_v2, qwen3_5_moe (its text model), minimax_m3 (its text model: clamped SwiGLU,
  sigmoid scores), olmoe_aux (OLMoE with its load-balancing loss; DeepSpeed fails there,
  DS_FAILS): one process with autoep_size 1
Every model but olmoe and the DeepSeeks adds the load-balancing loss (output_router_logits).
Cases:
  {m}_one{N}      the unmodified model on one process, the N parts as gradient-accumulation
                  micro-batches: what N ranks must reproduce (no AutoEP)
  {m}_ep1         AutoEP with autoep_size 1 on one process (2 parts)
  {m}_ep2_s{Z}    2 ranks, autoep_size 2, ZeRO Z (0, 1, 2)
  {m}_ep4_s2      4 ranks, autoep_size 4, ZeRO 2
  {m}_ep4_s{0,1}  the same at ZeRO 0 and 1, for Mixtral and DeepSeek-V3 (EP4_ALL_STAGES)
  mixtral_w4_ep2_s1   4 ranks, autoep_size 2 (two expert-data-parallel replicas), ZeRO 1
  {m}_one2_muon, {m}_ep1_s{Z}_muon, {m}_ep2_s{Z}_muon   Mixtral and DeepSeek-V3 with Muon
                  (MUON says why the reference is AutoEP at size 1)
  {m}_ep1g4_s2_muon, {m}_ep4_s2_muon   the same at autoep_size 4, ZeRO 2 (reference: 4 parts)
A case's losses are averaged over ranks or micro-batches. DeepSpeed's ZeRO-0 runs with expert
parallelism differ from its one-process run (its ZeRO-0 gradient norm under expert parallelism;
the same as for deepspeed.moe, see docs/moe.md): their losses are recorded as they come.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OUT = os.path.join(ROOT, "tests", "data", "ds_autoep")

VOCAB, HIDDEN, EXPERTS, TOP_K, SEQ, ROWS, STEPS = 64, 32, 4, 2, 8, 2, 3
RIGGED_EXPERT = 3
EP_MODELS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3")
EP4_ALL_STAGES = ("mixtral", "deepseek_v3")
MUON_MODELS = ("mixtral", "deepseek_v3")
ONE_MODELS = ("deepseek_v2", "qwen3_5_moe", "minimax_m3", "olmoe_aux")
# DeepSpeed has no OLMoE preset; every other model is found by model_type
PRESET = {"olmoe": "mixtral", "olmoe_aux": "mixtral"}
# DeepSpeed 0.19.8 fails here: the load-balancing loss finds no router logits (IndexError), as its
# AutoEP layer replaces OLMoE's router and re-points only Mixtral's and Qwen's recorders
DS_FAILS = {"olmoe_aux_ep1"}
# DeepSpeed 0.19.8 trains another loss here: its layer hands Qwen3.5's load-balancing loss the
# router's softmax probabilities where the model records logits (the loss takes a softmax again)
DS_DIFFERS = {"qwen3_5_moe_ep1"}

# Muon (muon_lr for the matrices, adam_lr for the rest). AutoEP's experts are 3-D [experts, out,
# in] tensors marked is_expert_group: Newton-Schulz runs on each expert's matrix, and on w1 (gate)
# and w3 (up) apart, where the Hugging Face model's fused gate_up_proj [experts, 2 x ffn, hidden]
# is orthogonalised as one matrix per expert; so with Muon, AutoEP trains another model than the
# unmodified one ({m}_one2_muon records it), and a case's reference is AutoEP at size 1 on one
# process, at the same ZeRO stage (stages 1-2 clip the orthogonalised update, stage 0 the gradient).
MUON = {"type": "Muon", "params": {"muon_lr": 0.02, "adam_lr": 0.003, "momentum": 0.9, "weight_decay": 0.0}}

CASES = {}
for _m in EP_MODELS + ONE_MODELS:
    CASES[f"{_m}_one2"] = dict(model=_m, world=1, gas=2, stage=0, ep=None)
    CASES[f"{_m}_ep1"] = dict(model=_m, world=1, gas=2, stage=0, ep=1)
for _m in EP_MODELS:
    CASES[f"{_m}_one4"] = dict(model=_m, world=1, gas=4, stage=0, ep=None)
    for _z in (0, 1, 2):
        CASES[f"{_m}_ep2_s{_z}"] = dict(model=_m, world=2, gas=1, stage=_z, ep=2)
    CASES[f"{_m}_ep4_s2"] = dict(model=_m, world=4, gas=1, stage=2, ep=4)
for _m in EP4_ALL_STAGES:  # ep 4 at every stage for two families (the others at ZeRO 2 only: test time)
    for _z in (0, 1):
        CASES[f"{_m}_ep4_s{_z}"] = dict(model=_m, world=4, gas=1, stage=_z, ep=4)
CASES["mixtral_w4_ep2_s1"] = dict(model="mixtral", world=4, gas=1, stage=1, ep=2)
for _m in MUON_MODELS:
    CASES[f"{_m}_one2_muon"] = dict(model=_m, world=1, gas=2, stage=0, ep=None, muon=True)
    for _z in (0, 1, 2):
        CASES[f"{_m}_ep1_s{_z}_muon"] = dict(model=_m, world=1, gas=2, stage=_z, ep=1, muon=True)
        CASES[f"{_m}_ep2_s{_z}_muon"] = dict(model=_m, world=2, gas=1, stage=_z, ep=2, muon=True)
    # ep 4 at ZeRO 2, against AutoEP at size 1 over the same 4 micro-batches
    CASES[f"{_m}_ep1g4_s2_muon"] = dict(model=_m, world=1, gas=4, stage=2, ep=1, muon=True)
    CASES[f"{_m}_ep4_s2_muon"] = dict(model=_m, world=4, gas=1, stage=2, ep=4, muon=True)


def reference(name: str) -> str:
    """The one-process case a case must equal."""
    job = CASES[name]
    if job.get("muon"):  # AutoEP at size 1, same stage, same micro-batches: see MUON
        g4 = "g4" if job["world"] * job["gas"] == 4 else ""
        return f"{job['model']}_ep1{g4}_s{job['stage']}_muon"
    return f"{job['model']}_one{job['world'] * job['gas']}"


def hf_config(model: str):
    import transformers as t

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32, num_experts_per_tok=TOP_K,
                  tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=None)
    aux = dict(output_router_logits=True, router_aux_loss_coef=0.01)  # the load-balancing loss, from the router
    mla = dict(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
               n_routed_experts=EXPERTS, n_shared_experts=1, moe_intermediate_size=24,
               intermediate_size=48, first_k_dense_replace=1)
    cfg = {
        "mixtral": lambda: t.MixtralConfig(intermediate_size=24, num_local_experts=EXPERTS, router_jitter_noise=0.0,
                                           **aux, **common),
        "qwen2_moe": lambda: t.Qwen2MoeConfig(intermediate_size=48, moe_intermediate_size=24,
                                              shared_expert_intermediate_size=24, num_experts=EXPERTS,
                                              decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                                              **aux, **common),
        "qwen3_moe": lambda: t.Qwen3MoeConfig(intermediate_size=48, moe_intermediate_size=24, num_experts=EXPERTS,
                                              decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                                              head_dim=8, **aux, **common),
        "olmoe": lambda: t.OlmoeConfig(intermediate_size=24, num_experts=EXPERTS, norm_topk_prob=False, **common),
        "olmoe_aux": lambda: t.OlmoeConfig(intermediate_size=24, num_experts=EXPERTS, norm_topk_prob=False, **aux,
                                           **common),
        "deepseek_v3": lambda: t.DeepseekV3Config(n_group=2, topk_group=1, routed_scaling_factor=2.5,
                                                  **mla, **dict(common, num_key_value_heads=4)),
        "deepseek_v2": lambda: t.DeepseekV2Config(routed_scaling_factor=1.5, **mla,
                                                  **dict(common, num_key_value_heads=4)),
        "qwen3_5_moe": lambda: t.Qwen3_5MoeTextConfig(num_experts=EXPERTS, moe_intermediate_size=24,
                                                      shared_expert_intermediate_size=24, head_dim=8,
                                                      linear_num_key_heads=2, linear_num_value_heads=4,
                                                      linear_key_head_dim=8, linear_value_head_dim=8,
                                                      layer_types=["linear_attention", "full_attention"], **aux,
                                                      **common),
        "minimax_m3": lambda: t.MiniMaxM3VLTextConfig(num_local_experts=EXPERTS, intermediate_size=24,
                                                      shared_intermediate_size=24, head_dim=8, **common),
    }[model]()
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"  # the reference loop over experts (no kernels)
    return cfg


def model_class(model: str):
    import transformers as t

    return {"mixtral": t.MixtralForCausalLM, "qwen2_moe": t.Qwen2MoeForCausalLM, "qwen3_moe": t.Qwen3MoeForCausalLM,
            "olmoe": t.OlmoeForCausalLM, "olmoe_aux": t.OlmoeForCausalLM, "deepseek_v3": t.DeepseekV3ForCausalLM,
            "deepseek_v2": t.DeepseekV2ForCausalLM, "qwen3_5_moe": t.Qwen3_5MoeForCausalLM,
            "minimax_m3": t.MiniMaxM3VLForCausalLM}[model]


def make_model(model: str):
    """The model, with values fixed by parameter name and the rigged router."""
    import torch

    torch.manual_seed(0)
    net = model_class(model)(hf_config(model))
    with torch.no_grad():
        for i, (name, p) in enumerate(sorted(net.named_parameters())):
            gen = torch.Generator().manual_seed(10_000 + i)
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.fill_(0.0 if model == "qwen3_5_moe" else 1.0)  # Qwen3.5's norms scale by 1 + weight
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        emb = net.model.embed_tokens.weight
        emb[:, 0] = torch.where(torch.arange(VOCAB) >= VOCAB // 2, 3.0, -3.0)
        for layer in net.model.layers:
            gate = getattr(getattr(layer.mlp, "gate", None), "weight", None)
            if gate is None or gate.shape[0] != EXPERTS:
                continue  # a dense layer
            gate[RIGGED_EXPERT].zero_()
            gate[RIGGED_EXPERT, 0] = 10.0
            bias = getattr(layer.mlp.gate, "e_score_correction_bias", None)
            if bias is not None:  # it picks experts without weighing them: give it a say
                bias.copy_(torch.tensor([0.05, -0.05, 0.1, 0.0])[:EXPERTS])
    return net


def batch(step: int, part: int):
    """Part `part` (a rank, or a micro-batch of one process) of step `step`: even parts take ids
    from the lower half of the vocabulary (expert 3 gets none of their tokens), odd parts the upper."""
    import torch

    g = torch.Generator().manual_seed(500 + 10 * step + part)
    half = VOCAB // 2
    return torch.randint(0, half, (ROWS, SEQ), generator=g) + (part % 2) * half


def autoep_section(job: dict) -> dict:
    section = {"enabled": True, "autoep_size": job["ep"]}
    if job["model"] in PRESET:
        section["preset_model"] = PRESET[job["model"]]
    return section


def config(job: dict, extra: dict = None) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": ROWS, "gradient_accumulation_steps": job["gas"],
           "train_batch_size": ROWS * job["gas"] * job["world"], "steps_per_print": 1000,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "eps": 1e-4, "weight_decay": 0.0, "torch_adam": True}},
           # DeepSpeed's default clipping (1.0; spelled out: dslaunch's default is off); eps keeps
           # Adam from magnifying the float noise of near-zero gradients (the rigged expert's router row)
           "gradient_clipping": 1.0, "zero_optimization": {"stage": job["stage"]}}
    if job.get("muon"):
        cfg["optimizer"] = MUON
    if job["ep"] is not None:
        cfg["expert_parallel"] = autoep_section(job)
    cfg.update(extra or {})
    return cfg


def train(deepspeed, job: dict, rank: int, extra_config: dict = None, model=None):
    """Run job's steps; returns (losses averaged over parts, the engine)."""
    import torch
    import torch.distributed as dist

    world, gas = job["world"], job["gas"]
    model = model if model is not None else make_model(job["model"])
    engine = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                  config=config(job, extra_config))[0]
    losses = []
    for step in range(STEPS):
        total = torch.zeros(1)
        for micro in range(gas):
            ids = batch(step, rank * gas + micro).to(engine.device)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        if world > 1:
            dist.all_reduce(total)
        losses.append(float(total) / (world * gas))
    return losses, engine


def worker(rank: int, job: dict) -> None:
    from bench_ranks import finish_script_rank, script_rank  # scripts/, on sys.path in a worker

    deepspeed = script_rank(rank, job, deepspeed_only=True)
    losses, _ = train(deepspeed, job, rank)
    finish_script_rank(rank, job, {"losses": losses})


def run(job: dict) -> dict:
    from bench_ranks import run_script_ranks  # on sys.path when run as a script (tests import this file without it)
    return run_script_ranks(sys.executable, __file__, job, job["world"], ROOT, quiet=True, capture=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(CASES), help="cases to (re)make; the others are kept")
    args = ap.parse_args()
    os.makedirs(OUT, exist_ok=True)
    path = os.path.join(OUT, "expected.json")
    expected = json.load(open(path)) if os.path.exists(path) else {}
    for name in args.cases.split(","):
        got = run(CASES[name])
        expected[name] = got if isinstance(got, dict) else {"error": got}  # capture: DeepSpeed's last line
        print(name, expected[name], flush=True)
        with open(path, "w") as fh:
            json.dump(expected, fh, indent=1, sort_keys=True)


if __name__ == "__main__":
    from bench_ranks import script_main  # scripts/, on sys.path when run as a script

    script_main(worker, main)
