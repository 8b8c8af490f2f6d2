"""One HF Trainer job, run on 2 ranks under `dslaunch --num_gpus 2` by tests/compat/test_hf_trainer.py.

    hf_trainer_job.py --mode ddp|zero2|zero3 --model DIR --out DIR [--resume CKPT | --evaluate_only]
                      [--no_cpu_recipe]   (leave out the gloo set-up a CPU-only machine needs)

The tiny GPT-2 in --model was written by save_pretrained (no hub). Every mode trains it for
STEPS optimizer steps with the Trainer's own AdamW and linear schedule, fp32, dropout off,
micro batch 2 x accumulation 2 per rank, a checkpoint every 2 steps. `ddp` is the Trainer's
plain DistributedDataParallel run; zero2/zero3 pass a DeepSpeed config (HF's "auto" style)
through TrainingArguments(deepspeed=...), which reaches dslaunch.runtime through the
`deepspeed` compatibility package. Rank 0 writes OUT/final_weights.pt (the trained
state_dict; under ZeRO-3 gathered by the engine) and OUT/result.json: the per-step losses and
what the run observed (parameters zero.Init left as shards in from_pretrained, the engine
class, the files save_model and the checkpoints wrote).
"""
import argparse
import json
import os

import torch

STEPS = 4
SEQ = 16


def ds_config(stage: int) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": "auto"}
    if stage == 3:
        # a threshold below the tiny model's weight sizes, so that zero.Init really shards them
        zero.update({"stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": 256,
                     "stage3_gather_16bit_weights_on_model_save": True})
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto", "zero_optimization": zero,
            "steps_per_print": 1000}


def hf_docs_zero3() -> dict:
    """The ZeRO-3 config of the Hugging Face DeepSpeed guide, as users copy it (optimizer,
    scheduler, fp16 with "auto", CPU offload of both, every stage-3 knob)."""
    return {
        "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                 "hysteresis": 2, "min_loss_scale": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                     "warmup_num_steps": "auto"}},
        "zero_optimization": {
            "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
            "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": 256,  # the guide says "auto": 256 so the tiny model shards
            "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
            "stage3_gather_16bit_weights_on_model_save": True},
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False}


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, vocab: int):
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, vocab, (n, SEQ), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["ddp", "zero2", "zero3"], required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--resume", default=None)
    p.add_argument("--evaluate_only", action="store_true", help="trainer.evaluate() without training")
    p.add_argument("--local_rank", type=int, default=-1)
    p.add_argument("--no_cpu_recipe", action="store_true", help="as a user would write it, without the gloo recipe")
    a = p.parse_args()

    from accelerate import PartialState
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    cpu_ds = a.mode != "ddp" and not torch.cuda.is_available() and not a.no_cpu_recipe
    if cpu_ds:
        # Accelerate picks no process-group backend for DeepSpeed on a machine without GPUs (it
        # would then see 1 process per rank); naming gloo in a pre-configured state is its way out.
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        PartialState(backend="gloo")
    args = TrainingArguments(
        output_dir=a.out, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=STEPS,
        learning_rate=5e-3, lr_scheduler_type="linear", warmup_steps=1, logging_steps=1, save_steps=2,
        save_strategy="steps", report_to=[], seed=7, data_seed=7, dataloader_num_workers=0,
        deepspeed=None if a.mode == "ddp" else hf_docs_zero3() if a.evaluate_only else ds_config(int(a.mode[-1])),
        disable_tqdm=True,
        use_cpu=a.mode == "ddp" and not torch.cuda.is_available(),  # the Trainer's gloo DDP
        accelerator_config={"use_configured_state": cpu_ds})
    # TrainingArguments(deepspeed=...) came first, so from_pretrained sees ZeRO-3 and builds the
    # model inside deepspeed.zero.Init (HfDeepSpeedConfig's weak reference).
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    sharded_at_load = [n for n, q in model.named_parameters() if q.numel() == 0]  # only a shard is held
    # what the Trainer logs as "Number of trainable parameters" (ZeRO-3: read from ds_numel)
    from transformers.trainer_pt_utils import get_model_param_count

    counted = {"trainable": get_model_param_count(model, trainable_only=True),
               "status": sorted({str(getattr(getattr(q, "ds_status", None), "name", None))
                                 for n, q in model.named_parameters() if n in sharded_at_load}),
               # the full shape: a whole parameter's own, a shard's as many elements as ds_numel
               "shapes_match": all((list(q.ds_shape) == list(q.shape)) if q.numel() else
                                   (torch.Size(q.ds_shape).numel() == q.ds_numel > 0)
                                   for q in model.parameters() if hasattr(q, "ds_shape")),
               "ids": len({getattr(q, "ds_id", None) for q in model.parameters()})}
    losses = {}

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses[state.global_step] = logs["loss"]

    trainer = Trainer(model=model, args=args, train_dataset=Tokens(64, model.config.vocab_size),
                      eval_dataset=Tokens(8, model.config.vocab_size), callbacks=[Record()])
    evals, rank = {}, int(os.environ["RANK"])
    # --evaluate_only under ZeRO-3 (the HF guide's config): the Trainer drops the optimizer section
    # and builds a forward-only engine.
    # (evaluate() then train() under DeepSpeed is broken in the Trainer itself: train() frees
    # the evaluation engine and then reuses it.)
    if a.evaluate_only:
        evals["before"] = trainer.evaluate()["eval_loss"]
        if rank == 0:
            with open(os.path.join(a.out, "result.json"), "w") as fh:
                json.dump({"evals": evals, "sharded_at_load": sharded_at_load, "counted": counted}, fh)
        return
    trainer.train(resume_from_checkpoint=a.resume)
    evals["after"] = trainer.evaluate()["eval_loss"]
    engine = trainer.model_wrapped
    final_dir = os.path.join(a.out, "final")
    trainer.save_model(final_dir)  # ZeRO-3: gathered through _zero3_consolidated_16bit_state_dict
    if a.mode == "zero3":
        state = engine._zero3_consolidated_16bit_state_dict()
    else:
        state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    if rank == 0:
        torch.save(state, os.path.join(a.out, "final_weights.pt"))
        result = {
            "losses": {str(k): v for k, v in sorted(losses.items())}, "evals": evals,
            "engine": f"{type(engine).__module__}.{type(engine).__name__}",
            "sharded_at_load": sharded_at_load, "parameters": len(list(model.parameters())), "counted": counted,
            "saved": sorted(os.listdir(final_dir)),
            "checkpoints": sorted(d for d in os.listdir(a.out) if d.startswith("checkpoint-")),
        }
        with open(os.path.join(a.out, "result.json"), "w") as fh:
            json.dump(result, fh)


if __name__ == "__main__":
    main()
