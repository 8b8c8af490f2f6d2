"""Make tests/data/ds_hf_moe/expected.json with real DeepSpeed (0.19.8, CPU, gloo): the losses
of tiny Hugging Face MoE models (Mixtral, Qwen2-MoE) trained under ZeRO-2 and ZeRO-3.

    /work/ds-venv/bin/python scripts/make_ds_hf_moe_fixtures.py [--cases a,b]

`train` is the training script both engines run (tests/runtime/moe/test_hf_moe.py runs it with
`import dslaunch.runtime as deepspeed`). The models are built from small configs (2 layers,
hidden 32, 4 experts, top-2; no hub access), every parameter given a value of its own by
name, so transformers versions that name and shape parameters alike build the same model.
The router is rigged: the token embeddings carry +-3 in channel 0 (+ for ids in the upper
half of the vocabulary) and every layer's router scores expert 3 by 10 x channel 0. Rank 0
reads only lower-half ids, so expert 3 gets no tokens on rank 0 and every token on rank 1:
a step in which some experts get no tokens on one rank, at every step and layer.

Models:
  mixtral          transformers' Mixtral (its experts are one 3D parameter per projection)
  qwen2_moe        transformers' Qwen2-MoE (plus a shared expert)
  mixtral_list     Mixtral whose sparse blocks hold a ModuleList of per-expert MLPs and call
                   only the experts that got tokens (transformers 4.x's layout, still common in
                   remote-code models): per-expert ZeRO-3 hooks would issue a different number
                   of collectives on each rank, so ZeRO-3 needs set_z3_leaf_modules here
Cases: one process taking the two ranks' batches as gradient-accumulation micro-batches
(what the 2-rank runs must reproduce), and 2 ranks at ZeRO 2 and at ZeRO 3 with the sparse
block as a leaf module (`leaf`). A case's losses are averaged over ranks or micro-batches.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OUT = os.path.join(ROOT, "tests", "data", "ds_hf_moe")

VOCAB, HIDDEN, EXPERTS, TOP_K, SEQ, ROWS, STEPS = 64, 32, 4, 2, 8, 2, 3
RIGGED_EXPERT = 3

# name: model, world, ZeRO stage, gradient accumulation steps, leaf (set_z3_leaf_modules)
CASES = {}
for _m in ("mixtral", "qwen2_moe", "mixtral_list"):
    CASES[f"{_m}_one"] = dict(model=_m, world=1, stage=0, gas=2, leaf=False)
    CASES[f"{_m}_w2_s2"] = dict(model=_m, world=2, stage=2, gas=1, leaf=False)
    CASES[f"{_m}_w2_s3_leaf"] = dict(model=_m, world=2, stage=3, gas=1, leaf=True)
# DeepSpeed 0.19.8 crashes here: its ZeRO-2 buckets hold only the gradients a rank produced,
# so the experts without tokens on rank 0 leave the ranks' all-reduces of different sizes
# (gloo: "op.preamble.length <= op.nbytes"); dslaunch's ZeRO-2 runs it
DS_FAILS = {"mixtral_list_w2_s2"}


def hf_config(model: str):
    from transformers import MixtralConfig, Qwen2MoeConfig

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32, num_experts_per_tok=TOP_K,
                  attn_implementation="eager", experts_implementation="eager", tie_word_embeddings=False)
    if model == "qwen2_moe":
        return Qwen2MoeConfig(intermediate_size=48, moe_intermediate_size=24, shared_expert_intermediate_size=24,
                              num_experts=EXPERTS, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                              **common)
    # the aux loss reads transformers' router outputs, which mixtral_list's own blocks do not make
    return MixtralConfig(intermediate_size=24, num_local_experts=EXPERTS, router_jitter_noise=0.0,
                         output_router_logits=model == "mixtral", router_aux_loss_coef=0.01, **common)


def _sparse_block_class():
    import torch
    import torch.nn.functional as F

    class ExpertMLP(torch.nn.Module):
        def __init__(self, hidden, ffn):
            super().__init__()
            self.w1 = torch.nn.Linear(hidden, ffn, bias=False)
            self.w2 = torch.nn.Linear(ffn, hidden, bias=False)
            self.w3 = torch.nn.Linear(hidden, ffn, bias=False)

        def forward(self, x):
            return self.w2(F.silu(self.w1(x)) * self.w3(x))

    class ListSparseMoeBlock(torch.nn.Module):
        """Top-k routing over a ModuleList of experts; an expert without tokens is not called."""

        def __init__(self, config):
            super().__init__()
            self.top_k = config.num_experts_per_tok
            self.gate = torch.nn.Linear(config.hidden_size, config.num_local_experts, bias=False)
            self.experts = torch.nn.ModuleList(ExpertMLP(config.hidden_size, config.intermediate_size)
                                               for _ in range(config.num_local_experts))

        def forward(self, hidden_states):
            b, s, h = hidden_states.shape
            x = hidden_states.reshape(-1, h)
            probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float)
            weights, chosen = torch.topk(probs, self.top_k, dim=-1)
            weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
            out = torch.zeros_like(x)
            for e, expert in enumerate(self.experts):
                token, slot = torch.where(chosen == e)
                if token.numel() == 0:
                    continue
                out.index_add_(0, token, expert(x[token]) * weights[token, slot, None])
            return out.reshape(b, s, h)

    return ListSparseMoeBlock


def make_model(model: str):
    """The model, its sparse-block class (the leaf), with values fixed by parameter name."""
    import torch
    from transformers import MixtralForCausalLM, Qwen2MoeForCausalLM

    cfg = hf_config(model)
    torch.manual_seed(0)
    net = (Qwen2MoeForCausalLM if model == "qwen2_moe" else MixtralForCausalLM)(cfg)
    leaf = type(net.model.layers[0].mlp)
    if model == "mixtral_list":
        leaf = _sparse_block_class()
        for layer in net.model.layers:
            layer.mlp = leaf(cfg)
    with torch.no_grad():
        for i, (name, p) in enumerate(sorted(net.named_parameters())):
            gen = torch.Generator().manual_seed(10_000 + i)
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        emb = net.model.embed_tokens.weight
        emb[:, 0] = torch.where(torch.arange(VOCAB) >= VOCAB // 2, 3.0, -3.0)
        for layer in net.model.layers:
            gate = layer.mlp.gate.weight  # [experts, hidden] in every model here
            gate[RIGGED_EXPERT].zero_()
            gate[RIGGED_EXPERT, 0] = 10.0
    return net, leaf


def batch(step: int, part: int):
    """Part `part` (a rank, or a micro-batch of one process) of step `step`: part 0 takes ids
    from the lower half of the vocabulary (expert 3 gets none of its tokens), part 1 the upper."""
    import torch

    g = torch.Generator().manual_seed(500 + 10 * step + part)
    half = VOCAB // 2
    return torch.randint(0, half, (ROWS, SEQ), generator=g) + part * half


def config(job: dict, extra: dict = None) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": ROWS, "gradient_accumulation_steps": job["gas"],
           "train_batch_size": ROWS * job["gas"] * job["world"], "steps_per_print": 1000,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "eps": 1e-4, "weight_decay": 0.0, "torch_adam": True}},
           # DeepSpeed's default clipping (1.0; spelled out: dslaunch's default is off); eps keeps
           # Adam from magnifying the float noise of near-zero gradients (the rigged expert's router row)
           "gradient_clipping": 1.0, "zero_optimization": {"stage": job["stage"]}}
    if job["stage"] == 3:  # every parameter partitioned and gathered by the hooks
        cfg["zero_optimization"].update(stage3_param_persistence_threshold=0, reduce_bucket_size=2000,
                                        stage3_prefetch_bucket_size=2000)
    cfg.update(extra or {})
    return cfg


def train(deepspeed, set_z3_leaf_modules, job: dict, rank: int, extra_config: dict = None) -> dict:
    """Run job's steps; returns {"losses", "expert_tokens"} (the same on every rank):
    expert_tokens[step] = tokens layer 0 routed to each expert, per rank (or micro-batch).
    `set_z3_leaf_modules`: deepspeed.utils'."""
    import torch
    import torch.distributed as dist

    world, gas = job["world"], job["gas"]
    model, leaf = make_model(job["model"])
    if job["leaf"]:
        set_z3_leaf_modules(model, [leaf])
    routed = []

    def count(module, args, out):
        logits = out[0] if isinstance(out, tuple) else out
        chosen = torch.topk(logits.detach().float(), TOP_K, dim=-1).indices
        routed.append(torch.bincount(chosen.reshape(-1), minlength=EXPERTS))

    model.model.layers[0].mlp.gate.register_forward_hook(count)
    engine = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                  config=config(job, extra_config))[0]
    losses, tokens = [], []
    for step in range(STEPS):
        total = torch.zeros(1)
        per_part = torch.zeros(world * gas, EXPERTS, dtype=torch.long)
        for micro in range(gas):
            ids = batch(step, rank * gas + micro)
            routed.clear()
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            total += loss.detach()
            per_part[rank * gas + micro] = routed[0]
        if world > 1:
            dist.all_reduce(total)
            dist.all_reduce(per_part)
        losses.append(float(total) / (world * gas))
        tokens.append(per_part.tolist())
    return {"losses": losses, "expert_tokens": tokens}


def worker(rank: int, job: dict) -> None:
    from bench_ranks import finish_script_rank, script_rank  # scripts/, on sys.path in a worker

    deepspeed = script_rank(rank, job, deepspeed_only=True)
    from deepspeed.utils import set_z3_leaf_modules

    finish_script_rank(rank, job, train(deepspeed, set_z3_leaf_modules, job, rank))


def run(job: dict) -> dict:
    from bench_ranks import run_script_ranks  # on sys.path when run as a script (tests import this file without it)
    return run_script_ranks(sys.executable, __file__, job, job["world"], ROOT, quiet=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(n for n in CASES if n not in DS_FAILS),
                    help="cases to (re)make; the others are kept")
    args = ap.parse_args()
    os.makedirs(OUT, exist_ok=True)
    path = os.path.join(OUT, "expected.json")
    expected = json.load(open(path)) if os.path.exists(path) else {}
    for name in args.cases.split(","):
        expected[name] = run(CASES[name])
        print(name, expected[name], flush=True)
    with open(path, "w") as fh:
        json.dump(expected, fh, indent=1, sort_keys=True)


if __name__ == "__main__":
    from bench_ranks import script_main  # scripts/, on sys.path when run as a script

    script_main(worker, main)
