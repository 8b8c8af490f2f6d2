"""CUDA fused Adam: nvcc must compile the source everywhere (CI has nvcc, no GPU); the
numerical tests run where a GPU is present and skip cleanly elsewhere."""
import copy
import shutil
import subprocess

import pytest
import torch

from dslaunch.kernels import builder

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _nvcc_or_skip():
    nvcc = builder.nvcc_compile_command(builder.HERE / "unused.o")[0]
    if shutil.which(nvcc) is None:
        pytest.skip(f"{nvcc} is not installed")


@pytest.mark.timeout(300)
def test_the_builder_links_a_cuda_library_that_exports_its_entry_points(tmp_path):
    """The same builder.build() the runtime calls on a GPU machine, here without a GPU: the
    library it links must export every entry point (a hidden one passed an object-file
    `nm -g` check once and failed with "undefined symbol" on an H100)."""
    _nvcc_or_skip()
    built = builder.build(builder.fused_adam_spec(["9.0"]), tmp_path / "cache")
    assert not built.cached and built.path.name == "ds_fused_adam.so"
    dynamic = subprocess.run(["nm", "-D", "--defined-only", str(built.path)], capture_output=True, text=True,
                             check=True).stdout
    for name in ("ds_fused_adam_step", "ds_fused_nonfinite", "ds_fused_adam_error_string"):
        assert f" T {name}\n" in dynamic, (name, dynamic)
    # Static CUDA runtime: nothing to find on the loader path, whatever CUDA torch brought.
    needed = subprocess.run(["readelf", "-d", str(built.path)], capture_output=True, text=True, check=True).stdout
    assert "libcudart" not in needed
    assert builder.build(builder.fused_adam_spec(["9.0"]), tmp_path / "cache").cached


@pytest.mark.timeout(300)
def test_nvcc_compiles_the_cuda_source_without_warnings(tmp_path):
    _nvcc_or_skip()
    cmd = builder.nvcc_compile_command(tmp_path / "fused_adam.o", werror=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}"


def test_fused_adam_refuses_cpu_parameters():
    from dslaunch.kernels import FusedAdam

    with pytest.raises(TypeError, match="FusedAdam steps CUDA"):
        FusedAdam([torch.nn.Parameter(torch.zeros(3))])


SIZES = [1, 7, 17, 1025, 65536 + 3, 10**6 + 3]


def _reference(p0, grads, **kw):
    p = p0.detach().double().clone().requires_grad_(True)
    opt = torch.optim.AdamW([p], foreach=False, **kw)
    for g in grads:
        p.grad = g.double()
        opt.step()
    return p.detach()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("decoupled,amsgrad", [(True, False), (False, False), (True, True)])
