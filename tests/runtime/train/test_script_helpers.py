"""DeepSpeed's script-facing helpers in deepspeed.runtime.utils and deepspeed.utils.groups that
its own unit tests call (tests/unit/runtime/test_runtime_utils.py): call_to_str,
count_used_parameters_in_backward, get_weight_norm, CheckOverflow, and the expert groups a
script builds without an engine (_create_expert_and_data_parallel). References: torch's own
norms, and what DeepSpeed's code computes for the same inputs, worked by hand below."""
import math

import pytest
import torch

from dist_harness import run_function


def test_call_to_str_reads_as_the_call():
    from dslaunch.runtime.utils import call_to_str

    assert call_to_str("int") == "int()"
    assert call_to_str("int", 3, "jeff") == "int(3, 'jeff')"
    assert call_to_str("hello", 1138, val=3) == "hello(1138, val=3)"


def test_count_used_parameters_counts_what_this_backward_reaches():
    from dslaunch.runtime.utils import count_used_parameters_in_backward

    used, unused, frozen = (torch.nn.Parameter(torch.ones(2)) for _ in range(3))
    frozen.requires_grad_(False)
    seen = []
    x = used * 2 + frozen
    y = unused * 3  # a graph of its own: not reached by x's backward
    x.register_hook(lambda g: seen.append(count_used_parameters_in_backward([used, unused, frozen, used])))
    x.sum().backward()
    assert seen == [1]
    seen.clear()
    x = used * 2 + frozen
    x.register_hook(lambda g: seen.append(count_used_parameters_in_backward([used, unused, frozen, used])))
    (x.sum() + y.sum()).backward()
    assert seen == [2]
    with pytest.raises(RuntimeError, match="during backward"):
        count_used_parameters_in_backward([used])


def test_get_weight_norm_is_the_norm_of_the_values_and_minus_one_on_overflow():
    from dslaunch.runtime.utils import get_weight_norm

    torch.manual_seed(0)
    ps = [torch.randn(3, 4), torch.randn(5)]
    for norm_type in (1, 2, 3, math.inf):
        want = torch.linalg.vector_norm(torch.cat([p.flatten() for p in ps]), norm_type).item()
        assert get_weight_norm(ps, norm_type) == pytest.approx(want, rel=1e-5)
    assert get_weight_norm([ps[0], torch.tensor([float("inf")])]) == -1
    assert get_weight_norm(torch.tensor([float("nan")])) == -1


def groups_body(ranked_inf: bool):
    import torch.distributed as dist

    from dslaunch.runtime.utils import CheckOverflow, clip_grad_norm_, get_weight_norm
    from dslaunch.runtime.core.parallel import groups
    from torch._utils import _flatten_dense_tensors

    rank = dist.get_rank()
    groups._create_expert_and_data_parallel(2)
    groups._create_expert_and_data_parallel(2)  # again: the groups there are kept
    shared, expert = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    expert.allreduce = False  # what MoE's experts carry
    shared.grad = torch.tensor([1.0])
    expert.grad = torch.tensor([float("inf") if ranked_inf and rank == 1 else rank + 1.0])
    out = {"expert_ranks": groups._get_expert_parallel_world_size(),
           "check": CheckOverflow([[shared, expert]]).check(),
           "check_plain": CheckOverflow([[shared]]).check()}
    norm = get_weight_norm([_flatten_dense_tensors([shared.grad, expert.grad])])
    out["by_norm"] = CheckOverflow([[shared, expert]]).check_using_norm([norm], reduce_overflow=False)
    if not ranked_inf:
        out["clip_norm"] = float(clip_grad_norm_([shared, expert], max_norm=0.1))
    return out


def test_an_expert_overflow_on_one_rank_is_seen_by_both():
    got = run_function(groups_body, nprocs=2, kwargs={"ranked_inf": True}, timeout=180)
    assert [g["expert_ranks"] for g in got] == [2, 2]
    assert [g["check"] for g in got] == [True, True]  # agreed over the expert-parallel group
    assert [g["by_norm"] for g in got] == [True, True]
    assert [g["check_plain"] for g in got] == [False, False]  # no expert parameter: each rank its own


def test_clip_grad_norm_is_one_number_on_every_rank():
    """DeepSpeed's TestClipGradNorm::test_gather: the per-rank norms (sqrt 2 and sqrt 5) are
    averaged over the data-parallel group."""
    got = run_function(groups_body, nprocs=2, kwargs={"ranked_inf": False}, timeout=180)
    want = (math.sqrt(2) + math.sqrt(5)) / 2
    assert [g["clip_norm"] for g in got] == pytest.approx([want, want], rel=1e-6)
    assert [g["check"] for g in got] == [False, False]
