"""Pipeline schedules as data (runtime/pipe/schedule.py), without processes: every schedule
selectable by name runs each micro-batch forward once and backward once per stage and chunk
(a split backward: its input half, then its weight half, once each), sends meet receives in
order on every flow, the clock (simulate) finds no deadlock, and the bubble it measures is
1F1B's theory for 1F1B and below it for ZB-H1 and interleaved 1F1B."""
import pytest

from dslaunch.runtime.pipe import schedule as S

CASES = [(m, p) for p in (2, 4) for m in (4, 8, 16)]


def streams(name, m, p, chunks=2):
    return [S.train_schedule(name, m, p, s, chunks) for s in range(p)]


def passes(sched):
    return [c for step in sched for c in step
            if isinstance(c, (S.ForwardPass, S.BackwardPass, S.BackwardInput, S.BackwardWeight))]


@pytest.mark.parametrize("name", sorted(S.SCHEDULES))
@pytest.mark.parametrize("m,p", CASES)
def test_each_micro_batch_once_forward_and_backward_per_stage(name, m, p):
    for sched in streams(name, m, p):
        kinds = [type(c) for c in passes(sched)]
        if name == "1f1b":  # buffers are reused there (buffer id = micro-batch mod p - s): count the passes
            assert kinds.count(S.ForwardPass) == kinds.count(S.BackwardPass) == m and len(kinds) == 2 * m
        else:
            seen = {}
            for c in passes(sched):
                seen.setdefault((c.chunk, c.buffer_id), []).append(type(c))
            assert sorted(seen) == [(c, b) for c in range(sched.chunks) for b in range(m)]
            want = ([S.ForwardPass, S.BackwardInput, S.BackwardWeight] if sched.split_backward
                    else [S.ForwardPass, S.BackwardPass])
            assert all(order == want for order in seen.values()), name  # once each, in that order
        loads = sum(isinstance(c, S.LoadMicroBatch) for step in sched for c in step)
        assert loads == (m if sched.stage_id in (0, p - 1) else 0)
        assert [type(c) for c in list(sched)[-1][-3:]] == [S.ReduceTiedGrads, S.ReduceGrads, S.OptimizerStep]


@pytest.mark.parametrize("name", sorted(S.SCHEDULES))
@pytest.mark.parametrize("m,p", CASES)
def test_sends_match_receives_and_nothing_deadlocks(name, m, p):
    sim = S.simulate(streams(name, m, p))
    assert sim.sent.keys() == sim.received.keys()
    for flow, sent in sim.sent.items():
        src, dst, _, kind = flow
        assert src != dst and {src, dst} <= set(range(p)), flow
        if name == "1f1b":  # buffer ids are per stage there: the counts meet
            assert len(sent) == len(sim.received[flow]) == m
        else:  # the same micro-batch and chunk, in the same order, on both sides
            assert sent == sim.received[flow], flow


@pytest.mark.parametrize("m,p", CASES)
def test_bubbles_against_1f1b_theory(m, p):
    theory = S.bubble_fraction(m, p)
    assert S.simulate(streams("1f1b", m, p)).bubble() == pytest.approx(theory)  # the clock agrees with theory
    zb = S.simulate(streams("zb-h1", m, p))
    assert zb.bubble() < theory
    assert zb.bubble() == pytest.approx((p - 1) / (3 * m + p - 1))  # F = I = W: ZB-H1's (p-1)(F+I-W)
    for chunks in (2, 4):
        inter = S.simulate(streams("interleaved-1f1b", m, p, chunks))
        assert inter.bubble() < theory
        assert inter.bubble() == pytest.approx((p - 1) / (chunks * m + p - 1))


@pytest.mark.parametrize("m,p", CASES)
def test_zb_h1_holds_no_more_activations_than_1f1b(m, p):
    """Forwards not yet weight-backwarded: at most p on a stage, 1F1B's peak (stage 0's)."""
    peak_1f1b = max(S.TrainSchedule(m, p, s).activations_in_flight() for s in range(p))
    assert max(s.activations_in_flight() for s in streams("zb-h1", m, p)) <= peak_1f1b


def test_chunked_instructions_name_their_chunk_and_chunk_0_reads_as_deepspeeds():
    assert repr(S.ForwardPass(3)) == "ForwardPass(buffer_id=3)"
    assert repr(S.SendGrad(1, chunk=2)) == "SendGrad(buffer_id=1, chunk=2)"
    sched = S.train_schedule("interleaved-1f1b", 4, 2, 1, chunks=2)
    assert sched.link(0) == S.Link(0, 0, 2, 4, 3, 1) and sched.link(1) == S.Link(0, None, 6, 8, 7, 5)
    assert S.ChunkedInferenceSchedule(4, 2, 0, 2).order()[:3] == [S.Work("F", 0), S.Work("F", 1), S.Work("F", 0, 1)]


def test_unknown_names_and_bad_shapes_are_refused():
    with pytest.raises(ValueError, match=r"^unknown schedule 'gpipe'; valid: 1f1b, interleaved-1f1b, zb-h1$"):
        S.train_schedule("gpipe", 4, 2, 0)
    assert S.unknown_schedule("zb-h1") is None
    with pytest.raises(ValueError, match="micro-batches \\(6\\) to be a multiple of the pipeline stages \\(4\\)"):
        S.Interleaved1F1BSchedule(6, 4, 0)


def test_the_clock_finds_a_deadlock():
    class BackwardFirst(S.OrderedSchedule):  # stage 0 waits for a gradient before it sent any activation
        def order(self):
            f = [S.Work("F", b) for b in range(self.micro_batches)]
            b = [S.Work("B", b) for b in range(self.micro_batches)]
            return b + f if self.stage_id == 0 else f + b
    with pytest.raises(ValueError, match="deadlock: stage 0 waits at RecvGrad"):
        S.simulate([BackwardFirst(2, 2, s) for s in range(2)])
