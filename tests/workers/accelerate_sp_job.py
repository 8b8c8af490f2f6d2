"""Ulysses sequence parallelism through Accelerate, for `accelerate launch` (2 processes):

    accelerate launch --use_deepspeed --deepspeed_config_file ds.json --num_processes 2 \
        accelerate_sp_job.py OUT_DIR

The script asks for it as Accelerate's documentation does: a `ParallelismConfig(sp_backend=
"deepspeed", sp_size=2)` whose handler names the core attention (sdpa). Accelerate's prepare
then calls `deepspeed.runtime.sequence_parallel.ulysses_sp` (register_with_transformers and
UlyssesSPDataLoaderAdapter, through the compatibility package) and initialize(mpu=...). The
loop combines each rank's loss over its slice as Accelerate's guide does: the per-rank means
weighted by their labelled-token counts, over the sequence group.

Every rank also trains a one-process reference: the same tiny Llama (sdpa, grouped-query
attention, built from a config) in plain torch over the whole sequence of the same batches
(the loader's order, which the adapter hands out one after another), with torch's AdamW and
the same clipping. The job records every step's loss under both.
"""
import json
import os
import sys

import torch

SP, SEQ, VOCAB, MICRO, BATCHES, LR, CLIP = 2, 8, 64, 2, 4, 1e-2, 1.0


def model_fn():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def rows():
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (BATCHES * MICRO, SEQ), generator=g)
    return [{"input_ids": r, "labels": r.clone()} for r in ids]


def main(out_dir: str) -> None:
    from accelerate import Accelerator
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig, InitProcessGroupKwargs

    kwargs = [] if torch.cuda.is_available() else [InitProcessGroupKwargs(backend="gloo")]
    pc = ParallelismConfig(sp_backend="deepspeed", sp_size=SP,
                           sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length=SEQ, sp_seq_length_is_variable=False,
                                                                      sp_attn_implementation="sdpa"))
    acc = Accelerator(parallelism_config=pc, kwargs_handlers=kwargs)
    loader = torch.utils.data.DataLoader(rows(), batch_size=MICRO)
    model = model_fn()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    engine, opt, sp_loader = acc.prepare(model, opt, loader)
    from deepspeed.utils import groups

    sp_group = groups._get_sequence_parallel_group()
    sp_world = groups._get_sequence_parallel_world_size()

    ref = model_fn()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)

    losses, ref_losses, shapes = [], [], []
    for batch, whole in zip(sp_loader, loader):
        shapes.append(list(batch["input_ids"].shape))
        out = engine(**batch)
        # Accelerate's ALST guide: each rank's mean over its labelled tokens, weighted by their counts
        n = (batch["shift_labels"] != -100).sum()
        loss_r = torch.distributed.nn.functional.all_gather(out.loss, group=sp_group)
        n_r = torch.distributed.nn.functional.all_gather(n, group=sp_group)
        loss = sum(loss_r[r] * n_r[r] for r in range(sp_world)) / max(sum(n_r), 1)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))

        ref_loss = ref(input_ids=whole["input_ids"], labels=whole["labels"]).loss
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(float(ref_loss))

    if acc.is_main_process:
        with open(os.path.join(out_dir, "out.json"), "w") as fh:
            json.dump({"losses": losses, "ref_losses": ref_losses, "shapes": shapes, "sp_world": sp_world,
                       "num_processes": acc.num_processes, "engine": type(engine).__name__,
                       "distributed_type": str(acc.distributed_type),
                       "train_batch_size": engine.train_batch_size()}, fh)
    acc.end_training()


if __name__ == "__main__":
    main(sys.argv[1])
