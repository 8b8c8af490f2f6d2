"""deepspeed.runtime.zero.linear's zero3_linear_wrap against torch's F.linear: the same values
and gradients, and under autocast the same output dtype (DeepSpeed 0.19.8 on a CPU gives
bfloat16 under bf16 autocast for every input rank, as F.linear does)."""
import pytest
import torch
import torch.nn.functional as F

from dslaunch.runtime.zero.linear import zero3_linear_wrap


@pytest.mark.parametrize("shape", [(5,), (3, 5), (2, 3, 5)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_values_and_gradients_equal_f_linear(shape, with_bias):
    torch.manual_seed(0)
    x = torch.randn(*shape, requires_grad=True)
    w = torch.randn(4, 5, requires_grad=True)
    b = torch.randn(4, requires_grad=True) if with_bias else None
    ours = zero3_linear_wrap(x, w, b)
    ours.square().sum().backward()
    got = [t.grad.clone() for t in (x, w, b) if t is not None]
    for t in (x, w, b):
        if t is not None:
            t.grad = None
    ref = F.linear(x, w, b)
    ref.square().sum().backward()
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    for g, t in zip(got, [t for t in (x, w, b) if t is not None]):
        torch.testing.assert_close(g, t.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(5,), (3, 5), (2, 3, 5)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_autocast_keeps_the_products_dtype(shape, with_bias):
    torch.manual_seed(0)
    x = torch.randn(*shape)
    w = torch.randn(4, 5, requires_grad=True)
    b = torch.randn(4, requires_grad=True) if with_bias else None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = zero3_linear_wrap(x, w, b)
        ref = F.linear(x, w, b)
    assert ours.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(ours.float(), ref.float(), rtol=2e-2, atol=2e-2)
    ours.float().sum().backward()
    assert w.grad.dtype == torch.float32 and (b is None or b.grad.dtype == torch.float32)


def test_the_exported_autocast_decorators_are_torch_amps_for_this_device():
    """A script's own autograd function decorated with the module's autocast_custom_fwd(cast_inputs=
    float32) gets fp32 inputs under bf16 autocast, and its backward runs under forward's autocast
    state, as with torch.amp.custom_fwd/custom_bwd for the accelerator's device type."""
    from dslaunch.runtime.zero.linear import autocast_custom_bwd, autocast_custom_fwd

    seen = {}

    class Square(torch.autograd.Function):
        @staticmethod
        @autocast_custom_fwd(cast_inputs=torch.float32)
        def forward(ctx, x):
            seen["forward"] = (x.dtype, torch.is_autocast_enabled("cpu"))
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        @autocast_custom_bwd
        def backward(ctx, grad):
            seen["backward"] = torch.is_autocast_enabled("cpu")
            (x,) = ctx.saved_tensors
            return 2 * x * grad

    x = torch.randn(3, dtype=torch.bfloat16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = Square.apply(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # an outer region backward must not inherit
        y.sum().backward()
    assert y.dtype == torch.float32
    assert seen == {"forward": (torch.float32, False), "backward": False}
    assert autocast_custom_fwd.func is torch.amp.custom_fwd and autocast_custom_fwd.keywords == {"device_type": "cpu"}
