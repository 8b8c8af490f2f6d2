"""The timing and port helpers every benchmark script shares (no torch: the launcher's
benchmarks use it too).

    times = repeat(fn, runs=30, warmup=3)                  # seconds of each timed call of fn()
    walls = interleave({"ours": f, "theirs": g}, rounds=5)  # taking turns, so load falls on all alike
    median(times), median_ms(times), paired(a, b)          # the figures the docs quote
    port = free_port()                                     # for MASTER_PORT

A figure is the median of repeated runs, never one run or the mean: the machines these run on
are shared, and a median ignores the few runs another process slowed down. Runs being
compared take turns (interleave) rather than running one after the other, for the same reason.
"""
from __future__ import annotations

import socket
import statistics
import time
from typing import Callable, Dict, Iterable, List


def free_port() -> int:
    """A TCP port free on every address (as torch's TCPStore listens), for MASTER_PORT."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def clock(fn: Callable[[], object]) -> float:
    """Seconds one call of fn takes (wall clock)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def repeat(fn: Callable[[], object], runs: int, warmup: int = 0) -> List[float]:
    """The seconds of each of `runs` calls of fn, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    return [clock(fn) for _ in range(runs)]


def interleave(fns: Dict[str, Callable[[], object]], rounds: int, warmup: int = 0) -> Dict[str, List[float]]:
    """{name: seconds of each round}: every round calls each fn once, in turn."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: Dict[str, List[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(clock(fn))
    return times


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def median_ms(seconds: Iterable[float]) -> float:
    return median(seconds) * 1e3


def paired(numerator: Iterable[float], denominator: Iterable[float]) -> float:
    """The median over rounds of numerator / denominator, each pair timed in the same round."""
    return median(a / b for a, b in zip(numerator, denominator))
