"""DeepSpeed module paths its unit tests import, served by dslaunch: each does its job here.

Through the installed compatibility package (one fresh interpreter): the modules are
dslaunch's own objects under DeepSpeed's names. Then each module's behaviour against a
one-process reference: rotary embedding against the rotation it defines, zero3_linear_wrap's
gradients against nn.functional.linear's (plain and under bf16 autocast), the config getters
against the full config parser, prefix_sum_inc, and the forced-CPU-optimizer refusal being
DeepSpeed's ZeRORuntimeException as well as a ConfigError."""
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

PROBE = textwrap.dedent('''
    import json
    import deepspeed, dslaunch.runtime as rt
    from deepspeed.ops.aio import AsyncIOBuilder
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.utils import ZeRORuntimeException
    from deepspeed.runtime.swap_tensor import MIN_SWAPPABLE_BYTES
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT, LOG_LEVEL_DEFAULT
    from deepspeed.runtime.config import get_gradient_clipping, get_log_level
    from deepspeed.runtime.utils import prefix_sum_inc
    from deepspeed.runtime.zero.linear import zero3_linear_wrap, LinearModuleForZeroStage3
    from deepspeed.sequence.layer import apply_rotary_pos_emb, _rotate_half, _torchembed_available
    from deepspeed.utils import logging as ds_logging
    from deepspeed.runtime.comm.coalesced_collectives import reduce_scatter_coalesced, all_to_all_quant_reduce
    from deepspeed.runtime.activation_checkpointing.checkpointing import non_reentrant_checkpoint
    from deepspeed.ops.op_builder import QuantizerBuilder
    import dslaunch.runtime.comm.coalesced as co, dslaunch.runtime.activation_checkpointing.checkpointing as ac
    import dslaunch.runtime.ops.op_builder as ob, dslaunch.runtime.zero.linear as zl
    print(json.dumps({
        "aio": [AsyncIOBuilder is ob.AsyncIOBuilder, deepspeed.ops.__compatible_ops__[AsyncIOBuilder.NAME]],
        "same": [zero3_linear_wrap is zl.zero3_linear_wrap, ZeRORuntimeException is rt.zero.utils.ZeRORuntimeException],
        "more": [reduce_scatter_coalesced is co.reduce_scatter_coalesced,
                 non_reentrant_checkpoint is deepspeed.checkpointing.non_reentrant_checkpoint
                 is ac.non_reentrant_checkpoint,
                 deepspeed.ops.__compatible_ops__[QuantizerBuilder.NAME]],
        "logger": ds_logging.logger is deepspeed.utils.logger and ds_logging.__name__ == "deepspeed.utils.logging",
        "constants": [GRADIENT_CLIPPING_DEFAULT, LOG_LEVEL_DEFAULT, MIN_SWAPPABLE_BYTES, _torchembed_available],
    }))
''')


def test_paths_under_the_compatibility_package(deepspeed_compat):
    env = dict(os.environ, PYTHONPATH=str(deepspeed_compat.target), CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["aio"] == [True, False]  # no libaio op here: NVMe cases take DeepSpeed's no-libaio path
    assert got["same"] == [True, True] and got["logger"] is True
    assert got["more"] == [True, True, False]  # no quantizer op: DeepSpeed's tests of it skip, as on its CPU build
    assert got["constants"] == [1.0, None, 1024 ** 2, False]


def test_rotary_embedding_rotates_each_pair_by_its_angle():
    from dslaunch.runtime.sequence.layer import apply_rotary_pos_emb

    torch.manual_seed(0)
    seq, heads, dim, rot = 5, 2, 8, 6
    t = torch.randn(seq, heads, dim)
    angles = torch.rand(seq, 1, rot // 2) * math.pi
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    got = apply_rotary_pos_emb(t, cos, sin)
    half = rot // 2
    for i in range(half):  # feature i and feature i + half form one complex number, rotated by its angle
        z = torch.complex(t[..., i], t[..., i + half]) * torch.polar(torch.ones(()), angles[..., i])
        assert torch.allclose(got[..., i], z.real, atol=1e-6) and torch.allclose(got[..., i + half], z.imag, atol=1e-6)
    assert torch.equal(got[..., rot:], t[..., rot:])  # features past the tables' width pass through


@pytest.mark.parametrize("shape", [(3,), (4, 3), (2, 4, 3)])
@pytest.mark.parametrize("autocast", [False, True])
def test_zero3_linear_wrap_matches_linear(shape, autocast):
    from dslaunch.runtime.zero.linear import LinearModuleForZeroStage3, zero3_linear_wrap

    torch.manual_seed(0)
    ref = torch.nn.Linear(3, 5)
    x = torch.randn(*shape, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    w, b = ref.weight.detach().clone().requires_grad_(True), ref.bias.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out_ref, out = ref(x), zero3_linear_wrap(x2, w, b)
    # (a custom autograd function's forward runs below autocast in torch, DeepSpeed's as this one:
    # the product is in the inputs' dtype, where nn.Linear's is bf16)
    assert torch.allclose(out.float(), out_ref.float(), atol=1e-2 if autocast else 1e-6)
    out_ref.float().square().sum().backward()
    out.float().square().sum().backward()
    tol = 5e-2 if autocast else 1e-5
    for mine, theirs in ((x2.grad, x.grad), (w.grad, ref.weight.grad), (b.grad, ref.bias.grad)):
        assert mine.dtype == theirs.dtype == torch.float32
        assert torch.allclose(mine, theirs, rtol=tol, atol=tol)
    layer = LinearModuleForZeroStage3(3, 5)
    layer.load_state_dict(ref.state_dict())
    assert torch.allclose(layer(x.detach()), ref(x.detach()))


def test_config_getters_parse_as_the_config_does():
    from dslaunch.runtime import ConfigError
    from dslaunch.runtime.config import get_gradient_clipping, get_log_level
    from dslaunch.runtime.utils import prefix_sum_inc

    assert get_gradient_clipping({}) == 1.0 and get_gradient_clipping({"gradient_clipping": 0.0}) == 0.0
    assert get_log_level({}) is None and get_log_level({"log_level": "error"}) == "error"
    with pytest.raises(ConfigError, match="log_level"):
        get_log_level({"log_level": "loud"})
    assert prefix_sum_inc([3, 4, 5]) == [3, 7, 12] and prefix_sum_inc([]) == []


def test_forced_cpu_optimizer_refusal_is_zero_runtime_exception():
    from dslaunch.runtime import ConfigError
    from dslaunch.runtime.optimizer_policy import ForcedCPUOptimizerError
    from dslaunch.runtime.zero.utils import ZeRORuntimeException

    assert issubclass(ForcedCPUOptimizerError, ConfigError)
    assert issubclass(ForcedCPUOptimizerError, ZeRORuntimeException)
