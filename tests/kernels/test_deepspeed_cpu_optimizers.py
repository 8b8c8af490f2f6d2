"""DeepSpeed's CPU optimizers (`deepspeed.ops.adam/lion/adagrad`) where DeepSpeed's op goes
beyond fp32 master parameters: bf16/fp16 parameters with fp32 or low-precision moments,
ZeRO-3 offload's step_subgroup / rollback_subgroup, and Adagrad's sparse gradients.

The reference is real DeepSpeed 0.19.8: tests/data/ds_cpu_optim.pt holds what its ops
computed for each case (scripts/make_ds_cpu_optim_fixtures.py, which replays the cases here
too). Rollback in forms DeepSpeed's op does not undo, and sparse gradients on a 2-D
embedding, are checked against the state before the step and torch.optim.Adagrad.
"""
import os
import sys

import pytest
import torch

from dslaunch.kernels import CPUAdam
from dslaunch.runtime.ops.adagrad import DeepSpeedCPUAdagrad
from dslaunch.runtime.ops.adam import DeepSpeedCPUAdam
from dslaunch.runtime.ops.lion import DeepSpeedCPULion
import repo_paths

HERE = str(repo_paths.TESTS)
sys.path.insert(0, str(repo_paths.SCRIPTS))
from make_ds_cpu_optim_fixtures import run  # noqa: E402  (the replay the fixture was made with)

FIXTURE = torch.load(os.path.join(HERE, "data", "ds_cpu_optim.pt"))
CLASSES = {c.__name__: c for c in (DeepSpeedCPUAdam, DeepSpeedCPULion, DeepSpeedCPUAdagrad)}
# one unit in the last place, relative: the op's fp32 rounding may differ from DeepSpeed's
ULP = {torch.float32: 2.0 ** -20, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}
# dslaunch's Adagrad keeps torch.optim.Adagrad's state name, so state dicts move to torch's
DS_NAME = {"sum": "exp_avg_sq"}


@pytest.mark.parametrize("name", sorted(FIXTURE["cases"]))
def test_matches_deepspeeds_op(name):
    case = FIXTURE["cases"][name]
    param, states = run(case, CLASSES)
    want = case["expected_param"]
    assert param.dtype == want.dtype
    assert not torch.equal(want, case["param"])
    if want.dtype == torch.float32:
        torch.testing.assert_close(param, want, rtol=1e-5, atol=0)
    else:  # fp32 maths rounded to the parameter's dtype: the same bits as DeepSpeed's
        assert torch.equal(param, want)
    assert sorted(states, key=str) == sorted(case["expected_states"], key=str)
    for key, state in states.items():
        ds = case["expected_states"][key]
        assert state["step"] == ds["step"]
        for k, t in state.items():
            if k == "step":
                continue
            ref = ds[DS_NAME.get(k, k)]
            assert t.dtype == ref.dtype, (k, t.dtype, ref.dtype)  # fp32, or the parameter's without fp32 states
            # the two ops round in a different order (fp32); a low-precision moment may then round
            # one unit apart, and later steps carry that unit on: two units at the tensor's scale
            scale = float(ref.float().abs().max())
            torch.testing.assert_close(t, ref, rtol=1e-4, atol=max(2 * ULP[ref.dtype] * scale, 1e-6))


@pytest.mark.parametrize("kwargs", [dict(weight_decay=0.1), dict(weight_decay=0.1, adamw_mode=False),
                                    dict(bias_correction=False, betas=(0.8, 0.9))])
def test_rollback_returns_to_the_state_before_each_step(kwargs):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(50))
    opt = DeepSpeedCPUAdam([p], lr=0.01, **kwargs)
    snapshots, grads = [], []
    for _ in range(3):
        snapshots.append((p.detach().clone(), {k: v.clone() for k, v in opt.state[0].items()}))
        # magnitudes kept off zero: undoing v = b2*v + (1-b2)*g^2 step by step cancels, and a
        # gradient far below a later one would be lost in the later one's rounding
        grads.append(torch.randn(50).sign() * (0.5 + torch.rand(50)))
        p.grad = grads[-1].clone()
        opt.step_subgroup(0)
    for g, (p_before, st_before) in zip(reversed(grads), reversed(snapshots)):
        p.grad = g.clone()  # the gradient the undone step used
        opt.rollback_subgroup(0)
        torch.testing.assert_close(p.detach(), p_before, rtol=1e-5, atol=1e-6)
        for k in ("exp_avg", "exp_avg_sq"):
            want = st_before.get(k, torch.zeros(50))
            torch.testing.assert_close(opt.state[0][k], want, rtol=1e-4, atol=1e-6)
    assert int(opt.state[0]["step"]) == 0


