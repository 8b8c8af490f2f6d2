"""init_inference on one CUDA device (gpu-marked: skips without one; the lead runs it on a GPU box):
fp16 and bf16 equal the plain model, int8 (torch dequantisation op on the GPU) within the int8
tolerance of test_inference_tp.py, kernel injection unchanged numerically, a meta model loaded from a
checkpoint straight onto the device."""
from __future__ import annotations

import sys

import pytest
import torch
import repo_paths

sys.path.insert(0, str(repo_paths.TESTS))

import dslaunch.runtime as deepspeed  # noqa: E402
from inference_models import build, greedy, logits, prompt  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("kind", ["gpt2", "llama", "t5"])
def test_cuda_half_precision_and_int8(kind, tmp_path):
    ids = prompt().cuda()
    for dtype, tol in ((torch.float16, 2e-3), (torch.bfloat16, 2e-2)):
        plain = build(kind).to("cuda", dtype)
        ref = logits(plain, ids).float()
        engine = deepspeed.init_inference(build(kind), dtype=dtype, replace_with_kernel_inject=True)
        assert next(engine.module.parameters()).device.type == "cuda"
        assert (logits(engine.module, ids).float() - ref).abs().max() < tol
        assert torch.equal(greedy(engine, ids, 16), greedy(plain, ids, 16))
    ref32 = logits(build(kind).cuda(), ids)
    int8 = deepspeed.init_inference(build(kind), dtype=torch.int8)
    err = logits(int8.module, ids) - ref32
    assert err.pow(2).mean().sqrt() < 0.05 * ref32.pow(2).mean().sqrt()
    path = tmp_path / "model.pt"
    torch.save(build(kind).state_dict(), path)
    with deepspeed.OnDevice(dtype=torch.float, device="meta"):
        skeleton = build(kind, seed=9)
    loaded = deepspeed.init_inference(skeleton, dtype=torch.float, checkpoint=str(path))
    assert (logits(loaded.module, ids) - ref32).abs().max() < 1e-4
