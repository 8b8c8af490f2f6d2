"""The flops profile as text: a summary (with the engine's step latencies when it comes
from a training step), the top modules at each depth, and the per-module tree."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

_UNITS = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K"), (1.0, ""), (1e-3, "m"), (1e-6, "u"))


def to_string(num: float, suffix: str, precision: int = 2) -> str:
    """12345678 -> '12.35 M' + suffix (DeepSpeed's number formatting)."""
    for magnitude, unit in _UNITS:
        if abs(num) >= magnitude or (num == 0 and magnitude == 1.0):
            return f"{round(num / magnitude, precision):g} {unit}{suffix}".rstrip()
    return f"{round(num / 1e-6, precision):g} u{suffix}"


@dataclass
class StepTimes:
    """What the engine measured around the profiled step (seconds; counts per rank)."""

    forward: float
    backward: float
    step: float
    batch_per_rank: int
    world: int = 1
    data_parallel: int = 1
    model_parallel: int = 1


def _pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.2f}%" if whole else "0%"


def _flops_per_s(flops: float, seconds: float) -> str:
    return to_string(flops / seconds, "FLOPS") if seconds > 0 else "n/a"


def _summary(tree, profile_step: int, times: Optional[StepTimes], recompute: float) -> List[str]:
    lines = [f"flops profile at step {profile_step} (FLOPs counted by torch.utils.flop_counter)"]
    if times is not None:
        lines.append(f"world size {times.world}, data parallel size {times.data_parallel}, model parallel size "
                     f"{times.model_parallel}, batch size per rank {times.batch_per_rank}")
    rows = [("params per rank", to_string(tree.params, "")),
            ("fwd MACs per rank", to_string(tree.macs, "MACs")),
            ("fwd FLOPs per rank", to_string(tree.flops, "FLOPs"))]
    fwd = times.forward if times is not None else tree.latency
    rows += [("fwd latency", to_string(fwd, "s")),
             ("fwd FLOP/s per rank", _flops_per_s(tree.flops, fwd))]
    if times is not None:
        factor = 2.0 + recompute
        rows += [("bwd latency", to_string(times.backward, "s")),
                 (f"bwd FLOP/s per rank ({factor:g} x fwd FLOPs / bwd latency)",
                  _flops_per_s(factor * tree.flops, times.backward)),
                 (f"fwd+bwd FLOP/s per rank ({factor + 1:g} x fwd FLOPs / fwd+bwd latency)",
                  _flops_per_s((factor + 1) * tree.flops, times.forward + times.backward)),
                 ("step latency", to_string(times.step, "s")),
                 ("iter latency", to_string(times.forward + times.backward + times.step, "s"))]
        total = times.forward + times.backward + times.step
        if total > 0:
            rows.append(("samples/s", f"{times.batch_per_rank * times.data_parallel / total:.2f}"))
    width = max(len(k) for k, _ in rows) + 2
    lines += [f"{k + ':':<{width}}{v}" for k, v in rows]
    return lines


def _by_depth(tree, max_depth: int) -> Dict[int, list]:
    out: Dict[int, list] = {}

    def walk(node):
        if max_depth >= 0 and node.depth > max_depth:
            return
        out.setdefault(node.depth, []).append(node)
        for c in node.children:
            walk(c)

    walk(tree)
    return out


def _aggregated(tree, module_depth: int, top: int) -> List[str]:
    lines = [f"top {top} modules by params, MACs and fwd latency at each depth:"]
    for depth, nodes in sorted(_by_depth(tree, module_depth).items()):
        label = lambda n: n.name or n.kind  # noqa: E731
        lines.append(f"depth {depth}:")
        for title, key, fmt in (("params", lambda n: n.params, lambda v: to_string(v, "")),
                                ("MACs", lambda n: n.macs, lambda v: to_string(v, "MACs")),
                                ("fwd latency", lambda n: n.latency, lambda v: to_string(v, "s"))):
            best = sorted(nodes, key=key, reverse=True)[:top]
            lines.append(f"    {title:<11} - " + ", ".join(f"{label(n)}: {fmt(key(n))}" for n in best))
    return lines


def _detailed(tree, module_depth: int) -> List[str]:
    lines = ["per module: params, % of params, MACs, % of MACs, fwd latency, % of latency, achieved FLOP/s"]

    def walk(node):
        if module_depth >= 0 and node.depth > module_depth:
            return
        name = f"{node.name.rsplit('.', 1)[-1]} ({node.kind})" if node.name else node.kind
        lines.append(f"{'  ' * node.depth}{name}: {to_string(node.params, '')} = {_pct(node.params, tree.params)} "
                     f"params, {to_string(node.macs, 'MACs')} = {_pct(node.macs, tree.macs)} MACs, "
                     f"{to_string(node.latency, 's')} = {_pct(node.latency, tree.latency)} latency, "
                     f"{_flops_per_s(node.flops, node.latency)}")
        for c in node.children:
            walk(c)

    walk(tree)
    return lines


def print_model_profile(prof, profile_step: int, module_depth: int, top_modules: int, detailed: bool,
                        output_file: Optional[str], step_times: Optional[StepTimes]) -> str:
    tree = prof.tree()
    rule = "-" * 30
    lines = [f"{rule} flops profiler {rule}"]
    lines += _summary(tree, profile_step, step_times, prof.recompute_fwd_factor)
    lines += ["", *_aggregated(tree, module_depth, top_modules)]
    if detailed:
        lines += ["", *_detailed(tree, module_depth)]
    lines.append("-" * (len(rule) * 2 + 16))
    text = "\n".join(lines)
    if output_file:
        with open(output_file, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    else:
        print(text, flush=True)
    return text
