"""CPU Lion and Adagrad ops: agreement with torch.optim.Adagrad and with Lion's reference maths
in float64 on SIMD-tail sizes, half gradients and copy-out, every instruction set giving the
same bits, and state_dicts that move to and from torch's optimizers.

Tolerance: fp32 results against float64 runs, rtol=1e-6 / atol=1e-7 as for CPU Adam. Lion's
sign() makes an element whose direction c is within rounding of 0 free to move by 2*lr
either way, so the Lion comparison leaves out the (rare) elements where the float64 |c|
fell below 1e-6 at some step, and checks that they are rare.
"""
import copy

import pytest
import torch

from dslaunch.kernels import builder
from dslaunch.kernels.cpu_adagrad import CPUAdagrad, CpuAdagradOp, cpu_adagrad_available, cpu_adagrad_step
from dslaunch.kernels.cpu_lion import CPULion, CpuLionOp, cpu_lion_available, cpu_lion_step
from dslaunch.kernels.lamb import Lamb
from dslaunch.kernels.lion import Lion
from test_cpu_adam import MANY_SIZES, _model, _train

SIZES = [0, 1, 7, 1023, 1025, 10**5 + 3]
ADAGRAD_MODES = {
    "plain": dict(lr=0.05),
    "l2_and_decay": dict(lr=0.05, weight_decay=0.1, lr_decay=0.01),
    "maximize": dict(lr=0.05, maximize=True, initial_accumulator_value=0.1),
}


