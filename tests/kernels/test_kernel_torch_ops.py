"""The CPU optimizer kernels as torch ops built through torch.utils.cpp_extension: the op's
own boundary checks, per-parameter step counts, and torch.compile of an optimizer step.

References: the same kernels called through the Python API (which the parity tests in
test_cpu_adam.py / test_cpu_lion_adagrad.py hold against torch's optimizers in float64),
and the eager optimizer for the compiled one: bit-identical, not close.
"""
import os

import pytest
import torch

from dslaunch.kernels import builder
from dslaunch.kernels.cpu_adagrad import CPUAdagrad, _OP as ADAGRAD_OP, cpu_adagrad_step
from dslaunch.kernels.cpu_adam import CPUAdam, _OP as ADAM_OP, cpu_adam_step
from dslaunch.kernels.cpu_lion import CPULion, _OP as LION_OP


@pytest.fixture(scope="module", autouse=True)
def ops_cache(tmp_path_factory):
    root = tmp_path_factory.getbasetemp() / "ops-cache"  # the session's cache (test_cpu_adam.py shares it)
    old = os.environ.get(builder.CACHE_ENV)
    os.environ[builder.CACHE_ENV] = str(root)
    yield root
    if old is None:
        os.environ.pop(builder.CACHE_ENV, None)
    else:
        os.environ[builder.CACHE_ENV] = old


def _adam_op():
    assert ADAM_OP.load(), ADAM_OP.error
    return ADAM_OP.torch_op


def test_the_ops_are_registered_torch_ops_built_by_cpp_extension():
    for op, name in ((ADAM_OP, "adam_step"), (LION_OP, "lion_step"), (ADAGRAD_OP, "adagrad_step")):
        assert op.load(), op.error
        assert isinstance(op.torch_op, torch._ops.OpOverload)
        namespace = op.torch_op.namespace
        assert namespace.startswith(op.built.name + "_")  # the build's own namespace
        assert getattr(getattr(torch.ops, namespace), name).default is op.torch_op
        assert op.built.extra["built_by"] == "torch.utils.cpp_extension"
        schema = str(op.torch_op._schema)
        assert "Tensor(a!)[] params" in schema and "Tensor[] grads" in schema


def _adam_args(n=100, **change):
    args = dict(params=[torch.ones(n)], grads=[torch.full((n,), 0.5)], exp_avgs=[torch.zeros(n)],
                exp_avg_sqs=[torch.zeros(n)], max_exp_avg_sqs=[], copy_out=[], steps=[], step=1, lr=0.1, beta1=0.9,
                beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True, amsgrad=False, maximize=False,
                bias_correction=True, num_threads=1)
    args.update(change)
    return args


@pytest.mark.parametrize("change, words", [
    (dict(grads=[torch.full((100,), 0.5, dtype=torch.float64)]), ["grads[0]", "float64"]),
    (dict(exp_avgs=[torch.zeros(100, dtype=torch.bfloat16)]), ["exp_avgs[0]", "bfloat16", "expected float32"]),
    (dict(exp_avg_sqs=[torch.zeros(99)]), ["exp_avg_sqs[0]", "99 elements", "100"]),
    (dict(exp_avgs=[torch.zeros(200)[::2]]), ["exp_avgs[0]", "not contiguous"]),
    (dict(copy_out=[torch.zeros(100)]), ["copy_out[0]", "float32", "bfloat16 or float16"]),
    (dict(grads=[]), ["1 params but 0 grads"]),
    (dict(amsgrad=True), ["amsgrad=True needs max_exp_avg_sqs"]),
    (dict(step=0), ["step must be >= 1"]),
    (dict(steps=[torch.tensor(0.0)]), ["steps[0]", ">= 1"]),
    (dict(steps=[torch.tensor(1.0, dtype=torch.float64)]), ["steps[0]", "one-element float32"]),
])
def test_the_op_itself_rejects_a_bad_argument_naming_it(change, words):
    """Called directly (no Python checks in front), the C++ op refuses with one error."""
    args = _adam_args(**change)
    before = args["params"][0].clone()
    with pytest.raises(RuntimeError) as info:
        _adam_op()(**args)
    msg = str(info.value)
    assert "adam_step: " in msg and all(w in msg for w in words), msg
    assert torch.equal(args["params"][0], before)  # refused before anything was written


def test_a_tensor_on_another_device_is_refused_naming_it():
    args = _adam_args(grads=[torch.full((100,), 0.5, device="meta")])
    with pytest.raises(ValueError, match=r"adam_step: grads\[0\] is on meta; the CPU op needs CPU tensors"):
        _adam_op()(**args)


