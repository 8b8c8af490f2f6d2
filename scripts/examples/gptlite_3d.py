"""GPT-lite in 3D: pipeline x tensor x data parallelism on one process mesh.

The seed post's GPT-lite ("Scaling a GPT model with ZeRO and DeepSpeed", 3D parallelism)
with its transformer blocks made tensor-parallel from the public layer classes
(`deepspeed.runtime.tensor_parallel`'s ColumnParallelLinear / RowParallelLinear, Megatron's
split: q|k|v and the first MLP projection by output columns, the attention output and the
second MLP projection by input rows), cut into pipeline stages by `PipelineModule`, with
ZeRO on the data axis:

    dslaunch --num_gpus 4 scripts/examples/gptlite_3d.py --pipeline_stages 2 --tensor_parallel 2 \\
        --deepspeed_config scripts/examples/gptlite_pipeline.json            # pp=2 x tp=2
    dslaunch --num_gpus 8 scripts/examples/gptlite_3d.py --pipeline_stages 2 --tensor_parallel 2 \\
        --deepspeed_config scripts/examples/gptlite_3d_zero1.json           # pp=2 x tp=2 x dp=2, ZeRO-1

How the ranks are laid out (DeepSpeed's order: tensor fastest, then data, then pipeline), on
8 ranks: tensor groups [0,1] [2,3] [4,5] [6,7]; data groups [0,2] [1,3] [4,6] [5,7]; pipelines
[0,4] [1,5] [2,6] [3,7]; stage 0 is ranks 0-3. The tensor ranks of one stage are neighbours
(the most traffic: two all-reduces per block, forward and backward), and the stages furthest
apart (one activation per micro-batch). tests/runtime/pipe/test_tp_3d.py checks both layouts against the
same model trained without any parallelism.
"""
import argparse
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gptlite_pipeline as lite  # noqa: E402  (the seed's GPT-lite: model, data, corpus)

import dslaunch.runtime as deepspeed  # noqa: E402
from dslaunch.runtime.parallel import PipelineParallelGrid  # noqa: E402  (the process mesh)
from dslaunch.runtime.tensor_parallel import ColumnParallelLinear, RowParallelLinear  # noqa: E402


class TensorParallelBlock(nn.Module):
    """GPT-lite's block with its four projections split over a tensor-parallel group: each
    rank holds n_head / tp heads and 4 * n_embd / tp hidden units, and two all-reduces (one
    after attention, one after the MLP) make the residual stream whole again."""

    def __init__(self, block: "lite.Block", group, tp: int, rank: int):
        super().__init__()
        if lite.n_head % tp:
            raise SystemExit(f"gptlite_3d: --tensor_parallel {tp} does not divide n_head {lite.n_head}")
        self.ln1, self.ln2 = block.ln1, block.ln2
        self.qkv = ColumnParallelLinear.from_linear(block.qkv, group, tp, rank, parts=[lite.n_embd] * 3)
        self.proj = RowParallelLinear.from_linear(block.proj, group, tp, rank)
        self.fc1 = ColumnParallelLinear.from_linear(block.ffwd[0], group, tp, rank)
        self.fc2 = RowParallelLinear.from_linear(block.ffwd[2], group, tp, rank)
        self.heads, self.width = lite.n_head // tp, lite.n_embd // tp

    def forward(self, x):
        B, T, _ = x.shape
        head = lite.n_embd // lite.n_head
        q, k, v = (t.view(B, T, self.heads, head).transpose(1, 2)
                   for t in self.qkv(self.ln1(x)).split(self.width, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, self.width)
        x = x + self.proj(y)
        return x + self.fc2(F.relu(self.fc1(self.ln2(x))))


def build(pipeline_stages: int, tensor_parallel: int, loss_fn=None):
    """The 3D model on this rank: the full GPT-lite made from the same seed on every rank, its
    blocks split over this rank's tensor group, cut into pipeline stages."""
    world = deepspeed.comm.get_world_size()
    dp = world // (pipeline_stages * tensor_parallel)
    topo = deepspeed.pipe.PipeModelDataParallelTopology(num_pp=pipeline_stages, num_mp=tensor_parallel, num_dp=dp)
    mesh = PipelineParallelGrid(topo)
    group, rank = mesh.group("tensor"), mesh.rank("tensor")
    torch.manual_seed(0)  # the same full model on every rank; each keeps its slices
    model = lite.GPTlite()
    model.blocks = nn.Sequential(*[TensorParallelBlock(b, group, tensor_parallel, rank) for b in model.blocks])
    return deepspeed.pipe.PipelineModule(layers=model.to_layers(), topology=topo,
                                         loss_fn=loss_fn or nn.CrossEntropyLoss(), partition_method="uniform")


def main():
    deepspeed.init_distributed()
    parser = argparse.ArgumentParser(description="GPT lite, pipeline x tensor x data parallel")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--pipeline_stages", type=int, default=2)
    parser.add_argument("--tensor_parallel", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    args = deepspeed.add_config_arguments(parser).parse_args()
    world = deepspeed.comm.get_world_size()
    if world % (args.pipeline_stages * args.tensor_parallel):
        raise SystemExit(f"gptlite_3d: pipeline {args.pipeline_stages} x tensor {args.tensor_parallel} does not "
                         f"divide world {world}")
    model = build(args.pipeline_stages, args.tensor_parallel)
    engine, _, _, _ = deepspeed.initialize(args=args, model=model,
                                           training_data=lite.GPTliteDataset(lite.load_corpus(), lite.block_size))
    losses = [float(engine.train_batch()) for _ in range(args.steps)]
    if engine.global_rank == 0:
        print(f"trained {args.steps} steps on pipe {args.pipeline_stages} x tensor {args.tensor_parallel} x data "
              f"{engine.mesh.size('data')}: loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)


if __name__ == "__main__":
    main()
