"""GPT-lite trained with pipeline parallelism, written the way the post "Scaling a GPT model
with ZeRO and DeepSpeed" (the seed of issue #10) writes it: the model exposes its layers
with `to_layers()` (lambdas included), `deepspeed.pipe.PipelineModule` cuts them into
stages, and `engine.train_batch()` runs each global batch.

    dslaunch --num_gpus 2 scripts/examples/gptlite_pipeline.py \\
        --deepspeed_config scripts/examples/gptlite_pipeline.json          # 2 stages
    dslaunch --num_gpus 4 scripts/examples/gptlite_pipeline.py --pipeline_stages 2 ...  # 2 stages x 2 replicas

For DeepSpeed the file differs only in its import line (`import deepspeed`).
tests/runtime/pipe/test_pipe_script.py runs it on 2 ranks.
The corpus is this Python's own standard-library source, so nothing is downloaded.
"""
import argparse
import glob
import json
import os
import sysconfig

import torch
import torch.nn as nn
import torch.nn.functional as F

import dslaunch.runtime as deepspeed  # the only line that differs under DeepSpeed: import deepspeed

# GPT-lite's shape; the post scales it to GPT-3 Small (12 layers, 768 wide, 12 heads, 2048 tokens).
n_layer = 4
n_embd = 64
n_head = 4
block_size = 32
vocab_size = 256  # bytes


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a feed-forward network."""

    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.ffwd = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.ReLU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, n_head, C // n_head).transpose(1, 2) for t in self.qkv(self.ln1(x)).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.ffwd(self.ln2(x))


class Embeddings(nn.Module):
    """Token and position embeddings, returned as the pair the post's first lambda adds."""

    def __init__(self):
        super().__init__()
        self.token = nn.Embedding(vocab_size, n_embd)
        self.position = nn.Embedding(block_size, n_embd)

    def forward(self, idx):
        return self.token(idx), self.position(torch.arange(idx.shape[1], device=idx.device))


class GPTlite(nn.Module):
    def __init__(self):
        super().__init__()
        self.embeddings = Embeddings()
        self.blocks = nn.Sequential(*[Block() for _ in range(n_layer)])
        self.ln = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size)

    def forward(self, idx):
        tok_emb, pos_emb = self.embeddings(idx)
        logits = self.lm_head(self.ln(self.blocks(tok_emb + pos_emb)))
        return torch.swapaxes(logits, 1, 2)  # (B, vocab, T), as CrossEntropyLoss wants

    def to_layers(self):
        """The forward pass as a list of layers, in order (what PipelineModule cuts)."""
        return [
            self.embeddings,
            lambda emb: emb[0] + emb[1],  # tok_emb + pos_emb
            *self.blocks,
            self.ln,
            self.lm_head,
            lambda logits: torch.swapaxes(logits, 1, 2),
        ]


class GPTliteDataset(torch.utils.data.Dataset):
    def __init__(self, train_data, block_size):
        self.train_data = train_data
        self.block_size = block_size

    def __len__(self):
        return len(self.train_data) // self.block_size

    def __getitem__(self, idx):
        ix = torch.randint(len(self.train_data) - self.block_size, size=())  # a random window
        x = self.train_data[ix:ix + self.block_size]
        y = self.train_data[ix + 1:ix + 1 + self.block_size]  # the next character of each position
        return x, y


def load_corpus(max_bytes=1_000_000):
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    blob = b"".join(open(f, "rb").read() for f in files[:60])[:max_bytes]
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).long()


def get_deepspeed_args(description="GPT lite on DeepSpeed, pipelined"):
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--pipeline_stages", type=int, default=2)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--result_json", default=None,
                        help="also write this rank's losses as JSON to this path ({rank} becomes the rank)")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def main():
    deepspeed.init_distributed()
    args = get_deepspeed_args()
    torch.manual_seed(0)  # the same initial model on every rank
    model = GPTlite()
    dataset = GPTliteDataset(load_corpus(), block_size)
    model = deepspeed.pipe.PipelineModule(layers=model.to_layers(), num_stages=args.pipeline_stages,
                                          loss_fn=nn.CrossEntropyLoss())
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, training_data=dataset)
    losses = []
    for step in range(args.steps):
        loss = engine.train_batch()
        losses.append(round(float(loss), 6))
    if engine.global_rank == 0:
        print(f"trained {args.steps} steps: loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    if args.result_json:  # for tests and benchmarks; the console shows only the line above
        with open(args.result_json.format(rank=engine.global_rank), "w") as f:
            json.dump({"rank": engine.global_rank, "stage": engine.stage_id, "losses": losses}, f)


if __name__ == "__main__":
    main()
