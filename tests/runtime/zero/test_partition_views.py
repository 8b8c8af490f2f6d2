"""DeepSpeed's stage 1/2 names for the flat buffers' slices (runtime/zero/partition_views.py):
`optimizer.bit16_groups_flat[group]` is the group's flat model-dtype buffer, which the module's
parameters are views into, detached from autograd, and its making is logged with DeepSpeed's
line; `optimizer.parallel_partitioned_bit16_groups[group][rank]` is rank `rank`'s slice of it; each slice starts at a
multiple of `optimizer.nccl_start_alignment_factor` elements (DeepSpeed's 4-byte alignment); this
rank's slice holds its master partition after a step. Checked on 2 ranks, fp32 and bf16, with
a layout whose total (8 + 2 + 5) is odd, so the partitions are padded."""
import pytest
import torch

from dist_harness import run_function


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(3, 2)  # 6 + 2
        self.b = torch.nn.Linear(2, 1, bias=False)  # 2
        self.c = torch.nn.Parameter(torch.randn(5))

    def forward(self, x):
        return (self.b(torch.tanh(self.a(x))).squeeze(-1) * self.c[:1]).pow(2).mean()


def views_body(stage, dtype):
    import logging

    import dslaunch.runtime as deepspeed
    import torch.distributed as dist

    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    log = logging.getLogger("dslaunch.runtime")
    log.addHandler(Keep())
    log.setLevel(logging.INFO)

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Adam", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": stage}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    engine, optimizer, _, _ = deepspeed.initialize(model=_Net(), config=cfg)
    low = torch.bfloat16 if dtype == "bf16" else torch.float32
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(rank)).to(low)
    engine.backward(engine(x))
    engine.step()
    out = {"groups": len(optimizer.parallel_partitioned_bit16_groups),
           "factor": optimizer.nccl_start_alignment_factor}
    parts = optimizer.parallel_partitioned_bit16_groups[0]
    out["ranks"] = len(parts)
    out["aligned"] = all(p.data_ptr() % (2 * optimizer.nccl_start_alignment_factor) == 0 for p in parts)
    out["same_size"] = len({p.numel() for p in parts}) == 1 and parts[0].numel() * world >= 15
    storage = parts[0].untyped_storage().data_ptr()
    out["params_inside"] = all(p.untyped_storage().data_ptr() == storage for p in engine.module.parameters())
    master = optimizer.single_partition_of_fp32_groups[0]
    out["mine_is_master"] = torch.equal(parts[rank], master.to(low))
    # every parameter's values sit in the concatenated slices at the parameter's own offset
    flat = torch.cat(parts)
    whole = optimizer.bit16_groups_flat[0]
    out["flat_is_whole"] = (len(optimizer.bit16_groups_flat) == 1 and whole.grad_fn is None
                            and whole.numel() == parts[0].numel() * world
                            and whole.untyped_storage().data_ptr() == storage and torch.equal(whole, flat))
    out["logged"] = [m for m in lines if m.startswith("Flattening param group")]
    out["params_match"] = all(torch.equal(flat[p.storage_offset() - parts[0].storage_offset():][:p.numel()],
                                          p.detach().reshape(-1)) for p in engine.module.parameters())
    return out


@pytest.mark.parametrize("stage,dtype", [(1, "fp32"), (2, "fp32"), (2, "bf16"), (1, "bf16")])
def test_partitioned_bit16_groups_are_the_ranks_aligned_slices_of_the_flat_buffer(stage, dtype):
    for r in run_function(views_body, nprocs=2, kwargs={"stage": stage, "dtype": dtype}, timeout=120):
        assert r["groups"] == 1 and r["factor"] == 2 and r["ranks"] == 2, r
        assert r["aligned"] and r["same_size"] and r["params_inside"], r
        assert r["mine_is_master"] and r["params_match"], r
        assert r["flat_is_whole"], r
        assert r["logged"] == ["Flattening param group 0 on cpu (sufficient memory)"], r
