"""deepspeed.runtime.comm.coalesced_collectives: reduce_scatter_coalesced on 2 and 3 gloo
ranks against the average computed in one process, parts of uneven and empty length included;
the quantized all-to-all refuses in one line, its op builder answering False."""
import pytest
import torch

from dist_harness import run_function

SIZES = [6, 3, 1, 7]


def _inputs(rank, dtype=torch.float32):
    torch.manual_seed(rank)
    return [torch.randn(n, dtype=dtype).reshape(-1) for n in SIZES[:-1]] + [torch.randn(7, dtype=dtype).view(7, 1)]


def _body():
    import torch.distributed as dist

    from dslaunch.runtime.comm.coalesced_collectives import reduce_scatter_coalesced

    out = reduce_scatter_coalesced(_inputs(dist.get_rank()), dist.group.WORLD)
    return [t.tolist() for t in out]


@pytest.mark.parametrize("world", [2, 3])
def test_each_rank_gets_its_part_of_the_average(world):
    got = run_function(_body, nprocs=world, timeout=240)
    average = [sum(ts) / world for ts in zip(*[[t.reshape(-1) for t in _inputs(r)] for r in range(world)])]
    for rank, parts in enumerate(got):
        for avg, part in zip(average, parts):
            chunk = -(-avg.numel() // world)
            want = avg[rank * chunk:(rank + 1) * chunk]
            assert len(part) == want.numel()  # the last ranks' parts are shorter, or empty
            assert torch.allclose(torch.tensor(part), want, atol=1e-6)


def test_one_process_keeps_the_whole_tensor_and_quantized_reduce_refuses():
    from dslaunch.runtime.comm.coalesced_collectives import all_to_all_quant_reduce, reduce_scatter_coalesced
    from dslaunch.runtime.ops.op_builder import QuantizerBuilder

    t = torch.arange(5.0)
    (out,) = reduce_scatter_coalesced([t])
    assert torch.equal(out, t)
    assert QuantizerBuilder().is_compatible() is False
    with pytest.raises(RuntimeError, match="needs DeepSpeed's quantizer op"):
        all_to_all_quant_reduce([t], {})
