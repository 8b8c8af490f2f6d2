"""The calls of DeepSpeed's sharded_moe gating functions that tests/runtime/moe/test_sharded_moe_ds.py
compares: run against DeepSpeed's module by scripts/make_ds_sharded_moe_fixtures.py (recorded
in tests/data/ds_sharded_moe.pt) and against dslaunch's by the test. Each case seeds torch's
generator itself, so the random token selection and the Gumbel draws are the same streams."""
import torch

SHAPES = ((16, 4), (8, 2), (3, 4), (12, 6))  # (tokens, experts); 8x2 and 3x4 put capacity past the tokens
SEEDS = (0, 1, 2)


def _cases(m, logits):
    return {
        "top1": lambda: m.top1gating(logits.clone(), 1.0, 0),
        "top1_no_rts": lambda: m.top1gating(logits.clone(), 1.5, 1, use_rts=False),
        "top1_rsample": lambda: m.top1gating(logits.clone(), 1.0, 0, noisy_gate_policy="RSample"),
        "top1_no_drop": lambda: m.top1gating(logits.clone(), 1.0, 0, drop_tokens=False),
        "top1_wide": lambda: m.top1gating(logits.clone(), 4.0, 0, use_rts=False),
        "top1_sparse": lambda: m.top1gating(logits.clone(), 1.0, 0, sparse_routes=True),
        "top2": lambda: m.top2gating(logits.clone(), 1.0, 0),
        "top2_no_sampling": lambda: m.top2gating(logits.clone(), 0.5, 1, top2_2nd_expert_sampling=False),
        "top2_no_drop": lambda: m.top2gating(logits.clone(), 1.0, 0, drop_tokens=False),
        "top2_sparse": lambda: m.top2gating(logits.clone(), 1.0, 0, sparse_routes=True),
        "topk": lambda: m.topkgating(logits.clone(), 2, 1.0, 0),
        "topk_position": lambda: m.topkgating(logits.clone(), 2, 0.5, 1, drop_policy="position"),
        "topk_no_drop": lambda: m.topkgating(logits.clone(), 2, 1.0, 0, drop_tokens=False),
        "topk_sparse": lambda: m.topkgating(logits.clone(), 2, 0.75, 0, sparse_routes=True),
    }


def run(m):
    """{"seed/tokens/experts/case": [tensors]} for module `m` (a sharded_moe)."""
    out = {}
    for seed in SEEDS:
        for s, e in SHAPES:
            torch.manual_seed(seed)
            logits = torch.randn(s, e)
            for name, fn in _cases(m, logits).items():
                torch.manual_seed(100 + seed)
                out[f"{seed}/{s}/{e}/{name}"] = [r.detach() if torch.is_tensor(r) else torch.tensor(int(r)) for r in fn()]
            # the sparse helpers on routes with drops (-1) and distinct slots per route
            torch.manual_seed(seed)
            idx = torch.randint(-1, e, (2, s))
            loc = torch.stack([torch.arange(s) % 3, torch.arange(s) % 3])
            slots = m._route_slots(idx, loc, e, 3)
            first = torch.where(idx[:1] >= 0, idx[:1] * 3 + torch.arange(s) // e % 3, torch.full_like(idx[:1], -1))
            unique = m._route_slots(first, torch.zeros_like(first), e, 3)
            out[f"{seed}/{s}/{e}/sparse_helpers"] = [
                slots, m._sparse_decode(torch.randn(e * 3, 5), slots, torch.rand(2, s), s), unique]
    return out
