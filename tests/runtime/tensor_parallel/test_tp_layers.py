"""The tensor-parallel training layers against single-process nn.Linear / nn.Embedding.

One 4-rank gloo job with tp=2 (tensor groups {0,1} and {2,3}, built by
tensor_parallel_group in DeepSpeed's rank order) checks every layer: the forward output and
the gradients of the input and of the full weight and bias (reassembled from the shards by
full_state_dict) equal the dense layer's to 1e-6 in fp32 (relative to the reference's largest
element where that exceeds 1: sums of ~30 terms of size ~10 round at ~1e-6 absolute). A hand-written Megatron-style block
(fused-qkv attention and an MLP, built from the public classes) matches its dense twin before
and after one SGD step, and its flight record shows each collective, forward and backward, on
this rank's tensor group and nowhere else. Single-process tests cover the shard maths and the
one-line errors.
"""
from __future__ import annotations

import sys

import pytest
import repo_paths

sys.path.insert(0, str(repo_paths.TESTS))

from dist_harness import run_function  # noqa: E402


def _last_seqs(comm):
    """The last sequence number per group in this rank's flight record (a ring of 64 entries)."""
    last = {}
    for e in comm.flight_record():
        last[e["group"]] = max(last.get(e["group"], 0), e["seq"])
    return last


def _since(comm, last):
    return [e for e in comm.flight_record() if e["seq"] > last.get(e["group"], 0)]

TOL = 1e-6


