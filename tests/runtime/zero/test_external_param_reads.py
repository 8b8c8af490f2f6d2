"""A ZeRO-3 forward that reads another module's parameter by name, after that module's own
forward has released it, trains as DeepSpeed 0.19.8 trains it: the read gathers the parameter
and registers it as external to the module whose forward is running (DeepSpeed's own test,
TestSerialContext::test_ext_param_getattr, is the first model here). Before, the read saw the
empty tensor of a released parameter and F.linear failed on a size mismatch.

A module whose forward returns one of its parameters (`return out, self.bias`) hands it to the
module running around it, which uses it after the child's forward ended: DeepSpeed registers
it as external to that module ("dangling" parameters) and trains it. Before, the child's
post-forward released it and the parent's `h + bias` failed on a size mismatch (8 and 0).

Reference: the same script at ZeRO stage 0 (every parameter whole), 2 ranks, same data."""
import pytest
import torch

from dist_harness import run_function


class RootReads(torch.nn.Module):
    """The root, with no parameter of its own, reads linear1.weight after linear1 ran."""

    def __init__(self, dim=8):
        super().__init__()
        self.linear1 = torch.nn.Linear(dim, dim)
        self.linear2 = torch.nn.Linear(dim, dim)

    def forward(self, x):
        h = self.linear2(self.linear1(x))
        return torch.nn.functional.linear(h, self.linear1.weight).pow(2).mean()


class Head(torch.nn.Module):
    """A module with a parameter of its own whose forward also reads a sibling's weight."""

    def __init__(self, owner, dim=8):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(dim))
        self.__dict__["owner"] = owner  # a reference, not a child: the weight stays owner's

    def forward(self, h):
        return torch.nn.functional.linear(h * self.scale, self.owner.weight)


class SiblingReads(torch.nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.embed = torch.nn.Linear(dim, dim, bias=False)
        self.mid = torch.nn.Linear(dim, dim)
        self.head = Head(self.embed, dim)

    def forward(self, x):
        return self.head(torch.tanh(self.mid(self.embed(x)))).pow(2).mean()


class BiasOut(torch.nn.Linear):
    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight, self.bias), self.bias


class ReturnsBias(torch.nn.Module):
    """A child returns its trainable bias in a tuple; the root adds it after the child ran."""

    def __init__(self, dim=8):
        super().__init__()
        self.producer = BiasOut(dim, dim)
        self.head = torch.nn.Linear(dim, dim)

    def forward(self, x):
        h, bias = self.producer(x)
        return self.head(torch.tanh(h + bias)).pow(2).mean()


class PassesOn(torch.nn.Module):
    """Receives the child's weight and returns it again, in a dict: it travels two levels up."""

    def __init__(self, dim=8):
        super().__init__()
        self.inner = BiasOut(dim, dim)

    def forward(self, x):
        h, bias = self.inner(x)
        return {"h": torch.tanh(h + bias), "weight": self.inner.weight}


