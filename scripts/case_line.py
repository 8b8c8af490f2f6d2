"""The one-line form of a generated case, shared by the differential tests' grammars
(scripts/diff_cases.py, scripts/diff_compression_cases.py). Pure logic.

A case is a frozen dataclass of plain fields (str, int, float, bool). Its line names the
model and every other field that differs from its default, `key=value` separated by spaces
(booleans as 1/0); that line is the case's name in the fixtures, and `parse` reads it back,
so a case nobody drew is one more line of the grammar's EXTRA_CASES.
"""
from __future__ import annotations

from dataclasses import fields
import random
from typing import Callable, Dict, List, Sequence


class CaseLine:
    """Mixed into a case dataclass: `line`, `parse`. The dataclass's own `problem()` says why
    its fields cannot describe a run (None: they can); `parse` refuses such a line with it."""

    @property
    def line(self) -> str:
        parts = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "model" or value != f.default:
                parts.append(f"{f.name}={fmt(value)}")
        return " ".join(parts)

    @classmethod
    def parse(cls, line: str):
        kinds = {f.name: f.type for f in fields(cls)}
        values = {}
        for part in line.split():
            key, sep, raw = part.partition("=")
            if not sep or key not in kinds:
                raise ValueError(f"case {line!r}: {part!r} is not key=value with a key of {sorted(kinds)}")
            values[key] = read(kinds[key], raw)
        case = cls(**values)
        problem = case.problem()
        if problem:
            raise ValueError(f"case {line!r}: {problem}")
        return case


def fmt(value) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def read(kind, raw: str):
    """`raw` as the field's type (a name under `from __future__ import annotations`)."""
    kind = kind if isinstance(kind, str) else kind.__name__
    if kind == "bool":
        return raw in ("1", "true", "True")
    if kind == "int":
        return int(raw)
    if kind == "float":
        return float(raw)
    return raw


def draw_distinct(draw: Callable[[random.Random], CaseLine], case_type, extra: Sequence[str], seed: int,
                  count: int) -> List:
    """`count` distinct cases drawn from `seed`, then the `extra` lines (duplicates dropped)."""
    rng = random.Random(seed)
    seen: Dict[str, CaseLine] = {}
    while len(seen) < count:
        case = draw(rng)
        seen.setdefault(case.line, case)
    for line in extra:
        case = case_type.parse(line)
        seen.setdefault(case.line, case)
    return list(seen.values())