def test_matches_float64_adam_over_many_tensors(decoupled, amsgrad):
    from dslaunch.kernels import FusedAdam

    gen = torch.Generator().manual_seed(0)
    p0s = [torch.randn(n, generator=gen) for n in SIZES]
    grads = [[torch.randn(n, generator=gen).abs() * p.sign() for n, p in zip(SIZES, p0s)] for _ in range(5)]
    kw = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05, amsgrad=amsgrad)
    params = [torch.nn.Parameter(p.cuda()) for p in p0s]
    opt = FusedAdam(params, decoupled_weight_decay=decoupled, **kw)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.cuda()
        opt.step()
    for i, p in enumerate(params):
        ref_kw = dict(kw)
        if not decoupled:
            ref_p = p0s[i].double().clone().requires_grad_(True)
            ref = torch.optim.Adam([ref_p], foreach=False, **ref_kw)
            for step_grads in grads:
                ref_p.grad = step_grads[i].double()
                ref.step()
            expect = ref_p.detach()
        else:
            expect = _reference(p0s[i], [sg[i] for sg in grads], **ref_kw)
        torch.testing.assert_close(p.detach().cpu().double(), expect, rtol=1e-6, atol=1e-6)
        assert opt.state[p]["step"].device.type == "cuda" and opt.state[p]["step"].item() == 5


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("p_dtype,g_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                             (torch.float32, torch.float32)])
def test_low_precision_params_keep_fp32_states(p_dtype, g_dtype):
    from dslaunch.kernels import FusedAdam

    gen = torch.Generator().manual_seed(1)
    p0 = torch.randn(4099, generator=gen).to(p_dtype)
    grads = [torch.randn(4099, generator=gen).to(g_dtype) for _ in range(3)]
    p = torch.nn.Parameter(p0.cuda())
    opt = FusedAdam([p], lr=1e-2, weight_decay=0.0)
    # The reference: fp32 math on the same rounded values, rounded back each step.
    ref = p0.float().clone()
    m, v = torch.zeros(4099), torch.zeros(4099)
    for k, g in enumerate(grads, start=1):
        p.grad = g.cuda()
        opt.step()
        g32 = g.float()
        m.lerp_(g32, 0.1)
        v.mul_(0.999).addcmul_(g32, g32, value=0.001)
        denom = (v / (1 - 0.999 ** k)).sqrt() + 1e-8
        ref = (ref - 1e-2 / (1 - 0.9 ** k) * m / denom).to(p_dtype).float()
    assert opt.state[p]["exp_avg"].dtype == torch.float32
    torch.testing.assert_close(p.detach().cpu().float(), ref, rtol=1e-2 if p_dtype != torch.float32 else 1e-5,
                               atol=1e-2 if p_dtype != torch.float32 else 1e-6)


@pytest.mark.gpu
@needs_gpu
def test_grad_scale_unscales_and_found_inf_skips_without_a_sync():
    from dslaunch.kernels import FusedAdam

    p = torch.nn.Parameter(torch.randn(3000, device="cuda"))
    q = torch.nn.Parameter(p.detach().clone())
    ours, plain = FusedAdam([p], lr=1e-2), FusedAdam([q], lr=1e-2)
    g = torch.randn(3000, device="cuda")
    p.grad, q.grad = g * 1024.0, g.clone()
    ours.step(grad_scale=torch.tensor([1024.0], device="cuda"), found_inf=torch.zeros(1, device="cuda"))
    plain.step()
    torch.testing.assert_close(p, q)
    before = p.detach().clone()
    p.grad = g.clone()
    ours.step(grad_scale=torch.ones(1, device="cuda"), found_inf=torch.ones(1, device="cuda"))
    assert torch.equal(p, before) and ours.state[p]["step"].item() == 1
    skipping = FusedAdam([p], lr=1e-2, skip_nonfinite=True)
    p.grad = g.clone()
    p.grad[17] = float("nan")
    skipping.step()
    assert torch.equal(p, before)
    assert skipping.state[p]["step"].item() == 0


@pytest.mark.gpu
@needs_gpu
def test_state_dict_round_trip_with_torch_adamw():
    from dslaunch.kernels import FusedAdam

    torch.manual_seed(0)
    a = torch.nn.Linear(32, 16).cuda()
    b = copy.deepcopy(a)
    oa, ob = FusedAdam(a.parameters(), lr=1e-2), torch.optim.AdamW(b.parameters(), lr=1e-2)
    for _ in range(3):
        x = torch.randn(8, 32, device="cuda")
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad()
            m(x).square().sum().backward()
            o.step()
    ob.load_state_dict(copy.deepcopy(oa.state_dict()))
    oa.load_state_dict(copy.deepcopy(ob.state_dict()))
    b.load_state_dict(a.state_dict())
    for _ in range(2):
        x = torch.randn(8, 32, device="cuda")
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad()
            m(x).square().sum().backward()
            o.step()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@needs_gpu
def test_grad_scaler_drives_fused_adam_like_torch_fused_adamw():
    from dslaunch.kernels import FusedAdam

    torch.manual_seed(0)
    a = torch.nn.Linear(64, 64).cuda()
    b = copy.deepcopy(a)
    oa, ob = FusedAdam(a.parameters(), lr=1e-3), torch.optim.AdamW(b.parameters(), lr=1e-3, fused=True)
    sa, sb = torch.amp.GradScaler("cuda", init_scale=2.0**10), torch.amp.GradScaler("cuda", init_scale=2.0**10)
    for i in range(4):
        x = torch.randn(16, 64, device="cuda")
        if i == 2:
            x[0, 0] = float("inf")  # this step must be skipped by both
        for m, o, s in ((a, oa, sa), (b, ob, sb)):
            o.zero_grad()
            s.scale(m(x).square().mean()).backward()
            s.step(o)
            s.update()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert oa.state[next(a.parameters())]["step"].item() == 3


@pytest.mark.gpu
@needs_gpu
def test_the_kernel_is_used_and_the_fallback_honours_skip_nonfinite(tmp_path):
    """In a fresh process: the real op loads (no fallback warning). Then, with the cache
    refused (world-writable), the torch fallback says why in one line and still skips a
    step whose gradients hold a NaN."""
    import json
    import os
    import sys
    import textwrap

    script = textwrap.dedent("""
        import json, warnings, torch
        from dslaunch.kernels import FusedAdam, fused_adam_available
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            p = torch.nn.Parameter(torch.ones(5000, device="cuda"))
            q = torch.nn.Parameter(torch.ones(70000, device="cuda", dtype=torch.bfloat16))
            opt = FusedAdam([p, q], lr=0.1, skip_nonfinite=True)
            p.grad, q.grad = torch.ones_like(p), torch.ones_like(q)
            q.grad[123] = float("nan")  # in the other dtype bucket: the whole step must be skipped
            opt.step()
            skipped = bool((p == 1).all()) and opt.state[p]["step"].item() == 0
            q.grad[123] = 1.0
            opt.step()
            stepped = bool((p < 1).all()) and bool((q < 1).all())
        print(json.dumps({"available": fused_adam_available(), "skipped": skipped, "stepped": stepped,
                          "warnings": [str(w.message) for w in caught if "dslaunch" in str(w.message)]}))
    """)
    results = {}
    for name, cache in (("kernel", tmp_path / "private"), ("fallback", tmp_path / "shared")):
        cache.mkdir()
        if name == "fallback":
            os.chmod(cache, 0o1777)
        env = dict(os.environ, DSLAUNCH_OPS_CACHE=str(cache))
        run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=280)
        assert run.returncode == 0, run.stderr
        results[name] = json.loads(run.stdout.strip().splitlines()[-1])
    kernel, fallback = results["kernel"], results["fallback"]
    assert kernel["available"] and kernel["warnings"] == [] and kernel["skipped"] and kernel["stepped"], kernel
    assert not fallback["available"] and fallback["skipped"] and fallback["stepped"], fallback
    assert len(fallback["warnings"]) == 1 and "world-writable" in fallback["warnings"][0], fallback