def _grads(size, steps, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(size, generator=gen)
    return p0, [(torch.randn(size, generator=gen) * 0.1 * (k + 1)).to(dtype) for k in range(steps)]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("mode", list(ADAGRAD_MODES))
def test_adagrad_matches_torch_adagrad_in_float64(size, mode):
    kw = ADAGRAD_MODES[mode]
    p0, grads = _grads(size, 5, seed=size)
    ref = p0.double().clone().requires_grad_(True)
    topt = torch.optim.Adagrad([ref], foreach=False, eps=1e-10, **kw)
    for g in grads:
        ref.grad = g.double()
        topt.step()
    p, s = p0.clone(), torch.full((size,), kw.get("initial_accumulator_value", 0.0))
    step_kw = {k: v for k, v in kw.items() if k != "initial_accumulator_value"}
    for k, g in enumerate(grads, start=1):
        cpu_adagrad_step(p, g, s, step=k, eps=1e-10, **step_kw)
    torch.testing.assert_close(p.double(), ref.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(s.double(), topt.state[ref]["sum"], rtol=1e-6, atol=1e-10)


def _lion_reference(p0, grads, lr, betas, wd):
    """Lion in float64, returning the result and a mask of elements whose direction stayed
    clear of zero at every step (where fp32 and fp64 must agree on its sign)."""
    p, m = p0.double().clone(), torch.zeros_like(p0, dtype=torch.float64)
    clear = torch.ones_like(p0, dtype=torch.bool)
    for g in grads:
        g = g.double()
        c = betas[0] * m + (1 - betas[0]) * g
        clear &= c.abs() > 1e-6
        p = p * (1 - lr * wd) - lr * torch.sign(c)
        m = betas[1] * m + (1 - betas[1]) * g
    return p, m, clear


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_lion_matches_the_reference_maths_in_float64(size, wd):
    lr, betas = 0.01, (0.9, 0.99)
    p0, grads = _grads(size, 6, seed=size + 1)
    ref_p, ref_m, clear = _lion_reference(p0, grads, lr, betas, wd)
    p, m = p0.clone(), torch.zeros(size)
    for g in grads:
        cpu_lion_step(p, g, m, lr=lr, betas=betas, weight_decay=wd)
    assert int((~clear).sum()) <= max(2, size // 1000)
    torch.testing.assert_close(p.double()[clear], ref_p[clear], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m.double(), ref_m, rtol=1e-6, atol=1e-7)


def test_lion_leaves_a_zero_direction_alone_and_keeps_nan():
    p, m = torch.ones(37), torch.zeros(37)
    g = torch.zeros(37)
    g[5] = float("nan")
    cpu_lion_step(p, g, m, lr=0.5, betas=(0.9, 0.99))
    assert torch.isnan(p[5]) and torch.equal(p[torch.arange(37) != 5], torch.ones(36))


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float16])
def test_half_gradients_and_copy_out(grad_dtype, out_dtype):
    size = 4099
    p0, grads = _grads(size, 3, seed=9, dtype=grad_dtype)
    out = torch.empty(size, dtype=out_dtype) if out_dtype else None
    # Adagrad against torch on the widened gradients; Lion against the fp32-gradient run.
    ref = p0.double().clone().requires_grad_(True)
    topt = torch.optim.Adagrad([ref], lr=0.05, foreach=False)
    p, s = p0.clone(), torch.zeros(size)
    for k, g in enumerate(grads, start=1):
        ref.grad = g.double()
        topt.step()
        cpu_adagrad_step(p, g, s, step=k, lr=0.05, copy_out=out)
    torch.testing.assert_close(p.double(), ref.detach(), rtol=1e-6, atol=1e-7)
    if out_dtype:
        assert torch.equal(out, p.to(out_dtype))
    a, b, ma, mb = p0.clone(), p0.clone(), torch.zeros(size), torch.zeros(size)
    for g in grads:
        cpu_lion_step(a, g, ma, lr=0.01, weight_decay=0.1, copy_out=out)
        cpu_lion_step(b, g.float(), mb, lr=0.01, weight_decay=0.1)
    assert torch.equal(a, b) and torch.equal(ma, mb)
    if out_dtype:
        assert torch.equal(out, a.to(out_dtype))


def test_many_tensors_in_one_call_equal_one_call_each():
    gen = torch.Generator().manual_seed(12)
    ps = [torch.randn(n, generator=gen) for n in MANY_SIZES]
    gs = [torch.randn(n, generator=gen).bfloat16() for n in MANY_SIZES]
    for step_fn, kw in ((cpu_lion_step, dict(lr=0.01, weight_decay=0.1)),
                        (cpu_adagrad_step, dict(step=1, lr=0.05, weight_decay=0.1))):
        many, single = [t.clone() for t in ps], [t.clone() for t in ps]
        state, state1 = [torch.zeros(n) for n in MANY_SIZES], [torch.zeros(n) for n in MANY_SIZES]
        outs = [torch.empty(n, dtype=torch.bfloat16) for n in MANY_SIZES]
        step_fn(many, gs, state, copy_out=outs, num_threads=2, **kw)
        for i in range(len(MANY_SIZES)):
            step_fn(single[i], gs[i], state1[i], num_threads=1, **kw)
        for a, b, sa, sb, o in zip(many, single, state, state1, outs):
            assert torch.equal(a, b) and torch.equal(sa, sb) and torch.equal(o, a.bfloat16()), step_fn.__name__


@pytest.mark.parametrize("isa", ["avx2", "scalar"])
def test_every_instruction_set_gives_the_same_bits(isa):
    missing = builder._ISA_NEEDS[isa] - builder.cpu_flags()
    if missing:
        pytest.skip(f"this CPU lacks {missing}")
    size = 1000 + 37
    p0, grads = _grads(size, 3, seed=4, dtype=torch.float16)
    results = []
    ops = (CpuLionOp(isa), CpuAdagradOp(isa))
    for lion_op, adagrad_op in ((None, None), ops):
        a, m, b, s = p0.clone(), torch.zeros(size), p0.clone(), torch.zeros(size)
        out = torch.empty(size, dtype=torch.bfloat16)
        for k, g in enumerate(grads, start=1):
            cpu_lion_step(a, g, m, lr=0.01, weight_decay=0.1, copy_out=out, op=lion_op)
            cpu_adagrad_step(b, g, s, step=k, lr=0.05, weight_decay=0.1, lr_decay=0.01, op=adagrad_op)
        results.append((a, m, b, s, out))
    for ours, other in zip(*results):
        assert torch.equal(ours, other)
    assert ops[0].lib.ds_cpu_lion_isa().decode() == isa and ops[1].lib.ds_cpu_adagrad_isa().decode() == isa


def test_adagrad_state_dict_moves_between_cpuadagrad_and_torch():
    kw = dict(lr=0.05, weight_decay=0.01, lr_decay=0.001, initial_accumulator_value=0.1)
    ours_model, torch_model = _model(), _model()
    ours, theirs = CPUAdagrad(ours_model.parameters(), **kw), torch.optim.Adagrad(torch_model.parameters(), **kw)
    _train(ours_model, ours, 3, seed=1)
    _train(torch_model, theirs, 3, seed=1)
    for a, b in zip(ours_model.parameters(), torch_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    theirs.load_state_dict(copy.deepcopy(ours.state_dict()))
    again = CPUAdagrad(ours_model.parameters(), **kw)
    again.load_state_dict(copy.deepcopy(theirs.state_dict()))
    _train(torch_model, theirs, 2, seed=2)
    _train(ours_model, again, 2, seed=2)
    for a, b in zip(ours_model.parameters(), torch_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert again.state_dict()["state"][0]["step"].item() == 5
    assert set(ours.state_dict()["param_groups"][0]) == set(theirs.state_dict()["param_groups"][0])


def test_cpulion_and_the_torch_lion_train_alike_and_share_state():
    a_model, b_model = _model(), _model()
    a, b = CPULion(a_model.parameters(), lr=1e-3, weight_decay=0.1), Lion(b_model.parameters(), lr=1e-3,
                                                                          weight_decay=0.1)
    _train(a_model, a, 4, seed=3)
    _train(b_model, b, 4, seed=3)
    for x, y in zip(a_model.parameters(), b_model.parameters()):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    assert torch.equal(b.state[next(b_model.parameters())]["exp_avg"], a.state[next(a_model.parameters())]["exp_avg"])


def test_lamb_follows_deepspeeds_fused_lamb_formula():
    torch.manual_seed(2)
    w0, g1, g2 = torch.randn(50), torch.randn(50), torch.randn(50)
    p = torch.nn.Parameter(w0.clone())
    opt = Lamb([p], lr=0.1, weight_decay=0.01, max_coeff=10.0, min_coeff=0.01)
    w, m, v = w0.double(), torch.zeros(50, dtype=torch.float64), torch.zeros(50, dtype=torch.float64)
    for t, g in enumerate((g1, g2), start=1):
        p.grad = g.clone()
        opt.step()
        g = g.double()
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        u = m / (v.sqrt() + 1e-8) + 0.01 * w
        trust = min(max(float(w.norm() / u.norm()), 0.01), 10.0)
        w = w - 0.1 * (1 - 0.999 ** t) ** 0.5 / (1 - 0.9 ** t) * trust * u
        assert opt.get_lamb_coeffs() == pytest.approx([trust], rel=1e-5)
    torch.testing.assert_close(p.detach().double(), w, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="gradient_clipping"):
        Lamb([p], max_grad_norm=1.0)


@pytest.mark.parametrize("which", ["lion", "adagrad"])
def test_bad_tensors_are_refused_by_name_before_any_is_stepped(which):
    """The op refuses first (in C++); the error is still the named ValueError/TypeError, and
    no tensor of the call was updated."""
    assert (cpu_lion_available if which == "lion" else cpu_adagrad_available)()  # the op's path, not the fallback
    def step(ps, gs, states):
        if which == "lion":
            cpu_lion_step(ps, gs, states, lr=0.1)
        else:
            cpu_adagrad_step(ps, gs, states, step=1, lr=0.1)

    p, g = torch.zeros(8), torch.ones(8)
    with pytest.raises(ValueError, match=r"grads\[1\] is not contiguous"):
        step([p, p.clone()], [g, torch.ones(16)[::2]], [torch.zeros(8), torch.zeros(8)])
    with pytest.raises(TypeError, match=r"grads\[1\] has dtype float16"):
        step([p, p.clone()], [g, g.half()], [torch.zeros(8), torch.zeros(8)])
    with pytest.raises(ValueError, match="2 params but 1 grads"):
        step([p, p.clone()], [g], [torch.zeros(8), torch.zeros(8)])
    assert torch.equal(p, torch.zeros(8))  # the first parameter, good on its own, was not stepped
    step([p], [g], [torch.zeros(8)])
    assert not torch.equal(p, torch.zeros(8))