def _block_classes():
    import torch
    import torch.nn.functional as F
    from torch import nn

    from dslaunch.runtime.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    class Block(nn.Module):
        """Pre-norm attention (fused [q|k|v]) and MLP; `tp` None builds the dense twin."""

        def __init__(self, hidden=16, heads=4, tp=None):
            super().__init__()
            self.heads, self.head_dim = heads, hidden // heads
            self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
            if tp is None:
                self.qkv, self.out = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
                self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)
            else:
                group, size, rank = tp
                self.heads //= size  # local heads
                self.qkv = ColumnParallelLinear(hidden, 3 * hidden, group, size, rank, parts=[hidden] * 3,
                                                label="block.qkv")
                self.out = RowParallelLinear(hidden, hidden, group, size, rank, label="block.out")
                self.fc1 = ColumnParallelLinear(hidden, 4 * hidden, group, size, rank, label="block.fc1")
                self.fc2 = RowParallelLinear(4 * hidden, hidden, group, size, rank, label="block.fc2")

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
            q, k, v = (z.reshape(b, t, self.heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.out(a.transpose(1, 2).reshape(b, t, -1))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    def load_dense_into(tp_block, dense, size, rank):
        with torch.no_grad():
            for name in ("ln1", "ln2"):
                getattr(tp_block, name).load_state_dict(getattr(dense, name).state_dict())
            for name in ("qkv", "out", "fc1", "fc2"):
                layer, src = getattr(tp_block, name), getattr(dense, name)
                layer.load_full_("weight", src.weight)
                layer.load_full_("bias", src.bias)

    return Block, load_dense_into


def _layers_job():
    import torch
    import torch.nn.functional as F
    from torch import nn

    from dslaunch.runtime import comm
    from dslaunch.runtime.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                                  VocabParallelLMHead, full_state_dict, tensor_parallel_group,
                                                  vocab_parallel_cross_entropy)

    tpg = tensor_parallel_group(2)
    group, size, rank = tpg.group, tpg.size, tpg.rank
    out = {"ranks": list(tpg.ranks), "rank": rank, "group": comm.group_name(tpg.group)}

    def diff(a, b):  # largest difference, relative to the reference's scale when that exceeds 1
        return ((a - b).abs().max() / b.abs().max().clamp(min=1)).item()

    def case(name, make_ref, make_tp, make_input, loss_fn, x_grad_slice=None):
        torch.manual_seed(0)
        ref = make_ref()
        tp_layer = make_tp(ref)
        x_ref = make_input()
        x_tp = x_ref.detach().clone().requires_grad_(x_ref.requires_grad)
        y_ref = ref(x_ref)
        loss_fn(y_ref).backward()
        y_tp = tp_layer(x_tp if x_grad_slice is None else x_grad_slice(x_tp))
        loss_fn(y_tp).backward()
        grads = {n: p.grad for n, p in tp_layer.named_parameters()}
        for n, p in tp_layer.named_parameters():  # reassemble the full gradient like a parameter
            p.data = grads[n]
        full = full_state_dict(tp_layer)
        res = {"y": diff(y_tp, y_ref)}
        for n, p in ref.named_parameters():
            res[f"grad {n}"] = diff(full[n], p.grad)
        if x_ref.requires_grad:
            res["grad x"] = diff(x_tp.grad, x_ref.grad)
        out[name] = res

    torch.manual_seed(123)  # the same loss weights on every rank
    w = torch.randn(64)

    def weighted(y):  # a loss every rank computes identically from the replicated output
        return (y * w[:y.shape[-1]]).sum() + (y ** 2).mean()

    def x_in(*shape):
        return lambda: torch.randn(*shape, requires_grad=True)

    case("column gathered", lambda: nn.Linear(8, 12),
         lambda r: ColumnParallelLinear.from_linear(r, group, size, rank, gather_output=True), x_in(3, 5, 8), weighted)

    case("row split input", lambda: nn.Linear(12, 6),
         lambda r: RowParallelLinear.from_linear(r, group, size, rank, input_is_parallel=False), x_in(3, 5, 12),
         weighted)

    # column (fused unequal parts, grouped-query shape) then row: Megatron's pair, no gather between
    class Pair(nn.Module):
        def __init__(self, first, second):
            super().__init__()
            self.first, self.second = first, second

        def forward(self, x):
            return self.second(torch.tanh(self.first(x)))

    def pair_tp(ref):
        # the column output [q 8 | k 4 | v 4] is permuted into per-rank [q_r | k_r | v_r]; the row
        # layer after it must read the same order: build it from the dense weight's matching columns
        first = ColumnParallelLinear.from_linear(ref.first, group, size, rank, parts=[8, 4, 4])
        second = RowParallelLinear(16, 6, group, size, rank)
        second.shards["weight"] = type(second.shards["weight"])(1, 16, (8, 4, 4))
        second.load_full_("weight", ref.second.weight.detach())
        second.load_full_("bias", ref.second.bias.detach())
        return Pair(first, second)

    case("column parts + row", lambda: Pair(nn.Linear(8, 16), nn.Linear(16, 6)), pair_tp, x_in(2, 3, 8), weighted)

    def ids():
        g = torch.Generator().manual_seed(3)
        return torch.randint(0, 11, (4, 7), generator=g)

    case("vocab embedding", lambda: nn.Embedding(11, 6, padding_idx=3),
         lambda r: VocabParallelEmbedding.from_embedding(r, group, size, rank), ids, weighted)

    case("vocab lm head", lambda: nn.Linear(6, 11, bias=True),
         lambda r: VocabParallelLMHead.from_linear(r, group, size, rank), x_in(2, 4, 6), weighted)

    # vocab-parallel cross-entropy against F.cross_entropy on gathered logits
    torch.manual_seed(1)
    head = nn.Linear(6, 11, bias=False)
    target = torch.randint(0, 11, (2, 4))
    target[0, 1] = -100
    x_ref = torch.randn(2, 4, 6, requires_grad=True)
    ref_loss = F.cross_entropy(head(x_ref).reshape(-1, 11), target.reshape(-1), ignore_index=-100,
                               reduction="sum")
    ref_loss.backward()
    tp_head = VocabParallelLMHead.from_linear(head, group, size, rank, gather_output=False)
    x_tp = x_ref.detach().clone().requires_grad_(True)
    losses = vocab_parallel_cross_entropy(tp_head(x_tp), target, group, tp_head.start, tp_head.stop)
    losses.sum().backward()
    tp_head.weight.data = tp_head.weight.grad
    out["vocab cross-entropy"] = {"loss": diff(losses.sum(), ref_loss), "grad x": diff(x_tp.grad, x_ref.grad),
                                  "grad weight": diff(full_state_dict(tp_head)["weight"], head.weight.grad)}

    # the Megatron-style block: forward, backward, one SGD step, and where its collectives ran
    Block, load_dense_into = _block_classes()
    torch.manual_seed(2)
    dense = Block()
    block = Block(tp=(group, size, rank))
    load_dense_into(block, dense, size, rank)
    x = torch.randn(2, 5, 16)
    before = _last_seqs(comm)
    y_tp = block(x)
    fwd = _since(comm, before)
    loss_tp = weighted(y_tp)
    before = _last_seqs(comm)
    loss_tp.backward()
    bwd = _since(comm, before)
    y_ref = dense(x)
    loss_ref = weighted(y_ref)
    loss_ref.backward()
    for m in (dense, block):
        with torch.no_grad():
            for p in m.parameters():
                p -= 0.1 * p.grad
    after_tp, after_ref = full_state_dict(block), dense.state_dict()
    out["block"] = {"y": diff(y_tp, y_ref), "loss": abs(loss_tp.item() - loss_ref.item()),
                    "weights after step": max(diff(after_tp[k], after_ref[k]) for k in after_ref),
                    "local qkv rows": block.qkv.weight.shape[0],
                    "forward ops": [(e["op"], e["group"], e["label"]) for e in fwd],
                    "backward ops": [(e["op"], e["group"], e["label"]) for e in bwd]}
    return out


@pytest.fixture(scope="module")
def four_ranks():
    return run_function(_layers_job, nprocs=4, timeout=240)


def test_tensor_groups_are_adjacent_ranks(four_ranks):
    assert [r["ranks"] for r in four_ranks] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["rank"] for r in four_ranks] == [0, 1, 0, 1]