@pytest.mark.gpu
@needs_gpu
def test_bias_correction_off_and_deepspeeds_fusedadam_signature():
    """DeepSpeed's FusedAdam(params, lr, bias_correction, betas, eps, adam_w_mode, weight_decay)
    without bias correction equals CPUAdam without it (the same update on the CPU op)."""
    from dslaunch.kernels import CPUAdam
    from dslaunch.runtime.ops.adam import FusedAdam

    gen = torch.Generator().manual_seed(3)
    p0 = torch.randn(70001, generator=gen)
    grads = [torch.randn(70001, generator=gen) for _ in range(4)]
    gpu, cpu = torch.nn.Parameter(p0.cuda()), torch.nn.Parameter(p0.clone())
    ours = FusedAdam([gpu], 1e-2, False, (0.9, 0.99), 1e-8, False, 0.05)
    ref = CPUAdam([cpu], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05, decoupled_weight_decay=False,
                  bias_correction=False)
    for g in grads:
        gpu.grad, cpu.grad = g.cuda(), g.clone()
        ours.step()
        ref.step()
    torch.testing.assert_close(gpu.detach().cpu(), cpu.detach(), rtol=1e-5, atol=1e-6)
    ours.zero_grad()
    assert gpu.grad is None  # set_grad_none=True, DeepSpeed's default
