"""The engine passes the model's attributes through, as DeepSpeed 0.19.8's engine does
(`engine.moe_1` for model.moe_1): the engine's own attributes come first, and a name neither
has is an AttributeError naming the engine. DeepSpeed's MoE tests read experts this way.
DeepSpeed's checkpoint tests compare sparse_tensor_module_names, empty here (sparse_gradients
is refused)."""
from dist_harness import run_function


def body():
    import torch

    import dslaunch.runtime as deepspeed

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.moe_1 = torch.nn.Linear(4, 4)
            self.embed = torch.nn.Embedding(4, 4)  # reduced dense: no sparse-gradient module
            self.label = "model's"
            self.optimizer = "model's"  # shadowed by the engine's own

        def forward(self, x):
            return self.moe_1(x)

    model = Net()
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    out = {"moe_1": engine.moe_1 is model.moe_1, "label": engine.label, "optimizer_is_engines": engine.optimizer is opt,
           "weight": engine.moe_1.weight is model.moe_1.weight, "sparse": engine.sparse_tensor_module_names}
    try:
        engine.no_such_attribute
    except AttributeError as exc:
        out["missing"] = str(exc)
    out["hasattr"] = hasattr(engine, "no_such_attribute")
    return out


def test_engine_passes_model_attributes_through():
    out = run_function(body, nprocs=1)[0]
    assert out == {"moe_1": True, "label": "model's", "optimizer_is_engines": True, "weight": True, "sparse": set(),
                   "missing": "'DeepSpeedEngine' object has no attribute 'no_such_attribute'", "hasattr": False}
