"""zero.Init on ranks that initialise differently, as DeepSpeed 0.19.8's Init answers it:

- each parameter takes the first rank's values before it is cut, so ranks seeded differently
  still build one model (checked against the model the first rank's seed builds in one process,
  cut parameters and the whole ones under the persistence threshold alike);
- `module.apply(fn)` inside the context runs fn with each module's cut parameters whole and
  keeps the first rank's result: DeepSpeed's own test (a parent filling its child's weight with
  1 + rank) sees every shard equal 1. Nested contexts still call fn once per module;
- a module is cut when its outermost __init__ returns, so a subclass that rewrites what its
  base's __init__ made (DeepSpeed's ancestry test) keeps its writes.

Measured under DeepSpeed 0.19.8 (2 CPU ranks, seeds 0 and 1, torch.nn.Linear(4, 4) under Init):
both ranks' gathered weights equal the seed-0 model's, at threshold 0 and at the default."""
import pytest
import torch

from dist_harness import run_function


class _Parent(torch.nn.Module):
    """DeepSpeed's TestZero3InitForParentWeightInitialization model, with a counted apply."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(12, 1)
        self.head = torch.nn.Linear(3, 2)
        self.apply(self._init_weights)

    def _init_weights(self, module):
        import torch.distributed as dist

        self._calls_seen = getattr(self, "_calls_seen", 0) + 1
        if isinstance(module, torch.nn.Linear):
            with torch.no_grad():
                module.weight.fill_(1 + dist.get_rank())
                module.bias.normal_()  # a different draw per rank: the first rank's is kept


def seeds_body(threshold):
    import torch.distributed as dist

    import dslaunch.runtime as deepspeed

    rank = dist.get_rank()
    cfg = {"train_micro_batch_size_per_gpu": 1,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": threshold}}
    torch.manual_seed(rank)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    with deepspeed.zero.GatheredParameters(list(net.parameters())):
        return {n: p.detach().clone() for n, p in net.named_parameters()}


@pytest.mark.parametrize("threshold", [0, 100000])
def test_differently_seeded_ranks_build_the_first_ranks_model(threshold):
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    for got in run_function(seeds_body, nprocs=2, kwargs={"threshold": threshold}, timeout=180):
        assert got.keys() == dict(reference.named_parameters()).keys()
        for name, p in reference.named_parameters():
            assert torch.equal(got[name], p.detach()), name


def apply_body(nested):
    import contextlib

    import torch.distributed as dist

    import dslaunch.runtime as deepspeed

    torch.manual_seed(dist.get_rank())
    cfg = {"train_micro_batch_size_per_gpu": 1,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    with contextlib.ExitStack() as stack:
        for _ in range(2 if nested else 1):
            stack.enter_context(deepspeed.zero.Init(config_dict_or_path=cfg))
        model = _Parent()
    out = {"shard": model.linear.weight.ds_tensor.detach().clone(), "calls": model._calls_seen,
           "restored": torch.nn.Module.apply is getattr(torch.nn.Module.apply, "__wrapped__", torch.nn.Module.apply)}
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        out.update({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


@pytest.mark.parametrize("nested", [False, True])
def test_apply_inside_init_sees_whole_parameters_and_keeps_the_first_ranks_result(nested):
    results = run_function(apply_body, nprocs=2, kwargs={"nested": nested}, timeout=180)
    for r in results:
        assert r["shard"].numel() == 6 and torch.equal(r["shard"], torch.ones(6)), r["shard"]  # ceil(12 / 2)
        assert torch.equal(r["linear.weight"], torch.ones(1, 12))
        assert torch.equal(r["head.weight"], torch.ones(2, 3))
        assert r["calls"] == 3  # the parent, linear, head: once each, nested or not
        assert r["restored"]  # Module.apply is torch's own again after the context
    for name in ("linear.bias", "head.bias"):  # the first rank's draw on every rank
        assert torch.equal(results[0][name], results[1][name]), name


class _HalvedLinear(torch.nn.Linear):
    """Writes what its base made after super().__init__() returns."""

    def __init__(self, *args):
        super().__init__(*args)
        with torch.no_grad():
            self.weight.mul_(0.5)
            self.bias.data = self.bias.data + 1


class _Son(_HalvedLinear):
    """DeepSpeed's ancestry test: each level rewrites its bases' parameters in its own __init__."""

    def __init__(self):
        super().__init__(4, 3)
        self.extra = torch.nn.Parameter(torch.ones(5))
        with torch.no_grad():
            self.weight.add_(1)
            self.extra.data = self.extra.data + 2


def subclass_body():
    import dslaunch.runtime as deepspeed

    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path={"zero_optimization": {"stage": 3}}):
        model = _Son()
    out = {"held": [p.numel() for p in model.parameters()]}
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        out.update({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


def test_a_subclass_writing_its_bases_parameters_is_cut_after_its_whole_init():
    torch.manual_seed(0)
    reference = _Son()
    for got in run_function(subclass_body, nprocs=2, timeout=180):
        assert got.pop("held") == [0, 0, 0]  # cut once the outermost __init__ returned
        for name, p in reference.named_parameters():
            assert torch.equal(got[name], p.detach()), name
