"""ZeRO-3 leaf modules whose forward uses their children's weights without calling the children
(`x @ self.experts[i].weight.t()`), or calls only some of them, and a ModuleList marked as a leaf
(it has no forward of its own: its parent's forward indexes it). Loss and gradients equal a
one-process torch model's, through loss.backward() and engine.backward(). One 2-rank run."""
import torch

from dist_harness import run_function


class _Experts(torch.nn.Module):
    """A leaf that reads its experts' weights directly and skips expert 1."""

    def __init__(self):
        super().__init__()
        self.experts = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        return sum(x @ self.experts[i].weight.t() + self.experts[i].bias for i in (0, 2))


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.moe = _Experts()
        # marked as a leaf too (a ModuleList): never called, its parent's forward indexes it
        self.branches = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
        self.final = torch.nn.Linear(4, 4)

    def forward(self, x, y):
        h = self.moe(x)
        h = self.branches[0](h) + h @ self.branches[2].weight.t()  # branches[1] unused
        return torch.nn.functional.cross_entropy(self.final(h), y)


def _worker():
    import copy

    import dslaunch.runtime as deepspeed
    from dslaunch.runtime.utils import safe_get_full_grad
    from dslaunch.runtime.zero.hook_scope import set_z3_leaf_modules

    out = {}
    for mode in ("loss.backward", "engine.backward"):
        torch.manual_seed(0)
        model = _Model()
        reference = copy.deepcopy(model)
        marked = set_z3_leaf_modules(model, [_Experts, torch.nn.ModuleList])
        cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3,
               "stage3_param_persistence_threshold": 0},  # every parameter partitioned
               "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
        engine, *_ = deepspeed.initialize(config=cfg, model=model, model_parameters=model.parameters())
        torch.manual_seed(1)  # the same batch on both ranks: the mean gradient is the one-process one
        x, y = torch.randn(2, 4), torch.randint(0, 4, (2,))
        loss = engine(x, y)
        if mode == "loss.backward":
            loss.backward()
        else:
            engine.backward(loss)
        ref_loss = reference(x, y)
        ref_loss.backward()
        ref = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in reference.named_parameters()}
        grads = {n: safe_get_full_grad(p) for n, p in model.named_parameters()}
        out[mode] = {"marked": len(marked), "leaves": len(engine.optimizer.leaf_parameters),
                     "loss_diff": abs(loss.item() - ref_loss.item()),
                     "missing": [n for n, g in grads.items() if g is None],
                     "diffs": {n: (g - ref[n]).abs().max().item() for n, g in grads.items() if g is not None},
                     "unused_nonzero": [n for n in ("moe.experts.1.weight", "branches.1.weight")
                                        if grads[n] is not None and grads[n].abs().max().item() > 0]}
        engine.destroy()
    return out


def test_leaf_children_used_by_weight_or_not_at_all_match_one_process():
    for seen in run_function(_worker, nprocs=2, timeout=240):
        for mode, r in seen.items():
            assert r["marked"] == 3, (mode, r)  # _Experts, its experts list, and branches
            assert r["leaves"] == 2, (mode, r)  # the outermost ones: moe and branches
            assert r["loss_diff"] < 1e-6, (mode, r)
            assert r["missing"] == [], (mode, r)
            assert max(r["diffs"].values()) < 1e-6, (mode, r["diffs"])
            assert r["unused_nonzero"] == [], (mode, r)
