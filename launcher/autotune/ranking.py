"""Every trial's outcome, the ranking, and the one-line reason each configuration lost.

The best is the trial with the best metric among those that ran to the end; every other
configuration says why it is not the best: slower by how much, failed with which
one-line error (out of memory, hung, crashed, over the time budget), pruned by the memory
model before any launch, or never tried (early stopping, trial count, budget).

One measurement per configuration does not make the fastest: on a loaded machine two
runs of one configuration differ by more than many configurations do. So the best few are
re-measured, interleaved (A B C A B C ...: load falls on all alike), and judged by judge():
by the median of their re-runs, and a difference counts only when it is measurable, that
is when every re-run of one is faster than every re-run of the other (their ranges do not
overlap). Configurations whose ranges overlap are tied within noise; among those tied with
the best median, the winner is the one predicted to need the least memory (then the
higher median). The runner-up is the best configuration measurably slower than the winner.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence

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


@dataclass
class Verdict:
    """The re-measurement's judgement (judge()); values in the metric's own units."""

    winner: str
    runner_up: Optional[str]  # the best measurably slower than the winner; None: none was
    tied: List[str]  # tied with the winner within noise, best median first
    runs: Dict[str, List[float]]  # the interleaved re-runs of every configuration judged
    medians: Dict[str, float]
    predicted: Dict[str, int] = field(default_factory=dict)
    by_memory: bool = False  # the winner is not the best median: a tie broken by predicted memory
    dropped: Dict[str, str] = field(default_factory=dict)  # left out of the judgement: why

    def order(self, metric: str) -> List[str]:
        """The winner, then the others judged by median."""
        rest = sorted((n for n in self.runs if n != self.winner), key=lambda n: -score(metric, self.medians[n]))
        return [self.winner, *rest]


def judge(runs: Mapping[str, Sequence[float]], metric: str, predicted: Mapping[str, int]) -> Verdict:
    """Rank configurations by their re-runs (at least two configurations, as many runs
    each); see the module's docstring for the rule."""
    names = list(runs)  # in tuning order: it breaks an exact tie of medians
    med = {n: statistics.median(runs[n]) for n in names}
    lo = {n: min(score(metric, v) for v in runs[n]) for n in names}
    hi = {n: max(score(metric, v) for v in runs[n]) for n in names}
    top = max(names, key=lambda n: score(metric, med[n]))
    group = [n for n in names if hi[n] >= lo[top]]  # not measurably slower than the best median
    # candidates no member of the group is measurably faster than (the best median always is)
    fair = [n for n in group if all(hi[n] >= lo[g] for g in group)]
    winner = min(fair, key=lambda n: (predicted.get(n, 0), -score(metric, med[n]), names.index(n)))
    slower = [n for n in names if hi[n] < lo[winner]]
    tied = sorted((n for n in names if n != winner and n not in slower), key=lambda n: -score(metric, med[n]))
    runner_up = max(slower, key=lambda n: score(metric, med[n])) if slower else None
    return Verdict(winner, runner_up, tied, {n: list(runs[n]) for n in names}, med,
                   {n: predicted.get(n, 0) for n in names}, winner != top)


def _pct(value: float, ref: float, metric: str) -> str:
    if metric == "latency":
        return f"{value / ref - 1:.1%} more {UNITS[metric]}"
    return f"{1 - value / ref:.1%} less {metric}"


def _range(v: Verdict, name: str) -> str:
    return f"{min(v.runs[name]):.4g}-{max(v.runs[name]):.4g}"


def why_judged(r: TrialRecord, v: Verdict, metric: str) -> str:
    w, n = v.winner, len(v.runs[v.winner])
    if r.name in v.dropped:
        return f"left out of the re-runs: {v.dropped[r.name]}"
    if r.name not in v.runs:
        if r.status != OK:
            return why(r, None, metric)
        return f"not re-measured: its one tuning run ranked below the {len(v.runs) + len(v.dropped)} re-measured"
    if r.name == w:
        best = "lowest" if metric == "latency" else "highest"
        if v.by_memory:
            return (f"best: tied within noise with the {best} median ({n} interleaved re-runs {_range(v, w)}); "
                    f"chosen for the lowest predicted memory")
        return f"best: {best} median {metric} of {n} interleaved re-runs ({_range(v, w)})"
    if r.name in v.tied:
        if v.predicted[w] < v.predicted[r.name]:
            rule = "lower predicted memory"
        elif score(metric, v.medians[w]) >= score(metric, v.medians[r.name]):
            rule = "better median"
        else:  # r overlaps w but is measurably slower than another of those tied with the best
            rule = "no re-run measurably slower than the others tied with the best"
        return f"tied with {w} within noise (re-runs {_range(v, r.name)} overlap {_range(v, w)}); {w} has the {rule}"
    lead = "runner-up: measurably slower" if r.name == v.runner_up else "slower, measurably"
    return f"{lead}: {_pct(v.medians[r.name], v.medians[w], metric)} than {w} (re-runs {_range(v, r.name)}, " \
           f"all worse than {w}'s {_range(v, w)})"


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


def summary(records: Sequence[TrialRecord], metric: str, header: Sequence[str] = (),
            verdict: Optional[Verdict] = None) -> str:
    """The table of every configuration, best first. With a verdict (the re-runs' judgement)
    the configurations it judged come first in its order, with their median re-run."""
    rows = ranked(records, metric)
    top = best(records, metric)
    unit = UNITS[metric]
    if verdict is not None:
        first = {n: i for i, n in enumerate(verdict.order(metric))}
        rows = sorted(rows, key=lambda r: first.get(r.name, len(first)))  # stable: the rest keep their order
    table = [("#", "experiment", f"{metric} ({unit})", "predicted", "measured", "why")]
    for i, r in enumerate(rows, 1):
        judged = verdict is not None and r.name in verdict.runs
        value = f"{verdict.medians[r.name]:.4g}" if judged else "-" if r.value is None else f"{r.value:.4g}"
        pred = "-" if r.predicted_bytes is None else mib(r.predicted_bytes)
        meas = "-" if r.measured_bytes is None else mib(r.measured_bytes)
        reason = why_judged(r, verdict, metric) if verdict is not None else why(r, top, metric)
        table.append((str(i) if r.status == OK else "-", r.name, value, pred, meas, reason))
    widths = [max(len(row[c]) for row in table) for c in range(5)]
    lines = list(header)
    if verdict is not None:
        w = verdict.winner
        tied = f"; tied within noise with {', '.join(verdict.tied)}" if verdict.tied else ""
        lines.append(f"best: {w} ({metric} {verdict.medians[w]:.4g} {unit}, median of {len(verdict.runs[w])} "
                     f"interleaved re-runs){tied}")
        if verdict.runner_up:
            lines.append(f"runner-up: {verdict.runner_up} ({metric} {verdict.medians[verdict.runner_up]:.4g} {unit}, "
                         f"measurably {'slower' if metric == 'throughput' else 'longer'}: every re-run worse than "
                         f"every re-run of {w})")
        else:
            lines.append(f"runner-up: none measurably slower than {w} among the re-measured")
    elif top is None:
        lines.append("no configuration ran to the end: see the reasons below")
    else:
        lines.append(f"best: {top.name} ({metric} {top.value:.4g} {unit})")
    lines.append("")
    for row in table:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row[:5], widths)) + "  " + row[5])
    return "\n".join(lines) + "\n"
