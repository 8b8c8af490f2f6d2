"""The comms logger (`comms_logger` in the config, as in DeepSpeed).

When enabled, a collective is profiled if `prof_all` is true, if its name is in `prof_ops`,
or if the call passes `prof=True`. A profiled op is made blocking (an async op is waited
for, the device synchronised) so its latency is the collective's own, exactly as DeepSpeed
does; it records op, message size, group, latency, and the algorithmic and bus bandwidth:

    algbw = size / latency
    busbw = algbw * (n-1)/n     all_gather, reduce_scatter, all_to_all
            algbw * 2(n-1)/n    all_reduce
            algbw               broadcast, reduce, send/recv, barrier, gather, scatter

(the nccl-tests convention; size is the larger of input and output, n the group size; Gbps,
as DeepSpeed prints). `verbose` prints each op as it is recorded; `debug` appends the
caller's function to the record name. `summary()` is a table per op and message size.

Each profiled op is also counted in bytes by process group and by the peer ranks it sends
to (`traffic`, traffic.py), so that a report can add them up per host pair.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from .traffic import TrafficCounter

_ALLGATHER_LIKE = ("all_gather", "reduce_scatter", "all_to_all")


def bus_factor(op: str, n: int) -> float:
    if n <= 1:
        return 1.0
    if op.startswith("all_reduce") or op.startswith("inference_all_reduce"):
        return 2.0 * (n - 1) / n
    if op.startswith(_ALLGATHER_LIKE) or op in ("allgather_fn", "reduce_scatter_fn"):
        return (n - 1) / n
    return 1.0


def bandwidths_gbps(op: str, nbytes: int, seconds: float, n: int):
    """(algbw, busbw) in Gbit/s."""
    if seconds <= 0:
        return 0.0, 0.0
    alg = nbytes * 8 / seconds / 1e9
    return alg, alg * bus_factor(op, n)


def size_text(nbytes: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1024 or unit == "GB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024
    return f"{nbytes} B"


@dataclass
class OpStats:
    count: int = 0
    latencies_ms: List[float] = field(default_factory=list)
    algbw: List[float] = field(default_factory=list)
    busbw: List[float] = field(default_factory=list)
    groups: set = field(default_factory=set)


class CommsLogger:
    def __init__(self):
        self.enabled = False
        self.verbose = False
        self.prof_all = True
        self.prof_ops: List[str] = []
        self.debug = False
        self.data: Dict[str, Dict[int, OpStats]] = {}
        self.traffic = TrafficCounter()

    def configure(self, enabled=None, verbose=None, prof_all=None, prof_ops=None, debug=None) -> None:
        if enabled is not None:
            self.enabled = bool(enabled)
        if verbose is not None:
            self.verbose = bool(verbose)
        if prof_all is not None:
            self.prof_all = bool(prof_all)
        if prof_ops is not None:
            self.prof_ops = list(prof_ops)
        if debug is not None:
            self.debug = bool(debug)

    def wants(self, name: str, prof: bool) -> bool:
        return self.enabled and (prof or self.prof_all or name in self.prof_ops)

    def record(self, name: str, raw_op: str, nbytes: int, seconds: float, group: str, n: int,
               caller: Optional[str] = None) -> None:
        key = f"{name} | [Caller Func: {caller}]" if self.debug and caller else name
        alg, bus = bandwidths_gbps(raw_op, nbytes, seconds, n)
        st = self.data.setdefault(key, {}).setdefault(int(nbytes), OpStats())
        st.count += 1
        st.latencies_ms.append(seconds * 1e3)
        st.algbw.append(alg)
        st.busbw.append(bus)
        st.groups.add(group)
        if self.verbose:
            print(f"comm op: {key} | group: {group} | time (ms): {seconds * 1e3:.2f} | msg size: "
                  f"{size_text(nbytes)} | algbw (Gbps): {alg:.2f} | busbw (Gbps): {bus:.2f}", file=sys.stderr,
                  flush=True)

    # -- switches (DeepSpeed's names) ---------------------------------------------------------
    def start_profiling_comms(self) -> None:
        self.prof_all = True

    def stop_profiling_comms(self) -> None:
        self.prof_all = False

    def start_profiling_op(self, op_name_list) -> None:
        self.prof_ops = sorted(set(self.prof_ops) | set(op_name_list))

    def stop_profiling_op(self, op_name_list) -> None:
        self.prof_ops = [op for op in self.prof_ops if op not in op_name_list]

    # -- queries (DeepSpeed's names) ----------------------------------------------------------
    def has_data(self) -> bool:
        return bool(self.data)

    def reset(self) -> None:
        self.data.clear()
        self.traffic.reset()

    def set_phase(self, name: str) -> None:
        """Tag the ops counted from now on (traffic rows are keyed by phase)."""
        self.traffic.phase = name

    reset_data = reset

    @property
    def comms_dict(self) -> Dict[str, Dict[int, list]]:
        """The records in DeepSpeed's layout, {name: {size: [count, latencies_ms, algbws, busbws]}},
        the i-th entry of each list from the i-th recorded op (the lists are the stored ones)."""
        return {name: {size: [st.count, st.latencies_ms, st.algbw, st.busbw] for size, st in sizes.items()}
                for name, sizes in self.data.items()}

    @comms_dict.setter
    def comms_dict(self, records: Dict[str, Dict[int, list]]) -> None:
        self.data = {name: {int(size): OpStats(int(count), list(lat), list(alg), list(bus))
                            for size, (count, lat, alg, bus) in sizes.items()}
                     for name, sizes in records.items()}

    def get_raw_data(self) -> Dict[str, Dict[int, list]]:
        return self.comms_dict

    def get_operation_names(self) -> List[str]:
        return list(self.data)

    def get_total_operations(self) -> int:
        return self.total_operations()

    def get_operation_summary(self, operation_name: str) -> Optional[Dict[int, Dict[str, Any]]]:
        """DeepSpeed's per-size summary of one op: averages are 10%-trimmed means (of sorted
        copies: the stored lists keep their order), as DeepSpeed's; None for an op never seen."""
        sizes = self.data.get(operation_name)
        if sizes is None:
            return None
        return {size: {"count": st.count, "total_latency_ms": sum(st.latencies_ms),
                       "avg_latency_ms": trim_mean(st.latencies_ms, 0.1), "tput_avg_gbps": trim_mean(st.algbw, 0.1),
                       "busbw_avg_gbps": trim_mean(st.busbw, 0.1), "msg_size_bytes": size,
                       "msg_size_str": size_text(size)} for size, st in sizes.items()}

    def operation_names(self) -> List[str]:
        return sorted(self.data)

    def total_operations(self) -> int:
        return sum(st.count for sizes in self.data.values() for st in sizes.values())

    def summary_dict(self) -> Dict[str, Dict[int, Dict[str, Any]]]:
        out: Dict[str, Dict[int, Dict[str, Any]]] = {}
        for name in sorted(self.data):
            for size in sorted(self.data[name]):
                st = self.data[name][size]
                total = sum(st.latencies_ms)
                out.setdefault(name, {})[size] = {
                    "count": st.count, "total_latency_ms": total, "avg_latency_ms": total / st.count,
                    "tput_avg_gbps": _mean(st.algbw), "busbw_avg_gbps": _mean(st.busbw),
                    "msg_size_bytes": size, "msg_size_str": size_text(size), "groups": sorted(st.groups)}
        return out

    def summary(self, stragglers: Optional[Dict[str, Dict[int, float]]] = None) -> str:
        cols = ["Comm. Op", "Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)", "tput_avg (Gbps)",
                "busbw_avg (Gbps)", "Groups"]
        if stragglers is not None:
            cols.insert(7, "Straggler (ms)")
        rows = []
        for name, sizes in self.summary_dict().items():
            for i, (size, s) in enumerate(sizes.items()):
                row = [name if i == 0 else "", s["msg_size_str"], str(s["count"]), f"{s['total_latency_ms']:.2f}",
                       f"{s['avg_latency_ms']:.2f}", f"{s['tput_avg_gbps']:.2f}", f"{s['busbw_avg_gbps']:.2f}",
                       "; ".join(s["groups"])]
                if stragglers is not None:
                    row.insert(7, f"{stragglers.get(name, {}).get(size, 0.0):.2f}")
                rows.append(row)
        return _table(cols, rows)


def trim_mean(data: Sequence[float], trim_fraction: float) -> float:
    """The mean of `data` without its round(n * trim_fraction) smallest and largest values
    (DeepSpeed's trim_mean); `data` itself is left as it is."""
    if not 0.0 <= trim_fraction <= 1.0:
        raise ValueError(f"trim_mean: trim_fraction must be in [0, 1], got {trim_fraction}")
    if not data:
        return 0
    ordered = sorted(data)
    k = int(round(len(ordered) * trim_fraction))
    kept = ordered[k:len(ordered) - k]
    return sum(kept) / len(kept) if kept else 0.0


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _table(cols: List[str], rows: List[List[str]]) -> str:
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(cols), line(["-" * w for w in widths])] + [line(r) for r in rows])
