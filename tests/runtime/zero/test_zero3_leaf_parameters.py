"""Stage 3's optimizer.leaf_parameters (DeepSpeed's account of the leaf modules set_z3_leaf_modules
marked: each outermost leaf -> its trained parameters, in the optimizer's order), and a plain
loss.backward() through a leaf module giving the one-process gradients. One 2-rank run."""
import torch

from dist_harness import run_function


class _Pair(torch.nn.Module):
    """A linear layer, and another _Pair inside it when nested."""

    def __init__(self, nested=False):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.inner = _Pair() if nested else None

    def forward(self, x):
        return self.lin(x) + (self.inner(x) if self.inner is not None else 0)


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.branches = _Pair(nested=True)  # a leaf holding another: only the outer one counts
        self.frozen = _Pair()
        self.final = torch.nn.Linear(4, 4)
        for p in self.frozen.parameters():
            p.requires_grad_(False)

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.final(self.branches(x) + self.frozen(x)), y)


def _worker():
    import copy

    import dslaunch.runtime as deepspeed
    from dslaunch.runtime.zero.hook_scope import set_z3_leaf_modules
    from dslaunch.runtime.utils import safe_get_full_grad

    torch.manual_seed(0)
    model = _Model()
    reference = copy.deepcopy(model)
    marked = set_z3_leaf_modules(model, [_Pair])
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    engine, *_ = deepspeed.initialize(config=cfg, model=model,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad])
    leaves = engine.optimizer.leaf_parameters
    names = {id(p): n for n, p in model.named_parameters()}
    seen = {"marked": len(marked),
            "leaves": [[names[id(p)] for p in ps] for ps in leaves.values()],
            "keys_are_the_branches": list(leaves) == [model.branches]}
    torch.manual_seed(1)  # the same batch on both ranks: the mean gradient is the one-process one
    x, y = torch.randn(2, 4), torch.randint(0, 4, (2,))
    engine(x, y).backward()
    reference(x, y).backward()
    ref = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    seen["diffs"] = {n: (safe_get_full_grad(p) - ref[n]).abs().max().item()
                     for n, p in model.named_parameters() if p.requires_grad}
    engine.destroy()
    return seen


def test_leaf_parameters_name_the_outermost_leaf_and_backward_matches_one_process():
    for seen in run_function(_worker, nprocs=2, timeout=180):
        assert seen["marked"] == 3  # every _Pair is marked, the inner and the frozen one too
        # one entry: the frozen leaf trains nothing, the inner leaf belongs to the outer one
        assert seen["leaves"] == [["branches.lin.weight", "branches.lin.bias", "branches.inner.lin.weight",
                                  "branches.inner.lin.bias"]]
        assert seen["keys_are_the_branches"]
        assert max(seen["diffs"].values()) < 1e-6, seen["diffs"]
