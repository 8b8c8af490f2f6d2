"""DeepSpeed's `ds_active_sub_modules` on a ZeRO-3 parameter: the ids (`module.ds_id`) of the
modules whose hooks gathered it and have not released it. DeepSpeed's lifecycle tests
(test_zero_activation_checkpoint_lifecycle) read it to tell that nothing is left gathered after
a backward, including one through activation checkpointing that raised during recompute. Here:
inside a module's forward its own parameters name it; after each backward every set is empty
and every parameter is released, also after a backward that raised, once the next one ran."""
import torch

from dist_harness import run_function


class Net(torch.nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.a = torch.nn.Linear(dim, dim)
        self.b = torch.nn.Linear(dim, dim)
        self.fail_recompute = False

    def _block(self, x):
        h = self.a(x)
        if self.fail_recompute and torch._C._current_graph_task_id() != -1:
            raise RuntimeError("injected recompute failure")
        return torch.tanh(h)

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(self._block, x, use_reentrant=False)
        return self.b(h).pow(2).mean()


def lifecycle_body():
    import dslaunch.runtime as deepspeed
    from dslaunch.runtime.zero import ZeroParamStatus

    torch.manual_seed(0)
    net = Net()
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_allow_untested_optimizer": True,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0}}
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    seen = {}

    def look(m, args):  # after stage 3's own pre-forward hook, which gathered m's parameters
        seen.setdefault("inside_b", (set(m.weight.ds_active_sub_modules), m.ds_id,
                                     m.weight.ds_status == ZeroParamStatus.AVAILABLE))

    net.b.register_forward_pre_hook(look)

    def clean():
        return all(not p.ds_active_sub_modules and p.ds_status == ZeroParamStatus.NOT_AVAILABLE
                   for p in net.parameters())

    out = {}
    engine.backward(engine(torch.randn(2, 8)))
    out["after_backward"] = clean()
    engine.step()
    net.fail_recompute = True
    try:
        engine.backward(engine(torch.randn(2, 8)))
        out["raised"] = False
    except RuntimeError as e:
        out["raised"] = "injected recompute failure" in str(e)
    net.fail_recompute = False
    engine.backward(engine(torch.randn(2, 8)))
    out["after_retry"] = clean()
    held, b_id, available = seen["inside_b"]
    out["inside_b"] = (held == {b_id}, available)
    engine.destroy()
    return out


def test_active_sub_modules_name_the_holders_and_empty_after_backward():
    for out in run_function(lifecycle_body, nprocs=2, timeout=180):
        assert out == {"after_backward": True, "raised": True, "after_retry": True, "inside_b": (True, True)}
