"""deepspeed.checkpointing.non_reentrant_checkpoint (DeepSpeed's module path
deepspeed.runtime.activation_checkpointing.checkpointing): gradients and outputs equal the
segment run without checkpointing (the reference), dropout included, with inputs that need no
grad, keyword and non-tensor arguments and outputs; settings it cannot honour are refused."""
import pytest
import torch

from dslaunch.runtime.activation_checkpointing import checkpointing as ckpt
from dslaunch.runtime.strict import ConfigError


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x, *, scale=1.0, tag="t"):
        h = self.drop(torch.relu(self.a(x))) * scale
        with ckpt.get_cuda_rng_tracker().fork():  # a model-parallel dropout, from the tracker's state
            h = self.drop(h)
        return self.b(h), tag, (h > 0).sum()


def _grads(use_ckpt, x_grad):
    torch.manual_seed(0)
    block = Block()
    ckpt.get_cuda_rng_tracker().reset()
    ckpt.get_cuda_rng_tracker().add("model-parallel-rng", 1234)
    x = torch.randn(3, 6, requires_grad=x_grad)
    torch.manual_seed(7)
    if use_ckpt:
        out, tag, count = ckpt.non_reentrant_checkpoint(block, x, scale=2.0, tag="k")
    else:
        out, tag, count = block(x, scale=2.0, tag="k")
    out.pow(2).sum().backward()
    after = torch.rand(1)  # the generator continues as without checkpointing
    grads = [p.grad.clone() for p in block.parameters()] + ([x.grad.clone()] if x_grad else [])
    return out.detach(), tag, int(count), grads, after


@pytest.mark.parametrize("x_grad", [True, False])
def test_matches_the_segment_run_without_checkpointing(x_grad):
    ref, got = _grads(False, x_grad), _grads(True, x_grad)
    assert torch.equal(ref[0], got[0]) and ref[1:3] == got[1:3] == ("k", got[2])
    assert len(ref[3]) == len(got[3]) and all(torch.equal(a, b) for a, b in zip(ref[3], got[3]))
    assert all(g.abs().sum() > 0 for g in got[3])  # parameters get gradients with or without input grads
    assert torch.equal(ref[4], got[4])


def test_settings_only_the_reentrant_checkpoint_honours_are_refused():
    try:
        ckpt.configure(None, checkpoint_in_cpu=True)
        with pytest.raises(ConfigError, match="cpu_checkpointing applies to deepspeed.checkpointing.checkpoint"):
            ckpt.non_reentrant_checkpoint(torch.nn.Linear(2, 2), torch.randn(1, 2))
    finally:
        ckpt.reset()
