"""save_checkpoint(exclude_frozen_parameters=True), DeepSpeed's option: the module state in
mp_rank_00_model_states.pt (ZeRO-3: each rank's zero_pp_rank_* file) holds only the parameters that train, under DeepSpeed's file
name and key, so the file is smaller; loading it back needs load_module_strict=False (as in
DeepSpeed: the frozen ones are missing), restores every trained parameter and leaves the
frozen ones as the new model has them."""
from dist_harness import run_function


def _run(stage, root):
    import os

    import torch

    import dslaunch.runtime as deepspeed

    def build(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        model[0].weight.requires_grad_(False)
        model[1].requires_grad_(False)
        cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
               "zero_optimization": {"stage": stage}}
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        return engine

    engine = build(0)
    for _ in range(2):
        engine.backward(engine(torch.randn(2, 8)).pow(2).mean())
        engine.step()
    engine.save_checkpoint(os.path.join(root, "all"), tag="t")
    engine.save_checkpoint(os.path.join(root, "trained"), tag="t", exclude_frozen_parameters=True)
    name = "zero_pp_rank_0_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"
    files = {k: os.path.join(root, k, "t", name) for k in ("all", "trained")}
    keys = {k: sorted(torch.load(f, weights_only=False)["module"]) for k, f in files.items()}
    sizes = {k: os.path.getsize(f) for k, f in files.items()}
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        trained = {n: p.detach().clone() for n, p in engine.module.named_parameters()}

    fresh = build(1)
    strict_error = None
    try:
        fresh.load_checkpoint(os.path.join(root, "trained"), tag="t")
    except Exception as exc:  # DeepSpeed: load_state_dict's missing keys
        strict_error = type(exc).__name__ + ": " + str(exc).splitlines()[0]
    fresh = build(1)
    with deepspeed.zero.GatheredParameters(list(fresh.module.parameters())):
        init = {n: p.detach().clone() for n, p in fresh.module.named_parameters()}
    fresh.load_checkpoint(os.path.join(root, "trained"), tag="t", load_module_strict=False)
    with deepspeed.zero.GatheredParameters(list(fresh.module.parameters())):
        loaded = {n: p.detach().clone() for n, p in fresh.module.named_parameters()}
    frozen = sorted(n for n, p in fresh.module.named_parameters() if not p.requires_grad)
    return {"keys": keys, "sizes": sizes, "strict_error": strict_error, "frozen": frozen,
            "trained_equal": all(torch.equal(loaded[n], trained[n]) for n in loaded if n not in frozen),
            "frozen_kept": all(torch.equal(loaded[n], init[n]) for n in frozen)}


def _all(root):
    import os
    return {stage: _run(stage, os.path.join(root, str(stage))) for stage in (1, 2, 3)}


def test_exclude_frozen_parameters(tmp_path):
    out = run_function(_all, nprocs=1, kwargs={"root": str(tmp_path)}, timeout=240)[0]
    for stage, r in out.items():
        assert r["frozen"] == ["0.weight", "1.bias", "1.weight"], stage
        assert r["keys"]["all"] == ["0.bias", "0.weight", "1.bias", "1.weight", "2.bias", "2.weight"], stage
        assert r["keys"]["trained"] == ["0.bias", "2.bias", "2.weight"], stage
        assert r["sizes"]["trained"] < r["sizes"]["all"], stage
        assert r["strict_error"] is not None and "1.weight" in r["strict_error"], (stage, r["strict_error"])
        assert r["trained_equal"] and r["frozen_kept"], stage
