"""ZeRO++'s block quantizer: the compiled ops (CPU SIMD at every instruction set, CUDA on a
GPU) against the plain-torch specification (kernels/quantize_ref.py) bit for bit, and the
specification against DeepSpeed 0.19.8's kernel arithmetic worked by hand.

DeepSpeed's quantizer has no CPU build, so its bytes cannot be produced here: the worked
examples below follow its CUDA source (csrc/includes/quantization_utils.h: scale =
2^bits / (2 * absmax), __float2int_rn, clamp, the stored 1/scale; PackedInt4's nibble order;
CUDAQuantizer's block count), and tests/data/ds_zeropp/cuda_quantizer.pt holds what its own
kernels, compiled with its flags, gave on an H200 (scripts/zeropp_gpu_check.py --record):
the CPU op is replayed against those bytes."""
import shutil
import subprocess

import pytest
import torch

from dslaunch.kernels import builder, quantize_ref as ref
from dslaunch.kernels.elf import exported_functions
from dslaunch.kernels.quantizer import QuantizerOp, dequantize, quantize, quantizer_available
import repo_paths

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (elements, blocks): qwZ-sized blocks, odd block counts, int4-sized small blocks, tails
# shorter than a SIMD width
LAYOUTS = ((8000 * 3, 3), (64 * 17, 17), (1000, 10), (16 * 5, 5), (6, 1), (2 * 33, 33))


