"""Shard arithmetic (pure, no processes) and the collectives it relies on (one 2-rank run)."""
import pytest

from dslaunch.runtime.zero.partition import (FlatLayout, Piece, coverage_gaps, intersect, padded_size, param_shard,
                                             plan_buckets)


def test_flat_layout_pads_and_every_element_has_exactly_one_owner():
    shapes = [("a", (3, 5)), ("b", (7,)), ("c", (1,)), ("d", (2, 2))]
    for world in (1, 2, 3, 4, 7):
        lay = FlatLayout.build(shapes, world)
        assert lay.total == 27
        assert lay.padded_total % (2 * world) == 0 and lay.padded_total - lay.total < 2 * world  # DeepSpeed's
        seen = {}
        for r in range(world):
            for p in lay.pieces(r):
                for i in range(p.start, p.end):
                    assert (p.name, i) not in seen
                    seen[(p.name, i)] = r
                assert 0 <= p.offset and p.offset + p.numel <= lay.partition_size
        assert len(seen) == 27


def test_flat_layout_straddling_parameter_and_owner_ranks():
    lay = FlatLayout.build([("a", (2,)), ("b", (9,))], 4)  # padded 16 (DeepSpeed aligns to 2 x world), partition 4
    assert lay.partition_size == 4
    assert lay.pieces(0) == [Piece("a", 0, 2, 0), Piece("b", 0, 2, 2)]
    assert lay.pieces(2) == [Piece("b", 6, 9, 0)]
    assert lay.pieces(3) == []
    assert lay.owner_ranks("b") == [0, 1, 2]


def test_tiny_model_still_gives_every_rank_a_partition():
    lay = FlatLayout.build([("a", (1,))], 4)
    assert lay.partition_size == 2 and lay.pieces(3) == []


def test_param_shard_uneven():
    assert padded_size(10, 4) == 12
    chunks = [param_shard(10, 4, r) for r in range(4)]
    assert [(c.start, c.end) for c in chunks] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert [(c.start, c.end) for c in (param_shard(2, 4, r) for r in range(4))] == [(0, 1), (1, 2), (2, 2), (2, 2)]


def test_bucket_plan_preserves_order_and_isolates_big_items():
    assert plan_buckets([3, 3, 3, 10, 1], 6) == [[0, 1], [2], [3], [4]]
    assert plan_buckets([], 5) == []
    with pytest.raises(ValueError):
        plan_buckets([1], 0)


def test_intersect_and_gaps():
    pieces = [Piece("w", 0, 4, 0), Piece("w", 4, 9, 0), Piece("v", 0, 3, 0)]
    assert [(a, b) for _, a, b in intersect(pieces, "w", 2, 6)] == [(2, 4), (4, 6)]
    assert coverage_gaps([(0, 3), (5, 9)], 10) == [(3, 5), (9, 10)]
    assert coverage_gaps([(0, 10)], 10) == []


