"""GPT-lite: a small GPT-2-style decoder trained as a character-level language model on the
Python standard library's own source code (present on every machine, no download).

Written the way the GPT-lite + DeepSpeed post writes its training script; the only
DeepSpeed-specific line that differs is the import.

    dslaunch --num_gpus 2 scripts/train_gpt.py --deepspeed_config scripts/train_gpt_config.json
    python scripts/train_gpt.py --steps 50          # one process, no launcher

Switching "zero_optimization.stage" in the JSON config to 1, 2 or 3 needs no code change.
"""
from __future__ import annotations

import argparse
import glob
import os
import sys
import sysconfig
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import dslaunch.runtime as deepspeed

HERE = os.path.dirname(os.path.abspath(__file__))

# Model shape: small enough that two CPU processes visibly learn within minutes.
block_size = 64
n_embd = 128
n_head = 4
n_layer = 4
dropout = 0.0
vocab_size = 256  # bytes of the UTF-8 source: every character-level symbol fits


def load_corpus(max_bytes: int = 4_000_000) -> torch.Tensor:
    """The stdlib's .py files, in a fixed order, as a byte tensor."""
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(stdlib, "*.py")))
    if not files:
        raise SystemExit(f"train_gpt: no Python sources found under {stdlib}")
    chunks, total = [], 0
    for path in files:
        with open(path, "rb") as fh:
            data = fh.read()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    blob = b"".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).long()


class Head(nn.Module):
    def __init__(self, head_size):
        super().__init__()
        self.key = nn.Linear(n_embd, head_size, bias=False)
        self.query = nn.Linear(n_embd, head_size, bias=False)
        self.value = nn.Linear(n_embd, head_size, bias=False)
        self.register_buffer("tril", torch.tril(torch.ones(block_size, block_size)))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        B, T, C = x.shape
        k, q, v = self.key(x), self.query(x), self.value(x)
        wei = q @ k.transpose(-2, -1) * k.shape[-1] ** -0.5
        wei = wei.masked_fill(self.tril[:T, :T] == 0, float("-inf"))
        wei = self.dropout(F.softmax(wei, dim=-1))
        return wei @ v


class MultiHeadAttention(nn.Module):
    def __init__(self, num_heads, head_size):
        super().__init__()
        self.heads = nn.ModuleList([Head(head_size) for _ in range(num_heads)])
        self.proj = nn.Linear(n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.proj(torch.cat([h(x) for h in self.heads], dim=-1)))


class FeedForward(nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.ReLU(), nn.Linear(4 * n_embd, n_embd),
                                 nn.Dropout(dropout))

    def forward(self, x):
        return self.net(x)


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.sa = MultiHeadAttention(n_head, n_embd // n_head)
        self.ffwd = FeedForward(n_embd)
        self.ln1 = nn.LayerNorm(n_embd)
        self.ln2 = nn.LayerNorm(n_embd)

    def forward(self, x):
        x = x + self.sa(self.ln1(x))
        return x + self.ffwd(self.ln2(x))


class GPTlite(nn.Module):
    def __init__(self, vocab_size=vocab_size, activation_checkpointing=False):
        super().__init__()
        self.activation_checkpointing = activation_checkpointing  # each block recomputed in backward
        self.token_embedding_table = nn.Embedding(vocab_size, n_embd)
        self.position_embedding_table = nn.Embedding(block_size, n_embd)
        self.blocks = nn.Sequential(*[Block(n_embd, n_head) for _ in range(n_layer)])
        self.ln = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size)

    def forward(self, idx):
        B, T = idx.shape
        tok_emb = self.token_embedding_table(idx)
        pos_emb = self.position_embedding_table(torch.arange(T, device=idx.device))
        x = tok_emb + pos_emb
        for block in self.blocks:
            x = deepspeed.checkpointing.checkpoint(block, x) if self.activation_checkpointing else block(x)
        logits = self.lm_head(self.ln(x))
        # (B, vocab, T): the layout CrossEntropyLoss expects for per-position targets
        return torch.swapaxes(logits, 1, 2)


class GPTliteDataset(torch.utils.data.Dataset):
    """Random windows of the corpus; the target is the input shifted by one character."""

    def __init__(self, train_data, block_size):
        self.train_data = train_data
        self.block_size = block_size

    def __len__(self):
        return len(self.train_data) // self.block_size

    def __getitem__(self, idx):
        ix = torch.randint(len(self.train_data) - self.block_size, size=())
        x = self.train_data[ix:ix + self.block_size]
        y = self.train_data[ix + 1:ix + 1 + self.block_size]
        return x, y


def get_args(argv=None):
    parser = argparse.ArgumentParser(description="GPT lite on dslaunch.runtime")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps to train")
    parser.add_argument("--checkpoint_dir", default=None, help="save a checkpoint here at the end")
    parser.add_argument("--resume", action="store_true", help="load the latest checkpoint from --checkpoint_dir first")
    parser.add_argument("--activation_checkpointing", choices=("true", "false"), default="false",
                        help="recompute each block's activations in backward (autotuning switches it)")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args(argv)
    if args.deepspeed_config is None:
        args.deepspeed_config = os.path.join(HERE, "train_gpt_config.json")
    return args


def main(argv=None):
    args = get_args(argv)
    deepspeed.init_distributed()
    torch.manual_seed(0)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    model = GPTlite(activation_checkpointing=args.activation_checkpointing == "true")
    dataset = GPTliteDataset(load_corpus(), block_size)
    model_engine, optimizer, train_dataloader, _ = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=dataset)
    torch.manual_seed(1 + model_engine.global_rank)  # different random windows on each rank
    model_engine.set_train_steps(args.steps)  # the progress line's step/total and the run's ETA
    if args.resume and args.checkpoint_dir:
        model_engine.load_checkpoint(args.checkpoint_dir)

    criterion = torch.nn.CrossEntropyLoss()
    local_device = deepspeed.accelerator.get_accelerator().device_name(model_engine.local_rank)
    rank0 = model_engine.global_rank == 0
    if rank0:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"GPT-lite: {n_params / 1e6:.2f}M parameters, {len(dataset.train_data) / 1e6:.1f}M characters of "
              f"stdlib source, {model_engine.world_size} processes, batch {model_engine.train_batch_size()} "
              f"(micro {model_engine.train_micro_batch_size_per_gpu()} x accumulation "
              f"{model_engine.gradient_accumulation_steps()}), ZeRO stage {model_engine.zero_optimization_stage()}",
              flush=True)

    first = last = None
    start = time.time()
    window = []
    done = False
    while not done:
        for step, data in enumerate(train_dataloader):
            inputs = data[0].to(local_device)
            labels = data[1].to(local_device)
            outputs = model_engine(inputs)
            loss = criterion(outputs.float(), labels)
            model_engine.backward(loss)
            model_engine.step()
            window.append(loss.item())
            if model_engine.micro_steps % model_engine.gradient_accumulation_steps() == 0:
                avg = sum(window) / len(window)
                window = []
                first = avg if first is None else first
                last = avg
                if model_engine.global_steps >= args.steps:
                    done = True
                    break
    if args.checkpoint_dir:
        model_engine.save_checkpoint(args.checkpoint_dir, client_state={"steps": model_engine.global_steps})
    if rank0:
        print(f"done: {model_engine.global_steps} steps in {time.time() - start:.0f} s; "
              f"loss {first:.3f} -> {last:.3f}", flush=True)
    return first, last


if __name__ == "__main__":
    main()
