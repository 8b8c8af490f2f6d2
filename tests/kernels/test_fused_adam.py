"""CUDA fused Adam: a torch op built by torch.utils.cpp_extension where torch has CUDA.

Two commands, two machines (README, kernels): here (CPU torch, nvcc, no GPU) nvcc compiles
both translation units against torch's headers with -Werror and links them, and the
exports are read; on a GPU machine `builder.build()` runs cpp_extension's load(...,
with_cuda) and the gpu-marked tests below run the op."""
import copy
import ctypes
import re
import shutil
import subprocess

import pytest
import torch

from dslaunch.kernels import builder
from dslaunch.kernels.elf import exported_functions

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.timeout(300)
def test_nvcc_compiles_the_op_and_its_kernels_against_torch_headers_and_links_the_exports(tmp_path):
    """The compile-only check CI runs without a CUDA torch: fused_adam.cu and
    fused_adam_op.cpp through nvcc with cpp_extension's flags and -Werror, linked, and every
    C entry point exported (a hidden one once passed an object-file `nm -g` check and failed
    with "undefined symbol" on an H100)."""
    spec = builder.fused_adam_spec(["9.0"])
    cmds = builder.nvcc_check_commands(spec, tmp_path, werror=True)
    assert shutil.which(cmds[0][0]), f"{cmds[0][0]} is not installed: CI compiles the CUDA op with it"
    assert [c[2] for c in cmds[:-1]] == list(spec.sources)
    for cmd in cmds:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
        assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}"
    exported = exported_functions((tmp_path / "ds_fused_adam.so").read_bytes())
    assert set(spec.symbols) <= exported, sorted(exported)
    # the same flags as the builder's single-source command (bench and users print it)
    assert builder.nvcc_compile_command(tmp_path / "fused_adam.cu.o", arch="sm_90", werror=True) == cmds[0]


def test_a_cpu_torch_refuses_the_cuda_build_in_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(builder.BuildError) as e:
        builder.build(builder.fused_adam_spec(["9.0"]), tmp_path / "cache")
    assert str(e.value) == (f"building ds_fused_adam needs a CUDA build of torch; torch {torch.__version__} is "
                            "CPU-only (`dslaunch build-ops --no-cuda` builds the CPU ops)")
    assert not (tmp_path / "cache").exists()  # refused before the cache is touched


def _fake_args(mode, n=3, **change):
    """adam_step's arguments as fake CUDA tensors (FakeTensorMode makes them without a GPU)."""
    with mode:
        cuda = torch.device("cuda", 0)
        args = dict(params=[torch.empty(n, device=cuda, dtype=torch.bfloat16)],
                    grads=[torch.empty(n, device=cuda, dtype=torch.bfloat16)],
                    exp_avgs=[torch.empty(n, device=cuda)], exp_avg_sqs=[torch.empty(n, device=cuda)],
                    max_exp_avg_sqs=[], steps=[torch.empty((), device=cuda)],
                    done=torch.empty(1, device=cuda, dtype=torch.int32), grad_scale=None, found_inf=None)
        args.update({k: v(cuda) for k, v in change.items()})
    return dict(args, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True, amsgrad=False,
                maximize=False, bias_correction=True)


