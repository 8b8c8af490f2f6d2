"""Ulysses DistributedAttention: sp ranks each holding a slice of the sequence give the
output and gradients of one process attending over the whole sequence.

Gloo processes on CPU, fp32. Cases: Megatron's [s, b, h, d] and batch-first [b, s, h, d];
heads that split evenly, unevenly (5 heads over 2 ranks, 7 over 4... within what 2-4 ranks
allow) and grouped-query attention (the split follows the key/value heads). The reference
is the same causal attention on the full q, k, v in one process; each rank compares its
own slice of the output and of the input gradients (q, k, v). The head arithmetic and the
one-line refusals are checked without processes.
"""
import pytest

from dist_harness import run_function


def causal_attention(q, k, v, batch_dim_idx=0):
    """Causal softmax attention in q's layout; k/v may have fewer heads (GQA)."""
    import torch

    if batch_dim_idx == 1:  # [s, b, h, d] -> [b, s, h, d]
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    rep = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(rep, dim=2)
    v = v.repeat_interleave(rep, dim=2)
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # [b, h, s, d]
    scores = qh @ kh.transpose(-1, -2) / qh.shape[-1] ** 0.5
    s = scores.shape[-1]
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)
    out = scores.masked_fill(mask, float("-inf")).softmax(-1) @ vh
    out = out.transpose(1, 2)  # [b, s, h, d]
    return out.transpose(0, 1) if batch_dim_idx == 1 else out


def _inputs(batch_dim_idx, seq, heads, kv_heads, batch=2, dim=4):
    import torch

    g = torch.Generator().manual_seed(7)
    shape = lambda h: (batch, seq, h, dim) if batch_dim_idx == 0 else (seq, batch, h, dim)  # noqa: E731
    q = torch.randn(shape(heads), generator=g)
    k = torch.randn(shape(kv_heads), generator=g)
    v = torch.randn(shape(kv_heads), generator=g)
    w = torch.randn(shape(heads), generator=g)  # the loss weights: sum(out * w)
    return q, k, v, w


def attention_body(batch_dim_idx, seq, heads, kv_heads):
    import torch

    from dslaunch.runtime import comm
    from dslaunch.runtime.parallel import MeshDims, ProcessMesh, topology_for
    from dslaunch.runtime.sequence import DistributedAttention

    world = comm.get_world_size()
    mesh = ProcessMesh(topology_for(MeshDims.for_world(world, sequence=world)))
    sp, r = mesh.size("sequence"), mesh.rank("sequence")
    seq_dim = 1 - batch_dim_idx
    full = [t.requires_grad_() for t in _inputs(batch_dim_idx, seq, heads, kv_heads)[:3]]
    w = _inputs(batch_dim_idx, seq, heads, kv_heads)[3]
    ref = causal_attention(*full, batch_dim_idx=batch_dim_idx)
    (ref * w).sum().backward()

    def mine(t):
        return t.detach().chunk(sp, dim=seq_dim)[r].clone()

    local = [mine(t).requires_grad_() for t in full]
    attn = DistributedAttention(lambda q, k, v: causal_attention(q, k, v, batch_dim_idx), mesh.group("sequence"),
                                scatter_idx=2, gather_idx=seq_dim)
    out = attn(*local, batch_dim_idx)
    (out * mine(w)).sum().backward()
    diffs = [float((out - mine(ref)).abs().max())]
    diffs += [float((t.grad - mine(f.grad)).abs().max()) for t, f in zip(local, full)]
    return diffs


CASES = {  # nprocs -> [(batch_dim_idx, seq, heads, kv_heads)], one launch per world size
    2: [(1, 8, 4, 4),   # [s, b, h, d]
        (0, 8, 4, 4),   # [b, s, h, d]
        (0, 6, 6, 3),   # GQA with 3 key/value heads over 2 ranks: 2 and 1 (query heads 4 and 2)
        (1, 4, 5, 5)],  # 5 heads over 2 ranks: 3 and 2
    4: [(0, 8, 8, 4),   # GQA, 4 ranks
        (1, 8, 10, 5)],  # uneven GQA: 5 key/value heads over 4 ranks
}


def cases_body(cases):
    return [attention_body(*case) for case in cases]


@pytest.mark.parametrize("nprocs", sorted(CASES))
def test_distributed_attention_equals_full_sequence_attention(nprocs):
    results = run_function(cases_body, nprocs=nprocs, timeout=120, kwargs=dict(cases=CASES[nprocs]))
    for rank, per_case in enumerate(results):
        for case, diffs in zip(CASES[nprocs], per_case):
            assert max(diffs) < 1e-5, (rank, case, diffs)  # output, dq, dk, dv


