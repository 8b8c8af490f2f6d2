"""Tensor-parallel inference on gloo ranks against the unsharded single-process model.

One multi-rank job per world size checks every model and mode, so the ranks import torch
and transformers once: GPT-2, Llama and T5 with automatic TP and with an explicit
injection_policy (logits to 1e-4 in fp32, 32 greedy tokens identical), GPT-Neo, GPT-J,
Mistral and BERT logits with automatic TP, int8 (logits against fp32 and against the int8
model on one rank; weight bytes per rank), a checkpoint loaded into a meta-device model,
and sampling that stays identical across ranks.

int8 tolerance: a weight's rounding error is at most half a step, max|w_group|/254, and
spread uniformly (std max|w_group|/(127*sqrt(12)) ~ 0.6% of the group's largest weight,
~1.5% of a Gaussian weight's std for groups of 64). Each projection's output therefore carries
~1.5% relative noise, and a few layers add roughly in quadrature: the test allows the rms of
the logit error to be 5% of the logits' rms (measured: 1.2% for T5) and its largest element 10%
of the largest logit. (Argmax agreement is no test here: a random tiny model's logits are
nearly tied, so 1% noise flips some of them.) Against the int8 model on one rank (same groups, same int8 values)
the tolerance is the fp32 one, 1e-4.
"""
from __future__ import annotations

import os
import sys

import pytest
import repo_paths

sys.path.insert(0, str(repo_paths.TESTS))

from dist_harness import run_function  # noqa: E402

pytest.importorskip("transformers", reason="the [hf] extra (scripts/setup_env.sh installs it)")

FP32_TOL = 1e-4
INT8_RMS = 0.05
INT8_MAX = 0.10
TOKENS = 32


def _check_models(kinds, tp, modes):
    """Runs on every rank: returns {case: measurements} for the caller to assert on."""
    import torch

    import dslaunch.runtime as deepspeed
    from inference_models import build, greedy, logits, policy, prompt

    ids = prompt()
    out = {}
    for kind in kinds:
        for mode in modes:
            ref_model = build(kind)
            ref_logits = logits(ref_model, ids)
            ref_tokens = greedy(ref_model, ids, TOKENS) if kind in ("gpt2", "llama", "t5") else None
            extra = {"injection_policy": policy(kind)} if mode == "policy" else {}
            engine = deepspeed.init_inference(build(kind), tensor_parallel={"tp_size": tp}, dtype=torch.float,
                                              **extra)
            got = logits(engine.module, ids)
            case = {"logit_diff": (got - ref_logits).abs().max().item(), "bytes": engine.weight_bytes()}
            if ref_tokens is not None:
                case["tokens_equal"] = torch.equal(greedy(engine, ids, TOKENS), ref_tokens)
            out[f"{kind}/{mode}"] = case
    return out