@pytest.mark.parametrize("change,message", [
    ({}, None),
    ({"exp_avgs": lambda d: [torch.empty(3, device=d, dtype=torch.bfloat16)]},
     "fused adam_step: exp_avgs[0] has dtype bfloat16; expected float32"),
    ({"grads": lambda d: [torch.empty(3, device="cpu")]}, "fused adam_step: grads[0] is not on a CUDA device"),
    ({"exp_avg_sqs": lambda d: [torch.empty(4, device=d)]},
     "fused adam_step: exp_avg_sqs[0] has 4 elements, the parameter has 3"),
    ({"exp_avgs": lambda d: [torch.empty_strided((3,), (2,), device=d)]},
     "fused adam_step: exp_avgs[0] is not contiguous"),
    ({"found_inf": lambda d: torch.empty(2, device=d)},
     "fused adam_step: found_inf must be one float32 element on cuda:0"),
])
def test_the_fake_implementation_checks_as_the_op_does(change, message):
    """What torch.compile runs instead of the kernel: the op's checks, in its words (the
    gpu-marked test below holds the C++ op to the same messages)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dslaunch.kernels.fused_adam import _fake_adam_step

    args = _fake_args(FakeTensorMode(), **change)
    if message is None:
        assert _fake_adam_step(**args) is None
    else:
        with pytest.raises(RuntimeError, match="^" + re.escape(message)):
            _fake_adam_step(**args)


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


def _kernel_only_library(tmp_path):
    """fused_adam.cu alone, linked as before this op existed (nvcc, static cudart), for
    its C entry points through ctypes: the reference the torch op must match bit for bit."""
    spec = builder.fused_adam_spec()
    obj, lib = tmp_path / "k.o", tmp_path / "kernel_only.so"
    for cmd in (builder.nvcc_compile_command(obj, spec=spec), [_nvcc(), "-shared", "-cudart", "static", str(obj),
                                                                "-o", str(lib)]):
        subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    return ctypes.CDLL(str(lib))


def _nvcc():
    return builder.nvcc_compile_command(builder.HERE / "unused.o")[0]


class _Hyper(ctypes.Structure):  # fused_adam.cu's struct Hyper
    _fields_ = [(n, ctypes.c_float) for n in ("lr", "beta1", "beta2", "eps", "weight_decay")] + \
               [(n, ctypes.c_int32) for n in ("decoupled", "amsgrad", "maximize", "bias_correction")]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("p_dtype,amsgrad", [(torch.float32, True), (torch.bfloat16, False)])
def test_the_torch_op_is_bit_identical_to_the_kernel_through_its_c_abi(tmp_path, p_dtype, amsgrad):
    from dslaunch.kernels import FusedAdam, fused_adam

    lib = _kernel_only_library(tmp_path)
    gen = torch.Generator().manual_seed(3)
    sizes = [5, 65536 + 7, 1000]
    p0 = [torch.randn(n, generator=gen).to(p_dtype) for n in sizes]
    grads = [[torch.randn(n, generator=gen).to(p_dtype) for n in sizes] for _ in range(3)]
    params = [torch.nn.Parameter(p.cuda()) for p in p0]
    opt = FusedAdam(params, lr=1e-2, weight_decay=0.1, amsgrad=amsgrad)
    assert fused_adam._OP.load() and fused_adam._OP.built.extra["built_by"] == "torch.utils.cpp_extension"
    ref = [p.cuda() for p in p0]
    m = [torch.zeros(n, device="cuda") for n in sizes]
    v = [torch.zeros(n, device="cuda") for n in sizes]
    vmax = [torch.zeros(n, device="cuda") for n in sizes]
    steps = [torch.zeros((), device="cuda") for _ in sizes]
    done = torch.zeros(1, dtype=torch.int32, device="cuda")
    chunk, begin, rows = 1 << 16, 0, []
    for i, n in enumerate(sizes):
        rows.append([ref[i].data_ptr(), 0, m[i].data_ptr(), v[i].data_ptr(), vmax[i].data_ptr() if amsgrad else 0,
                     steps[i].data_ptr(), n, begin])
        begin += (n + chunk - 1) // chunk
    code = {torch.float32: 0, torch.bfloat16: 1}[p_dtype]
    hyper = _Hyper(1e-2, 0.9, 0.999, 1e-8, 0.1, 1, int(amsgrad), 0, 1)
    vp = ctypes.c_void_p
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.cuda()
        opt.step()
        gs = [g.cuda() for g in step_grads]
        for row, g in zip(rows, gs):
            row[1] = g.data_ptr()
        table = torch.tensor(rows, dtype=torch.int64, device="cuda")
        rc = lib.ds_fused_adam_step(vp(table.data_ptr()), len(rows), ctypes.c_int64(begin), ctypes.c_int64(chunk),
                                    code, code, ctypes.byref(hyper), None, None, vp(done.data_ptr()),
                                    vp(torch.cuda.current_stream().cuda_stream))
        assert rc == 0
        torch.cuda.synchronize()
    for i, p in enumerate(params):
        assert torch.equal(p.detach(), ref[i]), i
        assert torch.equal(opt.state[p]["exp_avg"], m[i]) and torch.equal(opt.state[p]["exp_avg_sq"], v[i])
        assert torch.equal(opt.state[p]["step"], steps[i])


@pytest.mark.gpu
@needs_gpu
def test_the_op_names_a_wrong_argument_as_its_fake_does():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dslaunch.kernels import fused_adam

    assert fused_adam._OP.load(), fused_adam._OP.error
    for change, message in [({"grads": lambda d: [torch.empty(3, device="cpu")]},
                             "fused adam_step: grads[0] is not on a CUDA"),
                            ({"exp_avgs": lambda d: [torch.empty(3, device=d, dtype=torch.bfloat16)]},
                             "fused adam_step: exp_avgs[0] has dtype bfloat16; expected float32"),
                            ({"exp_avg_sqs": lambda d: [torch.empty(4, device=d)]},
                             "fused adam_step: exp_avg_sqs[0] has 4 elements, the parameter has 3")]:
        real = _fake_args(torch.device("cuda"), **change)  # a device context: real tensors
        fake = _fake_args(FakeTensorMode(), **change)
        for args in (real, fake):
            with pytest.raises(RuntimeError, match=re.escape(message)):
                fused_adam._OP.torch_op.adam_step(**args)