def _collectives_both_paths():
    import torch

    from dslaunch.runtime import comm

    world_group = comm.get_world_group()
    rank, world = comm.get_rank(world_group), comm.get_world_size(world_group)
    flat = torch.arange(12, dtype=torch.float32) * (rank + 1)
    out = {}
    for fallback in (False, True):
        comm.force_fallback(fallback)
        part = torch.empty(12 // world)
        comm.reduce_scatter_tensor(part, flat, group=world_group)
        full = torch.empty(12)
        comm.all_gather_into_tensor(full, part, group=world_group)
        out[fallback] = (part.tolist(), full.tolist())
    return out


def test_gloo_collectives_native_and_fallback_agree():
    """reduce_scatter/all_gather through the native tensor collectives and through the
    all_reduce/all_gather equivalents used where a backend lacks them."""
    from dist_harness import run_function

    results = run_function(_collectives_both_paths, nprocs=2, timeout=60)
    total = [3.0 * i for i in range(12)]  # ranks contribute 1x and 2x
    for rank, r in enumerate(results):
        assert r[False] == r[True]
        assert r[False][0] == total[rank * 6:(rank + 1) * 6]
        assert r[False][1] == total


def test_pin_memory_is_a_no_op_without_cuda_and_pins_with_it():
    import torch

    from dslaunch.runtime.zero.offload import pin_host

    t = torch.arange(4.0)
    assert pin_host(t, False) is t
    out = pin_host(t, True)
    if torch.cuda.is_available():
        assert out.is_pinned() and torch.equal(out, t)
    else:
        assert out is t  # torch cannot pin without CUDA, and there is no device to copy to


@pytest.mark.gpu
def test_offloaded_masters_and_stage3_shards_are_pinned_on_gpu():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from dslaunch.runtime.config import DeepSpeedConfig
    from dslaunch.runtime.strategy import StrategyContext, strategy_for_stage

    def strategy(stage, model):
        off = {"device": "cpu", "pin_memory": True}
        cfg = DeepSpeedConfig.load({"zero_optimization": {"stage": stage, "offload_optimizer": off,
                                                          "offload_param": off, "reduce_bucket_size": 100,
                                                          "allgather_bucket_size": 100,
                                                          "stage3_param_persistence_threshold": 0}})
        ctx = StrategyContext(module=model, optimizer=torch.optim.Adam(model.parameters()), config=cfg,
                              device=torch.device("cuda"), compute_dtype=torch.float32, rank=0, world_size=1)
        return strategy_for_stage(stage)(ctx)

    opt = strategy(2, torch.nn.Linear(16, 8).cuda())
    assert all(g.master.is_pinned() and g.grad.is_pinned() for g in opt.groups)
    opt.close()
    model = torch.nn.Linear(16, 8).cuda()
    eng = strategy(3, model)
    assert all(g["master"].is_pinned() for g in eng.groups)
    assert all(p._zero.shard.is_pinned() for p in model.parameters())
    eng.close()


def _ds_attributes():
    import torch

    import dslaunch.runtime as deepspeed
    from dslaunch.runtime.zero.partition_parameters import ZeroParamStatus

    with deepspeed.zero.Init(config_dict_or_path={"zero_optimization": {"stage": 3,
                                                                        "stage3_param_persistence_threshold": 10}}):
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    w, b = net[0].weight, net[0].bias
    seen = {"at rest": (w.numel(), w.ds_numel, tuple(w.ds_shape), w.ds_status, b.ds_status)}
    with deepspeed.zero.GatheredParameters([w]):
        seen["gathered"] = (w.numel(), w.ds_status)
    seen["released"] = (w.numel(), w.ds_status)
    seen["ids"] = sorted(p.ds_id for p in net.parameters())
    seen["persist"] = [p.ds_persist for p in net.parameters()]
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 10}}
    deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    seen["persist with an engine"] = [p.ds_persist for p in net.parameters()]
    seen["held with an engine"] = [p.numel() for p in net.parameters()]
    return {k: [v.name if isinstance(v, ZeroParamStatus) else v for v in vals] for k, vals in seen.items()}


def test_zero3_parameters_carry_deepspeeds_numel_shape_id_and_status():
    """ds_numel/ds_shape are the full size while only a shard is held; ds_status follows
    gather and release (DeepSpeed's ZeroParamStatus values); ds_id is unique; ds_persist marks
    the parameters kept whole."""
    from dist_harness import run_function

    for seen in run_function(_ds_attributes, nprocs=2, timeout=120):
        assert seen["at rest"] == [0, 128, (16, 8), "NOT_AVAILABLE", "NOT_AVAILABLE"]
        assert seen["gathered"] == [128, "AVAILABLE"] and seen["released"] == [0, "NOT_AVAILABLE"]
        assert len(set(seen["ids"])) == 4
        # DeepSpeed 0.19.8 (2 CPU ranks, this model and config): zero.Init cuts every parameter and
        # marks none persistent; the engine marks numel <= stage3_param_persistence_threshold (10):
        # only the 4-element bias of the second layer (held whole here from then on)
        assert seen["persist"] == [False, False, False, False]
        assert seen["persist with an engine"] == [False, False, False, True]
        assert seen["held with an engine"] == [0, 0, 0, 4]
