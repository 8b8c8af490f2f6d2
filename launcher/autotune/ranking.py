"""Every trial's outcome, the ranking, and the one-line reason each configuration lost.

The best is the trial with the best metric among those that ran to the end; every other
configuration says why it is not the best: slower by how much, failed with which
one-line error (out of memory, hung, crashed, over the time budget), pruned by the memory
model before any launch, or never tried (early stopping, trial count, budget).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

from dslaunch.launcher.autotune.memory import mib
from dslaunch.launcher.autotune.space import Candidate

OK = "ok"
FAILED = ("crashed", "out of memory", "hung", "timed out")
PRUNED = "pruned"
NOT_TRIED = "not tried"
UNITS = {"throughput": "samples/s", "latency": "s/step"}


@dataclass
class TrialRecord:
    candidate: Candidate
    status: str  # OK, one of FAILED, PRUNED or NOT_TRIED
    value: Optional[float] = None  # the metric, when status is OK
    predicted_bytes: Optional[int] = None
    measured_bytes: Optional[int] = None
    reason: str = ""  # one line: the error, or why it was pruned or not tried
    seconds: Optional[float] = None

    @property
    def name(self) -> str:
        return self.candidate.name


def score(metric: str, value: Optional[float]) -> Optional[float]:
    """Higher is better whatever the metric."""
    if value is None:
        return None
    return -value if metric == "latency" else value


def ranked(records: Sequence[TrialRecord], metric: str) -> List[TrialRecord]:
    """Trials that ran, best first; then failures, pruned and untried, in trial order."""
    ran = sorted((r for r in records if r.status == OK), key=lambda r: -score(metric, r.value))
    order = {s: i for i, s in enumerate(FAILED + (PRUNED, NOT_TRIED))}
    rest = sorted((r for r in records if r.status != OK), key=lambda r: order[r.status])
    return ran + rest


def best(records: Sequence[TrialRecord], metric: str) -> Optional[TrialRecord]:
    ran = ranked(records, metric)
    return ran[0] if ran and ran[0].status == OK else None


def why(r: TrialRecord, top: Optional[TrialRecord], metric: str) -> str:
    unit = UNITS[metric]
    if r.status == OK:
        if r is top:
            return f"best: {'lowest' if metric == 'latency' else 'highest'} {metric} of the trials that ran"
        if metric == "latency":
            return f"slower: {r.value / top.value - 1:.1%} more {unit} than {top.name}"
        return f"slower: {1 - r.value / top.value:.1%} less {metric} than {top.name}"
    if r.status == PRUNED:
        return f"pruned, not launched: {r.reason}"
    return f"{r.status}: {r.reason}"


def summary(records: Sequence[TrialRecord], metric: str, header: Sequence[str] = ()) -> str:
    rows = ranked(records, metric)
    top = best(records, metric)
    unit = UNITS[metric]
    table = [("#", "experiment", f"{metric} ({unit})", "predicted", "measured", "why")]
    for i, r in enumerate(rows, 1):
        value = "-" if r.value is None else f"{r.value:.4g}"
        pred = "-" if r.predicted_bytes is None else mib(r.predicted_bytes)
        meas = "-" if r.measured_bytes is None else mib(r.measured_bytes)
        table.append((str(i) if r.status == OK else "-", r.name, value, pred, meas, why(r, top, metric)))
    widths = [max(len(row[c]) for row in table) for c in range(5)]
    lines = list(header)
    if top is None:
        lines.append("no configuration ran to the end: see the reasons below")
    else:
        lines.append(f"best: {top.name} ({metric} {top.value:.4g} {unit})")
    lines.append("")
    for row in table:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row[:5], widths)) + "  " + row[5])
    return "\n".join(lines) + "\n"