def _bits_of(t):
    return t.view({torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[t.dtype])


def _inputs(dtype, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-3, 2, n)[torch.randperm(n, generator=g)]
    x[::7] = 0
    # ties: values whose product with the scale lands exactly on .5 (a block of amax 1)
    if n >= 16:
        x[:4] = torch.tensor([1.0, 2.5 / 128, -3.5 / 128, 0.5 / 128])
    return x.to(dtype)


def _same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(_bits_of(a) if a.is_floating_point() else a, _bits_of(b) if b.is_floating_point() else b)


def test_the_cpu_op_builds():
    assert quantizer_available("cpu")


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_cpu_op_gives_the_reference_bytes_and_values(dtype, bits):
    for n, groups in LAYOUTS:
        x = _inputs(dtype, n, seed=n)
        q, s = quantize(x, groups, bits)
        q_ref, s_ref = ref.quantize(x, groups, bits)
        _same(q, q_ref)
        _same(s, s_ref)
        for out in DTYPES:
            _same(dequantize(q, s, bits, out), ref.dequantize(q, s, bits, out))


@pytest.mark.parametrize("isa", ["avx2", "scalar"])
def test_every_instruction_set_gives_the_same_bits(isa):
    missing = builder._ISA_NEEDS[isa] - builder.cpu_flags()
    if missing:
        pytest.skip(f"this CPU lacks {missing}")
    op = QuantizerOp(isa)
    for dtype in DTYPES:
        for bits in (8, 4):
            x = _inputs(dtype, 33 * 130, seed=bits)
            q, s = quantize(x, 33, bits, op=op)
            _same(q, ref.quantize(x, 33, bits)[0])
            _same(s, ref.quantize(x, 33, bits)[1])
            _same(dequantize(q, s, bits, torch.bfloat16, op=op), ref.dequantize(q, s, bits, torch.bfloat16))
    assert op.lib.ds_quant_isa().decode() == isa


def test_deepspeeds_arithmetic_worked_by_hand():
    """One block of amax 1: DeepSpeed's scale is 2^bits / 2 = 128 (int8) or 8 (int4); the
    stored scale is its inverse; q = rint(x * scale) with ties to even, clamped (so +amax,
    which lands on 128, becomes 127)."""
    x = torch.tensor([1.0, -1.0, 2.5 / 128, 3.5 / 128, -0.5 / 128, 0.0, 0.25, -0.75], dtype=torch.float16)
    q, s = quantize(x, 1, 8)
    assert q.tolist() == [127, -128, 2, 4, 0, 0, 32, -96]
    assert s.tolist() == [1 / 128]
    assert dequantize(q, s, 8).tolist() == [127 / 128, -1.0, 2 / 128, 4 / 128, 0.0, 0.0, 0.25, -0.75]
    q4, s4 = quantize(x, 1, 4)
    # int4 values [7, -8, 0, 0, 0, 0, 2, -6]: the first of each pair in the high nibble
    assert [b & 0xFF for b in q4.tolist()] == [0x78, 0x00, 0x00, 0x2A]
    assert s4.tolist() == [1 / 8]
    assert dequantize(q4, s4, 4, torch.float32).tolist() == [7 / 8, -1.0, 0.0, 0.0, 0.0, 0.0, 0.25, -0.75]


def test_a_block_of_zeros_keeps_scale_one_and_a_nonfinite_block_dequantizes_to_nan():
    x = torch.zeros(32)
    x[17] = float("inf")
    x[20] = 3.0
    q, s = quantize(x, 4, 8)  # blocks of 8: zeros, zeros, inf + 3.0, zeros
    assert s[0].item() == 1.0 and torch.isnan(s[2]) and q[16:24].eq(0).all()
    back = dequantize(q, s, 8, torch.float32)
    assert back[:16].eq(0).all() and torch.isnan(back[16:24]).all()
    y = torch.zeros(16)
    y[3] = float("nan")
    assert torch.isnan(dequantize(*quantize(y, 2, 4), 4, torch.float32)[:8]).all()
    tiny = torch.zeros(8)
    tiny[1] = 1e-40  # its scale 2^8 / 2e-40 overflows float32: a block of zeros
    qt, st = quantize(tiny, 1, 8)
    assert st.item() == 0.0 and qt.eq(0).all()


def test_deepspeeds_qwz_block_count():
    """CUDAQuantizer's search: ceil(n / 8000) upwards to a block size that is a multiple of
    8, then doubled while the blocks stay above 8000 elements."""
    assert ref.qwz_groups(8) == 1
    assert ref.qwz_groups(8000) == 1
    assert ref.qwz_groups(16000) == 2
    assert ref.qwz_groups(8008) == 7  # 2..6 do not give multiples of 8; 8008 = 7 * 1144
    assert ref.qwz_groups(1 << 20) == 256  # 132..255 do not divide; blocks of 4096
    assert ref.qwz_groups(8 * 10007) == 10007  # a prime: blocks of 8 elements
    assert ref.qwz_groups(64000 * 8) == 64
    for n in (8, 64, 8000, 8008, 24000, 1 << 20, 8 * 10007, 123456 * 8):
        g = ref.qwz_groups(n)
        assert n % (8 * g) == 0 and n // g < 16000
    with pytest.raises(ValueError, match="multiple of 8"):
        ref.qwz_groups(12)


DS_CUDA = torch.load(repo_paths.DATA / "ds_zeropp/cuda_quantizer.pt")


def _ulps(a, b):
    return int((a.contiguous().view(torch.int32).long() - b.contiguous().view(torch.int32).long()).abs().max())


def test_deepspeeds_cuda_kernels_give_our_bytes_up_to_their_fast_math_scales():
    """DeepSpeed's own CUDA quantizer on an H200 (recorded): every int8 and int4 byte the CPU
    op writes for the same fp16 input is DeepSpeed's; its scales (1/scale, a division
    compiled with --use_fast_math) are within 2 ulps of the IEEE ones; and dequantizing
    DeepSpeed's bytes gives DeepSpeed's fp16 values bit for bit."""
    cases = [c for c in DS_CUDA["cases"] if c["kind"] == "quantize"]
    assert DS_CUDA["deepspeed"] == "0.19.8" and len(cases) == 8
    for c in cases:
        q, s = quantize(c["x"], c["groups"], c["bits"])
        _same(q, c["q"])
        assert _ulps(s, c["scales"]) <= 2
        _same(dequantize(c["q"], c["scales"], c["bits"], torch.float16), c["dequantized"])


def test_deepspeeds_cuda_swizzle_and_reduction_are_what_qgz_and_the_fixture_run_compute():
    """qgZ's first stage (our blocks moved into DeepSpeed's swizzled order, zeropp._swizzle)
    gives DeepSpeed's swizzle_quant bytes; scripts/ds_cpu_quantizer.py (what DeepSpeed's
    fixture run used in place of its CUDA kernels) gives its swizzle_quant and
    quantized_reduction bytes; scales within 2 ulps (fast math)."""
    import sys

    sys.path.insert(0, str(repo_paths.SCRIPTS))
    import ds_cpu_quantizer as dsq

    from dslaunch.runtime.zero.zeropp import _swizzle

    cases = [c for c in DS_CUDA["cases"] if c["kind"] == "swizzle"]
    assert len(cases) == 4
    hosts = local = 2
    for c in cases:
        for x, ds_q, ds_s in zip(c["x"], c["q"], c["scales"]):
            q, s = quantize(x, c["groups"], 4)
            _same(_swizzle(q, hosts, local).reshape(-1), ds_q)
            assert _ulps(_swizzle(s, hosts, local).reshape(-1), ds_s) <= 2
            eq, es = dsq.swizzle_quant(x, c["groups"], 4, dsq.Symmetric, 1, hosts, local)
            _same(eq, ds_q)
            assert _ulps(es, ds_s) <= 2
        got_q = torch.cat([q.chunk(local)[0] for q in c["q"]])
        got_s = torch.cat([s.chunk(local)[0] for s in c["scales"]])
        rq, rs = dsq.quantized_reduction(got_q, got_s, c["groups"], c["groups"] // local, 4, dsq.Symmetric, local)
        _same(rq.reshape(-1), c["reduced_q"])
        assert _ulps(rs, c["reduced_scales"]) <= 2


def test_bad_layouts_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"quantize: 10 elements do not split into 3 equal blocks"):
        quantize(torch.zeros(10), 3, 8)
    with pytest.raises(ValueError, match=r"int4 blocks pack two elements a byte; 5 elements per block is odd"):
        quantize(torch.zeros(10), 2, 4)
    with pytest.raises(ValueError, match=r"bits must be 4 or 8, got 2"):
        quantize(torch.zeros(8), 1, 2)
    with pytest.raises(TypeError, match="expected float32, bfloat16 or float16"):
        quantize(torch.zeros(8, dtype=torch.float64), 1, 8)
    op = QuantizerOp()
    assert op.load()
    with pytest.raises(RuntimeError, match=r"quantize_into: q has 4 bytes; 8 elements at 8 bits take 8"):
        op.torch_op[0](torch.zeros(8), torch.zeros(4, dtype=torch.int8), torch.zeros(1), 8, 1)


def test_torch_compile_traces_the_op():
    f = torch.compile(lambda x: dequantize(*quantize(x, 4, 8), 8, torch.float32), fullgraph=False, backend="eager")
    x = _inputs(torch.float32, 64)
    assert torch.equal(f(x), ref.dequantize(*ref.quantize(x, 4, 8), 8, torch.float32))


@pytest.mark.timeout(300)
def test_nvcc_compiles_the_cuda_op_and_links_the_exports(tmp_path):
    """Here (CPU torch, nvcc): quantizer.cu and quantizer_cuda_op.cpp through nvcc with
    cpp_extension's flags and -Werror, linked, every C entry point exported."""
    spec = builder.quantizer_cuda_spec(["9.0"])
    cmds = builder.nvcc_check_commands(spec, tmp_path, werror=True)
    assert shutil.which(cmds[0][0]), f"{cmds[0][0]} is not installed: CI compiles the CUDA op with it"
    for cmd in cmds:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
        assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}"
    assert set(spec.symbols) <= exported_functions((tmp_path / "ds_quant_cuda.so").read_bytes())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("bits", [8, 4])
def test_the_cuda_op_gives_the_reference_bytes(bits):
    assert quantizer_available("cuda")
    for dtype in DTYPES:
        for n, groups in LAYOUTS:
            x = _inputs(dtype, n, seed=n)
            q, s = quantize(x.cuda(), groups, bits)
            q_ref, s_ref = ref.quantize(x, groups, bits)
            _same(q.cpu(), q_ref)
            _same(s.cpu(), s_ref)
            for out in DTYPES:
                _same(dequantize(q, s, bits, out).cpu(), ref.dequantize(q_ref, s_ref, bits, out))