def _check_int8(kinds, tp):
    import torch

    import dslaunch.runtime as deepspeed
    from inference_models import build, logits, prompt

    ids = prompt()
    out = {}
    for kind in kinds:
        ref = logits(build(kind), ids)
        quant = {"weight": {"q_groups": 4}}  # 16-column groups: the same groups at tp 1, 2 and 4
        one = deepspeed.init_inference(build(kind), dtype=torch.int8, quant=quant)  # int8 on this rank alone
        one_logits = logits(one.module, ids)
        engine = deepspeed.init_inference(build(kind), mp_size=tp, dtype=torch.int8, quant=quant)
        got = logits(engine.module, ids)
        err = got - ref
        out[kind] = {
            "rms_rel": (err.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item(),
            "max_rel": (err.abs().max() / ref.abs().max()).item(),
            "vs_one_rank": (got - one_logits).abs().max().item(),
            "bytes_one": one.weight_bytes(),
            "bytes_rank": engine.weight_bytes(),
            "layers_one": _parallel_layer_bytes(one.module),
            "layers_rank": _parallel_layer_bytes(engine.module),
            "int8_layers": sum(1 for m in engine.module.modules() if getattr(m, "group_size", 0) > 0),
        }
    return out


def _parallel_layer_bytes(model):
    """int8 weights + scales (+ biases) held by the parallel layers, each tied storage once."""
    from dslaunch.runtime.inference.layers import _ShardedWeight

    layers = {id(m): m for m in model.modules() if isinstance(m, _ShardedWeight)}
    storages = {}
    for m in layers.values():
        for t in list(m.buffers(recurse=False)) + list(m.parameters(recurse=False)):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def _check_checkpoint(kind, tp, path):
    """Save the full model once (rank 0), then build it on the meta device and load it sharded."""
    import torch
    import torch.distributed as dist

    import dslaunch.runtime as deepspeed
    from inference_models import build, logits, prompt

    ref_model = build(kind)
    if dist.get_rank() == 0:
        torch.save(ref_model.state_dict(), path)
    dist.barrier()
    with deepspeed.OnDevice(dtype=torch.float, device="meta"):
        skeleton = build(kind, seed=123)  # different init: every weight must come from the file
    assert all(p.device.type == "meta" for p in skeleton.parameters())
    engine = deepspeed.init_inference(skeleton, mp_size=tp, dtype=torch.float, checkpoint=path)
    diff = (logits(engine.module, prompt()) - logits(ref_model, prompt())).abs().max().item()
    return {"logit_diff": diff, "bytes": engine.weight_bytes(),
            "full_bytes": sum(p.numel() * 4 for p in ref_model.parameters())}


def _check_sampling(tp):
    import torch

    import dslaunch.runtime as deepspeed
    from inference_models import build, prompt

    model = build("gpt2")
    torch.manual_seed(1000 + int(os.environ["RANK"]))  # different on purpose: the engine must align them
    engine = deepspeed.init_inference(model, mp_size=tp, dtype=torch.float)
    with torch.no_grad():
        return engine.generate(prompt(), do_sample=True, max_new_tokens=16, pad_token_id=0).tolist()


def _check_replicas():
    """World 4 serving two copies of a tp-2 model: groups from the topology's model axis, made here
    or passed in as a grid (mpu=)."""
    import torch

    import dslaunch.runtime as deepspeed
    from dslaunch.runtime.topology import PipeModelDataParallelTopology, PipelineParallelGrid
    from inference_models import build, logits, prompt

    ref = logits(build("gpt2"), prompt())
    made = deepspeed.init_inference(build("gpt2"), mp_size=2, dtype=torch.float)
    grid = PipelineParallelGrid(PipeModelDataParallelTopology(num_pp=1, num_mp=2, num_dp=2))
    given = deepspeed.init_inference(build("gpt2"), mpu=grid, dtype=torch.float)
    return {"made": (logits(made.module, prompt()) - ref).abs().max().item(), "made_tp": made.tp.size,
            "made_rank": made.tp.rank, "given": (logits(given.module, prompt()) - ref).abs().max().item(),
            "given_tp": given.tp.size}


def _check_kernel_inject(kinds, tp):
    """replace_with_kernel_inject on top of tensor parallelism: the attention backend is swapped and
    the numbers do not move."""
    import torch

    import dslaunch.runtime as deepspeed
    from inference_models import build, greedy, logits, prompt

    out = {}
    for kind in kinds:
        ref_model = build(kind)
        ref_logits, ref_tokens = logits(ref_model, prompt()), greedy(ref_model, prompt(), TOKENS)
        engine = deepspeed.init_inference(build(kind), mp_size=tp, dtype=torch.float, replace_with_kernel_inject=True)
        out[kind] = {"backend": engine.injected.backend, "attn": engine.module.config._attn_implementation,
                     "logit_diff": (logits(engine.module, prompt()) - ref_logits).abs().max().item(),
                     "tokens_equal": torch.equal(greedy(engine, prompt(), TOKENS), ref_tokens)}
    return out


def job(tp: int, kinds, modes, auto_only, int8_kinds, ckpt_path):
    results = {"models": _check_models(kinds, tp, modes)}
    if tp == 2:
        results["kernel_inject"] = _check_kernel_inject(("gpt2", "llama"), tp)
    results["models"].update(_check_models(auto_only, tp, ("auto",)))
    results["int8"] = _check_int8(int8_kinds, tp)
    results["checkpoint"] = _check_checkpoint("llama", tp, ckpt_path)
    results["sampled"] = _check_sampling(tp)
    if tp == 4:
        results["replicas"] = _check_replicas()
    return results


def _assert_results(per_rank, tp):
    for rank, res in enumerate(per_rank):
        for case, m in res["models"].items():
            assert m["logit_diff"] < FP32_TOL, (rank, case, m)
            if "tokens_equal" in m:
                assert m["tokens_equal"], (rank, case, "greedy tokens differ from the unsharded model")
        for kind, m in res["int8"].items():
            assert m["rms_rel"] < INT8_RMS, (rank, kind, m)
            assert m["max_rel"] < INT8_MAX, (rank, kind, m)
            assert m["vs_one_rank"] < FP32_TOL, (rank, kind, m)
            assert m["int8_layers"] > 0
            # the int8 layers' bytes split by tp (row-parallel biases stay whole: the 2%); the rest
            # of the model (norms, position tables) is whole on every rank
            split = m["layers_rank"] / (m["layers_one"] / tp)
            assert 0.98 <= split <= 1.02, (rank, kind, split, m)
            assert m["bytes_rank"] - m["layers_rank"] <= m["bytes_one"] - m["layers_one"], (rank, kind, m)
        ck = res["checkpoint"]
        assert ck["logit_diff"] < FP32_TOL, (rank, ck)
        assert ck["bytes"] < ck["full_bytes"] / tp * 1.25, (rank, ck)
    assert all(r["sampled"] == per_rank[0]["sampled"] for r in per_rank), "sampling diverged across ranks"
    for rank, res in enumerate(per_rank):
        for kind, m in res.get("kernel_inject", {}).items():
            assert m["backend"] == m["attn"] == "dslaunch_sdpa", (rank, kind, m)
            assert m["logit_diff"] < FP32_TOL and m["tokens_equal"], (rank, kind, m)
        if "replicas" in res:
            rep = res["replicas"]
            assert rep["made"] < FP32_TOL and rep["given"] < FP32_TOL, (rank, rep)
            assert (rep["made_tp"], rep["made_rank"], rep["given_tp"]) == (2, rank % 2, 2), (rank, rep)


def test_tp2_matches_single_process(tmp_path):
    per_rank = run_function(job, nprocs=2, timeout=400, kwargs=dict(
        tp=2, kinds=("gpt2", "llama", "t5"), modes=("auto", "policy"),
        auto_only=("gpt_neo", "gptj", "mistral", "bert"), int8_kinds=("gpt2", "llama", "t5"),
        ckpt_path=str(tmp_path / "llama.pt")))
    _assert_results(per_rank, 2)


def test_tp4_matches_single_process(tmp_path):
    per_rank = run_function(job, nprocs=4, timeout=500, kwargs=dict(
        tp=4, kinds=("gpt2", "llama", "t5"), modes=("auto", "policy"), auto_only=(),
        int8_kinds=("gpt2", "llama"), ckpt_path=str(tmp_path / "llama.pt")))
    _assert_results(per_rank, 4)
