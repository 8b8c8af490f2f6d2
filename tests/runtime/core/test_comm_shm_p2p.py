"""dslaunch.runtime.comm.shm_p2p: send/recv between two ranks of one host through a ring of
shared slots.

The ring's protocol on its own, in one process (both ends over one tensor): pieces, slot
reuse by sequence number, a full ring refusing, wrap-around. Then through comm.send / isend
/ recv / irecv on 2 ranks, against what was sent (bit for bit): every dtype the pipeline
sends (bool as uint8), an empty tensor, messages larger than the whole ring (queued and
written as the receiver frees slots), several tags between the same two ranks received out
of their send order, both ranks isending 3 rings' worth to each other before either receives
(the queues drain while each waits in its receive), blocking sends in a ping-pong, and ranks
that name different hosts staying on gloo with the same results.
"""
import os

import torch

from dist_harness import run_function


def test_ring_protocol_in_one_process():
    from dslaunch.runtime.core.comm import shm_p2p as P

    assert P.pieces(0, 4) == [] and P.pieces(4, 4) == [(0, 4)] and P.pieces(9, 4) == [(0, 4), (4, 4), (8, 1)]
    mem = torch.zeros(P.ring_bytes(slots=2, slot_bytes=8), dtype=torch.uint8)
    writer, reader = P.Ring(mem, slots=2, slot_bytes=8), P.Ring(mem, slots=2, slot_bytes=8)
    out = torch.empty(8, dtype=torch.uint8)
    assert not reader.try_read(out)  # nothing written yet
    sent = [torch.arange(8, dtype=torch.uint8) + 10 * k for k in range(5)]
    assert writer.try_write(sent[0]) and writer.try_write(sent[1])
    assert not writer.try_write(sent[2])  # two slots, both full
    for k in range(5):  # slot k % 2 is reused once its piece was read
        assert reader.try_read(out) and torch.equal(out, sent[k])
        if k + 2 < 5:
            assert writer.try_write(sent[k + 2])
    assert not reader.try_read(out)
    assert writer.written.value == reader.read.value == 5
    short = torch.empty(3, dtype=torch.uint8)  # a last piece shorter than a slot
    assert writer.try_write(torch.tensor([7, 8, 9], dtype=torch.uint8)) and reader.try_read(short)
    assert short.tolist() == [7, 8, 9]


def _payloads(seed):
    from dslaunch.runtime.core.comm import shm_p2p as P

    g = torch.Generator().manual_seed(seed)
    big = 3 * P.SLOTS * P.SLOT_BYTES // 4 + 123  # three rings' worth of float32, not a whole number of slots
    return [torch.randn(5, 7, generator=g), torch.randn(4, generator=g).to(torch.bfloat16),
            torch.randn(3, generator=g, dtype=torch.float64), torch.randint(0, 9, (6,), generator=g),
            (torch.randn(10, generator=g) > 0).view(torch.uint8), torch.empty(0), torch.randn(2, 3, generator=g),
            torch.randn(big, generator=g)]  # odd index: sent with isend (see _exchange)


def _exchange(rank, tags=(0, 5)):
    """Both ranks isend every payload on two tags, then receive the other's: tag 5's messages
    first, although they were sent after tag 0's (half through irecv). Then a ping-pong of
    blocking sends: rank 0 sends each payload and receives it back from rank 1."""
    from dslaunch.runtime import comm

    world = comm.get_world_group()
    peer = 1 - rank
    mine = {tag: _payloads(10 * rank + tag) for tag in tags}
    works = [comm.isend(t, peer, group=world, tag=tag, label="test") for tag in tags for t in mine[tag]]
    got_ok = []
    for tag in reversed(tags):
        want = _payloads(10 * peer + tag)
        for k, t in enumerate(want):
            buf = torch.empty_like(t)
            if k % 2:
                comm.irecv(buf, peer, group=world, tag=tag, label="test").wait()
            else:
                comm.recv(buf, peer, group=world, tag=tag, label="test")
            got_ok.append(torch.equal(buf, t))
    for w in works:
        w.wait()
    for t in _payloads(7):
        buf = torch.empty_like(t)
        if rank == 0:
            comm.send(t, peer, group=world, tag=tags[0], label="test")
            comm.recv(buf, peer, group=world, tag=tags[0], label="test")
            got_ok.append(torch.equal(buf, t))
        else:
            comm.recv(buf, peer, group=world, tag=tags[0], label="test")
            comm.send(buf, peer, group=world, tag=tags[0], label="test")
    return got_ok


def _worker(other_hosts=False):
    from dslaunch.runtime import comm

    rank = comm.get_rank()
    if other_hosts:
        os.environ["NODE_RANK"] = str(rank)  # what the launcher sets on two machines
    peer = 1 - rank
    tags = (0, 5)
    flows = comm.connect_same_host_p2p(comm.get_world_group(), [(peer, t) for t in tags], [(peer, t) for t in tags])
    ok = _exchange(rank, tags)
    comm.wait_p2p_sends()
    return {"flows": flows, "ok": ok}


def test_send_recv_through_the_ring_on_one_host():
    results = run_function(_worker, nprocs=2, timeout=180, env={"DSLAUNCH_SHM_COMM": "1"})
    want = [(0, 1, 0), (0, 1, 5), (1, 0, 0), (1, 0, 5)]
    for r in results:
        assert r["flows"] == want
        assert r["ok"] and all(r["ok"]), r["ok"]


def test_ranks_on_different_hosts_stay_on_gloo():
    results = run_function(_worker, nprocs=2, timeout=180, kwargs={"other_hosts": True},
                           env={"DSLAUNCH_SHM_COMM": "1"})
    for r in results:
        assert r["flows"] == []
        assert r["ok"] and all(r["ok"]), r["ok"]