class ReturnsTwice(torch.nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.block = PassesOn(dim)
        self.head = torch.nn.Linear(dim, dim)

    def forward(self, x):
        out = self.block(x)
        return torch.nn.functional.linear(self.head(out["h"]), out["weight"]).pow(2).mean()


class PassesTupleOn(PassesOn):
    """Receives the child's bias in a tuple and returns it again in one (DeepSpeed's DanglingAttention)."""

    def forward(self, x):
        h, bias = self.inner(x)
        return torch.tanh(h), bias


class ReturnsTwiceTuple(torch.nn.Module):
    """The bias travels two levels up as tuple items: what the middle module returns for it is
    no longer the parameter but the tensor its output hooks made of it."""

    def __init__(self, dim=8):
        super().__init__()
        self.block = PassesTupleOn(dim)
        self.head = torch.nn.Linear(dim, dim)

    def forward(self, x):
        h, bias = self.block(x)
        return self.head(h + bias).pow(2).mean()


class WrapsReturnsTwiceTuple(torch.nn.Module):
    """DeepSpeed's DanglingExt: neither the root nor the module that adds the bias (the
    ReturnsTwiceTuple inside) has a parameter of its own."""

    def __init__(self, dim=8):
        super().__init__()
        self.container = ReturnsTwiceTuple(dim)

    def forward(self, x):
        return self.container(x) * 0.5


class ReturnsBiasCheckpointed(ReturnsBias):
    """The same under activation checkpointing: the recompute, inside the backward, runs the
    child again with no forward of the model around it, and its bias must stay whole for the
    `h + bias` that follows (DeepSpeed's test_checkpoint_external_parameter_lifecycle)."""

    def _block(self, x):
        h, bias = self.producer(x)
        return torch.tanh(h + bias)

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(self._block, x, use_reentrant=False)
        return self.head(h).pow(2).mean()


class MaybeHead(torch.nn.Module):
    """A model whose head is attached after initialize (DeepSpeed's test_zero_late_module_attach)."""

    def __init__(self, dim=8):
        super().__init__()
        self.fc = torch.nn.Linear(dim, dim)
        self.mid = torch.nn.Linear(dim, dim)

    def forward(self, x):
        h = torch.tanh(self.mid(self.fc(x)))
        if "head" in self._modules:
            h = self.head(h)
        return h.pow(2).mean()


class TiedHead(torch.nn.Module):
    def forward(self, h):
        return torch.nn.functional.linear(h, self.weight)


MODELS = {"root": RootReads, "sibling": SiblingReads, "returned": ReturnsBias, "returned_twice": ReturnsTwice,
          "returned_checkpointed": ReturnsBiasCheckpointed, "returned_twice_tuple": ReturnsTwiceTuple,
          "returned_to_a_module_without_parameters": WrapsReturnsTwiceTuple}
# models trained with a module attached after initialize (train_body's attach_head)
LATE = {"late_head": MaybeHead}


def train_body(model: str, stage: int, attach_head: bool = False):
    """Losses and final weights of 8 steps; attach_head: a TiedHead holding fc's weight is
    attached after initialize (the model is MaybeHead)."""
    import torch.distributed as dist

    import dslaunch.runtime as deepspeed
    from dslaunch.runtime.zero.param_reads import ReadWatch
    from dslaunch.runtime.utils import safe_get_full_fp32_param

    torch.manual_seed(0)
    net = {**MODELS, **LATE}[model]()
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_allow_untested_optimizer": True,
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    if attach_head:
        head = TiedHead()
        head.weight = net.fc.weight  # a partitioned parameter, registered in a module the engine never saw
        net.head = head
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    losses = []
    for _ in range(8):
        loss = engine(torch.randn(2, 8, generator=g))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    if attach_head:  # watched from its first forward on (stage 3 only)
        assert isinstance(net.head._parameters, ReadWatch) == (stage == 3)
    weights = {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return losses, weights


def assert_trains_as_at_stage_0(model: str, **kwargs) -> None:
    want = run_function(train_body, nprocs=2, kwargs={"model": model, "stage": 0, **kwargs}, timeout=240)
    got = run_function(train_body, nprocs=2, kwargs={"model": model, "stage": 3, **kwargs}, timeout=240)
    for (want_losses, want_weights), (got_losses, got_weights) in zip(want, got):
        assert got_losses == pytest.approx(want_losses, rel=1e-6, abs=1e-7)
        assert got_weights.keys() == want_weights.keys()
        for name in want_weights:
            torch.testing.assert_close(got_weights[name], want_weights[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_a_parameter_used_outside_its_module_trains_as_at_stage_0(model):
    assert_trains_as_at_stage_0(model)


def stage3_engine(model_class):
    """model_class's model (seeded) in a stage-3 engine that partitions every parameter."""
    import dslaunch.runtime as deepspeed

    torch.manual_seed(0)
    net = model_class()
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    return net, engine


def registry_body():
    net, engine = stage3_engine(ReturnsTwiceTuple)
    engine.backward(engine(torch.randn(2, 8)))
    engine.step()
    bias = net.block.inner.bias
    sizes = [len(m._external_params) for m in (net, net.block, net.block.inner, net.head)]
    return sizes, [p is bias for p in net._external_params.values()]


def test_a_parameter_handed_up_two_levels_is_external_to_the_module_that_uses_it():
    """DeepSpeed's test_ext_param_return checks where the bias ends up registered: with the
    module whose forward uses it (the root), and no longer with the middle one that passed it on."""
    for sizes, is_bias in run_function(registry_body, nprocs=2, timeout=240):
        assert sizes == [1, 0, 0, 0]
        assert is_bias == [True]


def nested_registry_body():
    net, engine = stage3_engine(WrapsReturnsTwiceTuple)
    for _ in range(2):  # the second forward runs with the registration the first one made
        engine.backward(engine(torch.randn(2, 8)))
        engine.step()
    c = net.container
    sizes = [len(m._external_params) for m in (net, c, c.block, c.block.inner, c.head)]
    return sizes, [p is c.block.inner.bias for p in c._external_params.values()]


def test_a_parameter_handed_to_a_module_without_parameters_is_external_to_it():
    """DeepSpeed hooks every module, so the bias registers with the module that uses it even
    when that module has no parameter of its own, and not with the root above it."""
    for sizes, is_bias in run_function(nested_registry_body, nprocs=2, timeout=240):
        assert sizes == [0, 1, 0, 0, 0]
        assert is_bias == [True]


class FailsAfterFirst(RootReads):
    def forward(self, x):
        self.linear1(x)
        raise ValueError("the script's own error")


def raise_body():
    net, engine = stage3_engine(FailsAfterFirst)
    try:
        engine(torch.randn(2, 8))
    except ValueError:
        pass
    # read by name outside any forward: the released parameter stays released (no collective)
    return net.linear1.weight.numel(), net.linear2.weight.numel()


def test_a_read_after_a_forward_that_raised_gathers_nothing():
    for sizes in run_function(raise_body, nprocs=2, timeout=180):
        assert sizes == (0, 0)


def test_a_module_attached_after_initialize_reads_a_partitioned_parameter_whole():
    """The head, attached after initialize, holds fc's partitioned weight: the forward's first
    read of it by name gathers it, as DeepSpeed's forward prologue converts such a module's
    _parameters (ZeROOrderedDict); the losses and weights are stage 0's."""
    assert_trains_as_at_stage_0("late_head", attach_head=True)


def test_ensure_zero_ordered_dict_wraps_a_plain_dict_once():
    from dslaunch.runtime.zero.param_reads import ReadWatch, ensure_zero_ordered_dict

    m = torch.nn.Linear(4, 4, bias=False)
    original = m._parameters
    ensure_zero_ordered_dict(m)
    assert isinstance(m._parameters, ReadWatch) and "weight" in m._parameters
    assert m._original_parameters is original
    watched = m._parameters
    ensure_zero_ordered_dict(m)
    assert m._parameters is watched  # already watched: left alone
    m._parameters = None
    ensure_zero_ordered_dict(m)  # nothing to wrap
    assert m._parameters is None
