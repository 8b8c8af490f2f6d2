"""A tiny causal attention network trained under Ulysses sequence parallelism, shared by
tests/runtime/sequence/test_sequence_engine.py and scripts/make_ds_sp_fixtures.py (which runs it under real
DeepSpeed). Written against DeepSpeed's API only: `ds` is `deepspeed` or
`dslaunch.runtime`, and the attention wrapper is `ds.sequence.layer.DistributedAttention`
(DeepSpeed) or dslaunch's; `init_kwargs` carries what only DeepSpeed's initialize takes
(its `mesh_param=(dp, sp)`, which builds DeepSpeed's sequence groups).

Every rank of a sequence group gets the same rows and keeps its slice of the sequence
(positions offset by its rank), so sp ranks together see what one process sees.
"""
VOCAB, DIM, HEADS, KV_HEADS, SEQ, STEPS = 32, 16, 8, 4, 8, 3


def causal_attention(q, k, v):
    """[b, s, h, d] causal attention; k/v with fewer heads are shared by groups of q heads."""
    import torch

    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    scores = qh @ kh.transpose(-1, -2) / qh.shape[-1] ** 0.5
    mask = torch.ones(scores.shape[-1], scores.shape[-1], dtype=torch.bool).triu(1)
    return (scores.masked_fill(mask, float("-inf")).softmax(-1) @ vh).transpose(1, 2)


def make_net():
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(VOCAB, DIM)
            self.pos = torch.nn.Embedding(SEQ, DIM)
            hd = DIM // HEADS
            self.q = torch.nn.Linear(DIM, HEADS * hd)
            self.kv = torch.nn.Linear(DIM, 2 * KV_HEADS * hd)
            self.o = torch.nn.Linear(HEADS * hd, DIM)
            self.head = torch.nn.Linear(DIM, VOCAB)
            self.attn = None  # causal_attention, or a DistributedAttention around it

        def forward(self, tokens, offset):
            b, s = tokens.shape
            hd = DIM // HEADS
            x = self.emb(tokens) + self.pos(torch.arange(offset, offset + s))
            q = self.q(x).view(b, s, HEADS, hd)
            k, v = self.kv(x).view(b, s, 2, KV_HEADS, hd).unbind(2)
            a = self.attn(q, k, v, 0) if self.attn is not None else causal_attention(q, k, v)
            return self.head(x + self.o(a.reshape(b, s, HEADS * hd)))

    g = torch.Generator().manual_seed(0)
    net = Net()
    with torch.no_grad():
        for _, p in sorted(net.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return net


def make_tp_net():
    """The same kind of network with separate q, k, v and o projections whose reshapes take
    the head count from the tensor (-1), so tensor parallelism can shard the projections by
    heads (TP_SPECS: q, k, v by columns, o by rows) and each tensor rank attends over its
    share of the heads, which DistributedAttention then splits over the sequence group."""
    import torch

    class TpNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            hd = DIM // HEADS
            self.emb = torch.nn.Embedding(VOCAB, DIM)
            self.pos = torch.nn.Embedding(SEQ, DIM)
            self.q = torch.nn.Linear(DIM, HEADS * hd)
            self.k = torch.nn.Linear(DIM, KV_HEADS * hd)
            self.v = torch.nn.Linear(DIM, KV_HEADS * hd)
            self.o = torch.nn.Linear(HEADS * hd, DIM)
            self.head = torch.nn.Linear(DIM, VOCAB)
            self.attn = None

        def forward(self, tokens, offset):
            b, s = tokens.shape
            hd = DIM // HEADS
            x = self.emb(tokens) + self.pos(torch.arange(offset, offset + s))
            q, k, v = (proj(x).view(b, s, -1, hd) for proj in (self.q, self.k, self.v))
            a = self.attn(q, k, v, 0) if self.attn is not None else causal_attention(q, k, v)
            return self.head(x + self.o(a.reshape(b, s, -1)))

    g = torch.Generator().manual_seed(0)
    net = TpNet()
    with torch.no_grad():
        for _, p in sorted(net.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return net


TP_SPECS = {"use_default_specs": False, "layer_specs": [
    {"patterns": [r"^(q|k|v)\.(weight|bias)$"], "partition_type": "column"},
    {"patterns": [r"^o\.(weight|bias)$"], "partition_type": "row"}]}


def batch(step, rows):
    """Inputs and next-token labels of `rows` full sequences."""
    import torch

    g = torch.Generator().manual_seed(100 + step)
    t = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
    return t[:, :SEQ], t[:, 1:]


def train(ds, attention_cls, sp, micro, stage=0, optimizer="adamw", extra_config=None, init_kwargs=None, tp=1,
          net=None, sp_key=True):
    """Train STEPS steps; return (the loss of each step averaged over every rank, the
    module's weights at the end as one flat list; stages 0-2 keep them whole on every rank).
    tp > 1: `net` (make_tp_net()) sharded by TP_SPECS over tensor groups of tp adjacent
    ranks (dslaunch only: the weights returned are the shards reassembled). sp_key=False
    leaves sequence_parallel_size out of the config (init_kwargs' mesh_param then gives sp)."""
    import torch
    import torch.distributed as dist

    net = make_net() if net is None else net
    world = dist.get_world_size() if dist.is_initialized() else 1
    dp = world // (sp * tp)
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
           "gradient_clipping": 1.0,  # explicit: the global norm must count sequence ranks once
           "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}
    if sp > 1 and sp_key:
        cfg["sequence_parallel_size"] = sp
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp, "partition_config": TP_SPECS}
    cfg.update(extra_config or {})
    if optimizer == "adamw":
        opt = torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.01)
    else:
        opt = torch.optim.SGD(net.parameters(), lr=0.5)
    engine, _, _, _ = ds.initialize(model=net, optimizer=opt, config=cfg, **(init_kwargs or {}))
    group = engine.seq_parallel_group if sp > 1 else None
    if sp > 1:
        net.attn = attention_cls(causal_attention, group)
    rank = dist.get_rank() if dist.is_initialized() else 0
    # DeepSpeed's layout: tensor ranks adjacent, then sequence ranks, then data replicas
    d, r = rank // (sp * tp), (rank // tp) % sp
    losses = []
    for step in range(STEPS):
        x, y = batch(step, micro * dp)
        x, y = x[d * micro:(d + 1) * micro], y[d * micro:(d + 1) * micro]
        chunk = SEQ // sp
        x, y = x[:, r * chunk:(r + 1) * chunk], y[:, r * chunk:(r + 1) * chunk]
        logits = engine(x, r * chunk)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(mean)
            mean /= world
        losses.append(float(mean))
    if tp > 1:
        from dslaunch.runtime.tensor_parallel import full_state_dict

        full = full_state_dict(net)
        weights = torch.cat([full[n].float().reshape(-1) for n in sorted(full)])
        return losses, weights.tolist()
    weights = torch.cat([p.detach().float().reshape(-1) for _, p in sorted(net.named_parameters())])
    return losses, weights.tolist() if stage < 3 else None