def test_head_splits_follow_key_value_heads():
    from dslaunch.runtime.sequence import SequenceParallelError, head_splits

    assert head_splits(4, 2) == [2, 2]
    assert head_splits(5, 2) == [3, 2]
    assert head_splits(7, 4) == [2, 2, 2, 1]
    assert head_splits(8, 2, kv_heads=2) == [4, 4]
    assert head_splits(10, 4, kv_heads=5) == [4, 2, 2, 2]  # query heads ride with their key/value head
    with pytest.raises(SequenceParallelError, match="3 key/value heads cannot be split over sequence parallel size 4"):
        head_splits(6, 4, kv_heads=3)
    with pytest.raises(SequenceParallelError, match="not a whole multiple"):
        head_splits(6, 2, kv_heads=4)


def test_distributed_attention_refuses_what_it_cannot_do():
    import torch

    from dslaunch.runtime.sequence import DistributedAttention, SequenceParallelError

    with pytest.raises(SequenceParallelError, match="scatter_idx 1 is not supported"):
        DistributedAttention(causal_attention, None, scatter_idx=1)
    with pytest.raises(SequenceParallelError, match="sp_stream"):
        DistributedAttention(causal_attention, None, sp_stream=object())
    attn = DistributedAttention(causal_attention, None)
    q = torch.zeros(2, 4, 2, 3)
    with pytest.raises(SequenceParallelError, match="rotary_pos_emb is not supported"):
        attn(q, q, q, 0, (q, q))
    with pytest.raises(SequenceParallelError, match="batch_dim_idx 2"):
        attn(q, q, q, 2)


def seq_all_to_all_body(cases):
    """DeepSpeed's _SeqAllToAll, called as its Ulysses tests call it: this rank's sequence
    slice -> the whole sequence of its heads (compared with the full tensor's head slice) ->
    back (compared with the input), and the gradient through both (an all-to-all only moves
    elements, so d sum(s2h * W_r) / d x is W's slice and the round trip passes w through)."""
    import torch

    from dslaunch.runtime import comm
    from dslaunch.runtime.parallel import MeshDims, ProcessMesh, topology_for
    from dslaunch.runtime.sequence import head_splits
    from dslaunch.runtime.sequence.layer import _SeqAllToAll

    world = comm.get_world_size()
    mesh = ProcessMesh(topology_for(MeshDims.for_world(world, sequence=world)))
    group, sp, r = mesh.group("sequence"), mesh.size("sequence"), mesh.rank("sequence")
    diffs = []
    for batch_dim_idx, seq, heads in cases:
        seq_dim = 1 - batch_dim_idx
        g = torch.Generator().manual_seed(11)
        shape = (2, seq, heads, 3) if batch_dim_idx == 0 else (seq, 2, heads, 3)
        full, weight = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
        first = sum(head_splits(heads, sp)[:r])
        mine_heads = slice(first, first + head_splits(heads, sp)[r])
        local = full.chunk(sp, dim=seq_dim)[r].clone().requires_grad_()
        s2h = _SeqAllToAll.apply(group, local, 2, seq_dim, batch_dim_idx)
        back = _SeqAllToAll.apply(group, s2h, seq_dim, 2, batch_dim_idx)
        w_back = weight.chunk(sp, dim=seq_dim)[r]
        ((s2h * weight[:, :, mine_heads]).sum() + (back * w_back).sum()).backward()
        diffs.append((float((s2h - full[:, :, mine_heads]).abs().max()), float((back - local).abs().max()),
                      float((local.grad - 2 * w_back).abs().max())))
    return diffs


def test_seq_all_to_all_moves_heads_and_sequence_as_deepspeed_does():
    cases = [(0, 4, 4), (1, 4, 3), (0, 6, 7)]  # even heads, and 3 and 7 heads over 2 ranks (2/1, 4/3)
    for rank, per_case in enumerate(run_function(seq_all_to_all_body, nprocs=2, timeout=120, kwargs=dict(cases=cases))):
        for case, diffs in zip(cases, per_case):
            assert max(diffs) == 0.0, (rank, case, diffs)  # s2h, the round trip, the gradient


def test_seq_all_to_all_refuses_the_overlapped_variant():
    import torch

    from dslaunch.runtime.sequence import SequenceParallelError
    from dslaunch.runtime.sequence.layer import _SeqAllToAll

    x = torch.zeros(2, 4, 2, 3)
    with pytest.raises(SequenceParallelError, match="overlapped all-to-all"):
        _SeqAllToAll.apply(None, x, 2, 1, 0, handle={}, type="q")
    with pytest.raises(SequenceParallelError, match="one must be the head dim 2"):
        _SeqAllToAll.apply(None, x, 1, 3, 0)
