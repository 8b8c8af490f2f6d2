"""A script's own universal_checkpoint_info in client_state (Megatron-DeepSpeed passes its
parameter patterns under it in every save; DeepSpeed's universal-checkpoint tests pass {}):
stored in the model-states file under that key and handed back by load_checkpoint, as
DeepSpeed 0.19.8 does. Its other keys stay reserved (DeepSpeed lets client_state overwrite
them, weights included); an AutoEP checkpoint, which writes its own, refuses it as DeepSpeed's
MoE save does."""
import glob
import os

from dist_harness import run_function


def _save_and_load(save_dir, stage):
    import torch

    import dslaunch.runtime as deepspeed

    def engine():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
               "zero_optimization": {"stage": stage}}
        return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]

    e = engine()
    e.backward(e(torch.randn(2, 4)).pow(2).mean())
    e.step()
    info = {"universal_checkpoint_version": 0.2, "vocabulary_parameter_patterns": ["word_embeddings.weight"]}
    e.save_checkpoint(save_dir, tag="t", client_state={"universal_checkpoint_info": info, "iteration": 8})
    out = {}
    try:
        e.save_checkpoint(save_dir, tag="bad", client_state={"global_steps": 3})
    except Exception as exc:  # noqa: BLE001 (the refusal is the result)
        out["reserved"] = str(exc)
    _, client = engine().load_checkpoint(save_dir, tag="t")
    out["client"] = client
    return out


def test_the_scripts_universal_checkpoint_info_is_stored_and_returned(tmp_path):
    import torch

    for stage in (1, 3):
        save = str(tmp_path / f"s{stage}")
        out = run_function(_save_and_load, nprocs=1, kwargs={"save_dir": save, "stage": stage}, timeout=120)[0]
        info = {"universal_checkpoint_version": 0.2, "vocabulary_parameter_patterns": ["word_embeddings.weight"]}
        assert out["client"]["universal_checkpoint_info"] == info and out["client"]["iteration"] == 8
        assert out["reserved"].endswith("client_state key 'global_steps' is reserved for the checkpoint's own "
                                        "'global_steps' entry")
        states = torch.load(sorted(glob.glob(os.path.join(save, "t", "*model_states.pt")))[0], weights_only=True)
        assert states["universal_checkpoint_info"] == info  # where DeepSpeed's converter looks for it
