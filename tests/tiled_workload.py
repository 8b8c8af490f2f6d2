"""Tiled compute cases (TiledMLP, sequence_tiled_compute, TiledFusedLogitsLoss), shared by
tests/runtime/sequence/test_sequence_tiled.py and scripts/make_ds_tiled_fixtures.py (which runs them under
real DeepSpeed 0.19.8). Written against DeepSpeed's API only: `usp` is
`deepspeed.runtime.sequence_parallel.ulysses_sp` or dslaunch's module of that name.

Each case builds its weights and inputs from a seed, runs forward and backward (an upstream
gradient for tensors, 1 for a loss) and returns the output and every gradient as lists.
"""
HIDDEN, INTER, VOCAB, BATCH, SEQ = 8, 16, 32, 2, 10


def make_mlp(seed: int):
    """A Llama-style gated MLP: down(silu(gate(x)) * up(x))."""
    import torch

    torch.manual_seed(seed)

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj = torch.nn.Linear(HIDDEN, INTER, bias=False)
            self.up_proj = torch.nn.Linear(HIDDEN, INTER, bias=False)
            self.down_proj = torch.nn.Linear(INTER, HIDDEN, bias=False)

        def forward(self, x):
            return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))

    return MLP()


def mlp_forward(self, x):
    return self.forward(x)


def inputs(seed: int, seq: int = SEQ):
    """x [BATCH, seq, HIDDEN] requiring grad, an upstream gradient like it, next-token labels
    [BATCH, seq] with a few ignored (-100) and a 0/1 mask [BATCH, seq]."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, seq, HIDDEN, generator=g).requires_grad_(True)
    up = torch.randn(BATCH, seq, HIDDEN, generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, seq), generator=g)
    labels[0, :3] = -100
    labels[:, -1] = -100
    mask = (torch.rand(BATCH, seq, generator=g) > 0.3).long()
    return x, up, labels, mask


def _result(out, x, modules):
    import torch

    grads = {"x": x.grad.tolist()}
    for i, m in enumerate(modules):
        for name, p in m.named_parameters():
            grads[f"{i}.{name}"] = p.grad.tolist()
    return {"out": out.detach().tolist() if out.dim() else float(out.detach()), "grads": grads}


def run_mlp(usp, shards: int, seq: int = SEQ, tiled: bool = True):
    mlp = make_mlp(0)
    x, up, _, _ = inputs(1, seq)
    out = usp.TiledMLP.apply(mlp_forward, mlp, x, shards, list(mlp.parameters())) if tiled else mlp(x)
    out.backward(up)
    return _result(out, x, [mlp])


def run_sequence_compute(usp, shards: int, seq: int = SEQ, tiled: bool = True):
    """The MLP through sequence_tiled_compute: kwargs_to_shard {"x"}, outputs concatenated on the
    sequence, no reduction."""
    mlp = make_mlp(0)
    x, up, _, _ = inputs(1, seq)

    def fn(x):
        return mlp(x)

    if tiled:
        out = usp.sequence_tiled_compute(fn, seq, shards, {"x": x}, {}, "x", list(mlp.parameters()),
                                         output_unshard_dimension=1, output_reduction=None)
    else:
        out = fn(x)
    out.backward(up)
    return _result(out, x, [mlp])


def make_head(seed: int):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Linear(HIDDEN, VOCAB, bias=False)


def loss_mean(self, x, y):
    import torch

    return torch.nn.functional.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1), ignore_index=-100)


def loss_sum(self, x, y):
    import torch

    return torch.nn.functional.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1), ignore_index=-100,
                                             reduction="sum")


def loss_sum_masked(self, x, y, mask):
    import torch

    per = torch.nn.functional.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1), ignore_index=-100,
                                            reduction="none")
    return (per * mask.view(-1)).sum()


LOSSES = {"mean": (loss_mean, "mean", False), "sum": (loss_sum, "sum", False),
          "sum_masked": (loss_sum_masked, "sum", True)}


def run_loss(usp, kind: str, shards: int, seq: int = SEQ, tiled: bool = True, scale: float = 1.0):
    """The LM head + cross-entropy against `kind`'s loss function (LOSSES), untiled: the same
    reduction over torch.chunk's slices of the flattened rows; backward from scale x the loss."""
    import torch

    head = make_head(2)
    x, _, labels, mask = inputs(1, seq)
    fn, reduction, masked = LOSSES[kind]
    if tiled:
        out = usp.TiledFusedLogitsLoss.apply(fn, head, x, labels, mask if masked else None, shards,
                                             list(head.parameters()), reduction)
    else:
        xs = torch.chunk(x.reshape(-1, HIDDEN), shards)
        ys = torch.chunk(labels.reshape(-1), shards)
        ms = torch.chunk(mask.reshape(-1), shards)
        per = torch.stack([fn(head, a, b, *((m,) if masked else ())) for a, b, m in zip(xs, ys, ms)])
        out = per.mean() if reduction == "mean" else per.sum()
    (out * scale).backward()
    return _result(out, x, [head])


# the cases the DeepSpeed fixture records: name -> (runner, args)
CASES = {
    "mlp_shards4": ("run_mlp", {"shards": 4}),                       # 10 rows: 3, 3, 3, 1
    "mlp_shards3": ("run_mlp", {"shards": 3}),                       # 4, 4, 2
    "seq_compute_shards4": ("run_sequence_compute", {"shards": 4}),  # 3, 3, 3, 1
    "loss_mean_shards4": ("run_loss", {"kind": "mean", "shards": 4}),  # 20 rows: 5 each
    "loss_sum_shards3": ("run_loss", {"kind": "sum", "shards": 3}),    # 7, 7, 6
    "loss_sum_masked_shards4": ("run_loss", {"kind": "sum_masked", "shards": 4}),
}

# where DeepSpeed 0.19.8's gradients are wrong (the fixture records them; dslaunch's equal the
# untiled ones): "mean" over 20 rows in 6 requested shards (torch.chunk gives 5 slices; DeepSpeed
# divides the gradient by 6), and a loss scaled before backward (DeepSpeed leaves the weights'
# gradients unscaled)
DIFFERS = {
    "loss_mean_shards6": ("run_loss", {"kind": "mean", "shards": 6}),
    "loss_sum_scaled": ("run_loss", {"kind": "sum", "shards": 2, "scale": 0.5}),
}


def run_case(usp, name: str, tiled: bool = True):
    runner, kwargs = {**CASES, **DIFFERS}[name]
    if not tiled:
        return globals()[runner](usp, tiled=False, **kwargs)
    return globals()[runner](usp, **kwargs)