def test_subgroup_refusals_name_the_problem():
    p, q = torch.nn.Parameter(torch.randn(8)), torch.nn.Parameter(torch.randn(8))
    opt = DeepSpeedCPUAdam([p, q])
    p.grad = torch.randn(8)
    with pytest.raises(RuntimeError, match="Cannot rollback optimizer state for sub_group_id 3 as it has not"):
        opt.rollback_subgroup(3)
    opt.step_subgroup(3)
    opt.rollback_subgroup(3)
    with pytest.raises(RuntimeError, match="Cannot rollback sub_group_id 3: step count is 0"):
        opt.rollback_subgroup(3)
    q.grad = torch.randn(8)
    with pytest.raises(ValueError, match=r"step_subgroup\(3\): a sub-group is one flat parameter .* but 2 "):
        opt.step_subgroup(3)
    ams = DeepSpeedCPUAdam([p], amsgrad=True)
    ams.step_subgroup(0)
    with pytest.raises(ValueError, match="amsgrad=True cannot be undone"):
        ams.rollback_subgroup(0)


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")  # torch.optim.Adagrad's own sparse tensors
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_embedding_gradients_match_torch_adagrad(dtype):
    torch.manual_seed(0)
    emb = torch.nn.Embedding(40, 6, sparse=True).to(dtype)
    ref = torch.nn.Embedding(40, 6, sparse=True)
    ref.weight.data.copy_(emb.weight.float())
    ours, theirs = DeepSpeedCPUAdagrad(emb.parameters(), lr=0.1), torch.optim.Adagrad(ref.parameters(), lr=0.1)
    for _ in range(4):
        idx = torch.randint(0, 40, (10,))
        for module, opt in ((emb, ours), (ref, theirs)):
            opt.zero_grad()
            module(idx).float().pow(2).sum().backward()
            opt.step()
        if dtype == torch.bfloat16:  # the reference rounds its parameter as ours is stored
            ref.weight.data.copy_(ref.weight.to(dtype).float())
    assert emb.weight.dtype == dtype
    torch.testing.assert_close(emb.weight.float(), ref.weight, rtol=ULP[dtype], atol=1e-6)
    torch.testing.assert_close(ours.state[emb.weight]["sum"], theirs.state[ref.weight]["sum"], rtol=1e-5, atol=1e-6)


def test_fp32_parameters_take_the_fast_path_and_dslaunchs_cpuadam_still_refuses_bf16():
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(33)), torch.nn.Parameter(torch.randn(33))
    b.data.copy_(a.data)
    ds, ours = DeepSpeedCPUAdam([a], fp32_optimizer_states=False), CPUAdam([b], weight_decay=0.0)
    for _ in range(3):
        a.grad = torch.randn(33)
        b.grad = a.grad.clone()
        ds.step()
        ours.step()
    assert torch.equal(a, b) and ds.state[a]["exp_avg"].dtype == torch.float32  # fp32 parameter: fp32 moments
    low = torch.nn.Parameter(torch.randn(4).bfloat16())
    low.grad = torch.randn(4).bfloat16()
    with pytest.raises(TypeError, match="parameter 0 is torch.bfloat16 on cpu"):
        CPUAdam([low]).step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deepspeeds_fused_adam_steps_cpu_parameters_as_cpu_adam_does(dtype):
    """deepspeed.ops.adam.FusedAdam on CPU tensors (DeepSpeed's CPU accelerator builds it from
    its CPU Adam kernel): DeepSpeedCPUAdam's bits, with fp32 moments; torch.amp's grad_scale
    and found_inf are honoured as on the GPU."""
    from dslaunch.runtime.ops.adam import FusedAdam

    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(45).to(dtype))
    b = torch.nn.Parameter(a.detach().clone())
    fused, cpu = FusedAdam([a], lr=1e-2, weight_decay=0.1), DeepSpeedCPUAdam([b], lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        g = torch.randn(45).to(dtype)
        a.grad, b.grad = (g * 4).clone(), g.clone()
        fused.step(grad_scale=torch.full((1,), 4.0))
        cpu.step()
    assert torch.equal(a, b) and a.dtype == dtype and "dslaunch CPU Adam" in fused.describe()
    assert fused.state[a]["exp_avg"].dtype == torch.float32 and int(fused.state[a]["step"]) == 3
    torch.testing.assert_close(fused.state[a]["exp_avg_sq"], cpu.state[b]["exp_avg_sq"], rtol=0, atol=0)
    before = a.detach().clone()
    fused.step(found_inf=torch.ones(1))  # an overflowed step: nothing moves, the count included
    assert torch.equal(a, before) and int(fused.state[a]["step"]) == 3


def test_fp32_moments_stay_fp32_after_load_state_dict():
    """torch's load_state_dict casts a bf16 parameter's moments to bf16; with
    fp32_optimizer_states=True the next step keeps them fp32 again, as the first step made them
    (the loaded values are what the cast left: the step goes on from those)."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(40).bfloat16())
    opt = DeepSpeedCPUAdam([p])
    p.grad = torch.randn(40).bfloat16()
    opt.step()
    opt.load_state_dict(opt.state_dict())
    cast = opt.state[p]["exp_avg"]
    assert cast.dtype == torch.bfloat16  # torch's cast
    opt.step()
    assert opt.state[p]["exp_avg"].dtype == torch.float32 and opt.state[p]["exp_avg_sq"].dtype == torch.float32
    assert int(opt.state[p]["step"]) == 2