@pytest.mark.parametrize("name", ["column gathered", "row split input", "column parts + row", "vocab embedding",
                                  "vocab lm head", "vocab cross-entropy"])
def test_layer_forward_and_gradients_equal_dense(four_ranks, name):
    for r in four_ranks:
        res = r[name]
        assert all(v < TOL for v in res.values()), (name, res)
    assert any(k.startswith("grad") and "weight" in k for k in four_ranks[0][name])


def test_megatron_block_matches_dense_through_an_sgd_step(four_ranks):
    for r in four_ranks:
        b = r["block"]
        assert b["y"] < TOL and b["loss"] < 1e-5 and b["weights after step"] < TOL, b
        assert b["local qkv rows"] == 24  # 3 x 16 / 2: each rank holds its half of q, k and v


def test_each_collective_runs_on_the_tensor_group(four_ranks):
    for r, res in enumerate(four_ranks):
        group = res["group"]  # the mesh's tensor group, named in records by its first axis and its ranks
        assert group.endswith(" 0,1" if r < 2 else " 2,3"), group
        fwd, bwd = res["block"]["forward ops"], res["block"]["backward ops"]
        # forward: the two row-parallel sums; backward: the two column-parallel input gradients
        assert fwd == [("all_reduce", group, "tp block.out sum"), ("all_reduce", group, "tp block.fc2 sum")], fwd
        assert sorted(bwd) == sorted([("all_reduce", group, "tp block.qkv input grad (backward)"),
                                      ("all_reduce", group, "tp block.fc1 input grad (backward)")]), bwd


# ---------------------------------------------------------------- one process

def test_shard_maths():
    from dslaunch.runtime.tensor_parallel.shard import part_ranges, vocab_range

    assert part_ranges([8, 4, 4], 2, 1) == [(4, 8), (10, 12), (14, 16)]
    assert vocab_range(11, 2, 1) == (6, 11, 6) and vocab_range(11, 4, 3) == (9, 11, 3)


def test_tp_one_layers_are_plain_layers():
    import torch
    from torch import nn

    from dslaunch.runtime.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(0)
    lin = nn.Linear(4, 6)
    x = torch.randn(2, 4)
    assert torch.equal(ColumnParallelLinear.from_linear(lin, None, 1, 0)(x), lin(x))
    assert torch.equal(RowParallelLinear.from_linear(lin, None, 1, 0)(x), lin(x))


def test_bad_layer_arguments_are_one_line():
    from torch import nn

    from dslaunch.runtime.tensor_parallel import ColumnParallelLinear, RowParallelLinear, TensorParallelError

    with pytest.raises(TensorParallelError, match="tp size 3 does not divide the output features"):
        ColumnParallelLinear(4, 8, None, 3, 0)
    with pytest.raises(TensorParallelError, match="tp size 2 does not divide the input features of fc2 \\(5\\)"):
        RowParallelLinear(5, 4, None, 2, 0, label="fc2")
    with pytest.raises(TensorParallelError, match="tp_size 2 but the group given has 1 rank$"):
        ColumnParallelLinear.from_linear(nn.Linear(4, 8), None, 2, 0)
    with pytest.raises(TensorParallelError, match="gather_output needs an unfused output"):
        ColumnParallelLinear(4, 8, None, 1, 0, parts=[4, 4], gather_output=True)
