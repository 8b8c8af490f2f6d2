"""The memory bound of scripts/bench_adam.py: the probe (scripts/stream_probe.cpp, built by the
ops builder) must move exactly the bytes an optimizer step moves, or the "of bound" it prints
means nothing. With a non-zero scale every written element becomes itself plus scale times the
sum of all read arrays' elements, so the result shows that every array was read in full and
exactly the first `writes` were written, by both threads.
"""
import pytest
import torch

from script_modules import load_script


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    return load_script("bench_adam").Probe(str(tmp_path_factory.mktemp("probe-cache")))


@pytest.mark.parametrize("reads,writes", [(4, 3), (3, 2), (2, 1)])  # Adam; Lion, Adagrad; any other
def test_probe_reads_every_array_and_writes_the_first(probe, reads, writes):
    n = 3 * 2**18 + 1001  # split between the threads (cpu_simd.h), with a SIMD tail
    gen = torch.Generator().manual_seed(0)
    arrays = [torch.randint(-8, 8, (n,), generator=gen).float() for _ in range(reads)]
    before = [a.clone() for a in arrays]
    probe.runner(arrays, writes, threads=1)()  # scale 0, as timed: nothing changes
    for a, b in zip(arrays, before):
        assert torch.equal(a, b)
    probe.runner(arrays, writes, threads=2, scale=0.5)()
    total = sum(before)  # small integers: every sum is exact in fp32
    for k, (a, b) in enumerate(zip(arrays, before)):
        assert torch.equal(a, b + 0.5 * total if k < writes else b), k


def test_probe_refuses_more_writes_than_reads(probe):
    arrays = [torch.zeros(64) for _ in range(2)]
    with pytest.raises(ValueError, match="3 writes of 2 arrays"):
        probe.runner(arrays, 3, threads=1)()