def test_lion_and_adagrad_ops_check_their_own_arguments():
    assert LION_OP.load() and ADAGRAD_OP.load()
    with pytest.raises(RuntimeError, match=r"lion_step: exp_avgs\[0\] has 3 elements, the parameter has 4"):
        LION_OP.torch_op([torch.ones(4)], [torch.ones(4)], [torch.zeros(3)], [], 0.1, 0.9, 0.99, 0.0, 1)
    with pytest.raises(RuntimeError, match=r"adagrad_step: sums\[0\] has dtype float16; expected float32"):
        ADAGRAD_OP.torch_op([torch.ones(4)], [torch.ones(4)], [torch.zeros(4, dtype=torch.half)], [], [], 1, 0.1,
                            0.0, 1e-10, 0.0, False, 1)


def test_per_parameter_step_tensors_equal_one_call_per_step_count():
    """The op groups parameters by their step tensors' counts: the same bits as calling it
    once per count with an int step (what the optimizer did before it passed tensors)."""
    torch.manual_seed(0)
    sizes, counts = [33, 1030, 7, 64], [3, 1, 3, 2]
    params = [torch.randn(n) for n in sizes]
    grads = [torch.randn(n) for n in sizes]
    exp_avgs = [torch.rand(n) for n in sizes]
    exp_avg_sqs = [torch.rand(n) for n in sizes]
    sums = [torch.rand(n) for n in sizes]
    hp = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.05)
    a = [t.clone() for t in params], [t.clone() for t in exp_avgs], [t.clone() for t in exp_avg_sqs]
    cpu_adam_step(*a[:1], grads, *a[1:], step=[torch.tensor(float(c)) for c in counts], **hp)
    b = [t.clone() for t in params], [t.clone() for t in exp_avgs], [t.clone() for t in exp_avg_sqs]
    for i, c in enumerate(counts):
        cpu_adam_step(b[0][i], grads[i], b[1][i], b[2][i], step=c, **hp)
    for x, y in zip(sum(a, []), sum(b, [])):
        assert torch.equal(x, y)
    pa, sa = [t.clone() for t in params], [t.clone() for t in sums]
    cpu_adagrad_step(pa, grads, sa, step=[torch.tensor(float(c)) for c in counts], lr=0.1, lr_decay=0.1)
    for i, c in enumerate(counts):
        p, s = params[i].clone(), sums[i].clone()
        cpu_adagrad_step(p, grads[i], s, step=c, lr=0.1, lr_decay=0.1)
        assert torch.equal(p, pa[i]) and torch.equal(s, sa[i])


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("make", [lambda ps: CPUAdam(ps, lr=1e-2, amsgrad=True),
                                  lambda ps: CPUAdagrad(ps, lr=1e-2, lr_decay=0.01),
                                  lambda ps: CPULion(ps, lr=1e-3, weight_decay=0.1)],
                         ids=["adam", "adagrad", "lion"])
def test_torch_compile_traces_the_optimizer_step_whole_and_matches_eager(make):
    """fullgraph=True: a graph break anywhere in step() (state creation, step counting, the
    op) fails the compile. The compiled optimizer trains bit-identically to the eager one."""
    torch._dynamo.reset()
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    eager_model, compiled_model = _model(), _model()
    eager, compiled = make(eager_model.parameters()), make(compiled_model.parameters())
    compiled_step = torch.compile(compiled.step, fullgraph=True)
    for model, step in ((eager_model, eager.step), (compiled_model, compiled_step)):
        for _ in range(3):
            torch.nn.functional.mse_loss(model(x), y).backward()
            step()
            model.zero_grad()
    for p, q in zip(eager_model.parameters(), compiled_model.parameters()):
        assert torch.equal(p, q)
        for key, value in eager.state[p].items():
            assert torch.equal(value, compiled.state[q][key]), key
    assert float(compiled.state[next(compiled_model.parameters())]["step"]) == 3.0


def test_default_threads_carries_torch_compiles_constant_mark_without_importing_dynamo():
    """The ops' default thread count is marked constant for torch.compile (the fullgraph test
    above traces through it) with the mark torch's own decorator sets, and importing the
    kernels does not import torch._dynamo (seconds in every process that builds an optimizer)."""
    import subprocess
    import sys

    from dslaunch.kernels import tensor_args

    def probe():
        return 1

    torch.compiler.assume_constant_result(probe)
    assert getattr(probe, tensor_args.DYNAMO_CONSTANT_MARK) is True
    assert getattr(tensor_args.default_threads, tensor_args.DYNAMO_CONSTANT_MARK) is True
    code = ("import sys, dslaunch.kernels.cpu_adam, dslaunch.kernels.cpu_lion, dslaunch.kernels.cpu_adagrad; "
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
