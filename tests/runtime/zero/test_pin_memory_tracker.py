"""deepspeed.utils.pin_memory_tracker: the running total of pinned host memory, its log
format and its doubling thresholds, against numbers DeepSpeed 0.19.8's module gives."""
import logging

import torch

from dslaunch.runtime.utils import pin_memory_tracker as pmt

GIB = 2 ** 30


def test_format_totals_and_thresholds_match_deepspeed(caplog):
    # DeepSpeed 0.19.8's _fmt_bytes for the same counts
    assert [pmt._fmt_bytes(n) for n in (0, 512, 1023, 1024, 2048, 1536 * 1024, 2 ** 20, 3 * GIB + GIB // 2)] == [
        "0 B", "512 B", "1023 B", "1.0 KB", "2.0 KB", "1.50 MB", "1.00 MB", "3.500 GB"]
    tracker = pmt._tracker
    tracker.reset()
    seen = []
    with caplog.at_level(logging.INFO, logger="dslaunch.runtime"):
        for n in (30 * GIB, 10 * GIB, 100 * GIB):
            pmt.track_pinned_memory(n)
            seen.append(tracker._next_checkpoint // GIB)
        pmt.pinned_memory_summary("unit")
    assert seen == [32, 64, 256] and (tracker._bytes, tracker._calls) == (140 * GIB, 3)  # DeepSpeed's too
    lines = [r.getMessage() for r in caplog.records]
    # one line per threshold crossed (32 GiB by the second pin, 64 and 128 GiB by the third)
    assert [ln.split(":")[0] for ln in lines if "checkpoint" in ln] == [
        "[pinned-memory checkpoint] crossed 32.000 GB", "[pinned-memory checkpoint] crossed 64.000 GB",
        "[pinned-memory checkpoint] crossed 128.000 GB"]
    assert lines[-1] == "[pinned-memory unit] 140.000 GB pinned in 3 allocations"
    tracker.reset()
    assert (tracker._bytes, tracker._calls, tracker._next_checkpoint) == (0, 0, 32 * GIB)


def test_the_cpu_accelerator_pins_and_counts_nothing():
    from dslaunch.runtime.accelerator import get_accelerator

    accel = get_accelerator()
    if accel.device_name() != "cpu":  # CUDA pins and counts: covered where a GPU is
        pinned = accel.pin_memory(torch.zeros(256))
        assert pinned.is_pinned() and pmt._tracker._bytes >= 1024
        return
    pmt._tracker.reset()
    t = torch.zeros(256)
    assert accel.pin_memory(t) is t and pmt._tracker._calls == 0
