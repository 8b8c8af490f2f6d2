"""What the two generated differential tests share around their own grammar and classifier
(scripts/diff_vs_deepspeed.py against DeepSpeed 0.19.8, scripts/diff_compression.py against
0.17.6) and around the tests that replay their fixtures (tests/compat/test_diff_vs_deepspeed.py,
tests/compat/test_diff_compression.py): a refusal as a worker answers it, the versions a recording
names, the table and reasons of a run's verdicts, the docs blocks they are written into, and
which recorded cases CI replays. Pure logic (the versions aside: one subprocess)."""
from __future__ import annotations

import collections
import hashlib
import subprocess
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple


# -- a worker's answer -------------------------------------------------------------------------------
def error_answer(exc: BaseException) -> dict:
    """A refusal: its type and first line, and how many lines the message has (ours must be one)."""
    text = str(exc).strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    first = lines[0] if lines else ""
    return {"error": f"{type(exc).__name__}: {first}", "lines": max(1, len(lines))}


# -- the fixtures ------------------------------------------------------------------------------------
def recorded_versions(ds_python: str, env: Mapping[str, str]) -> Tuple[str, str]:
    """(DeepSpeed's version, torch's) under `ds_python`, as the fixtures name them ("?" where it
    printed nothing)."""
    version = subprocess.run([ds_python, "-c", "import deepspeed, torch; print(deepspeed.__version__, torch.__version__)"],
                             capture_output=True, text=True, env=dict(env))
    ds_version, torch_version = (version.stdout.split()[-2:] + ["?", "?"])[:2]  # the last line: the versions
    return ds_version, torch_version


# -- what a run found --------------------------------------------------------------------------------
def summary(cases, fixtures: Mapping[str, dict], verdicts, classes: Sequence[str]) -> str:
    """The count of each class (a markdown table), with the recorded cases this run did not
    replay and the cases without a DeepSpeed record, where there are any."""
    counts = collections.Counter(v.kind for v in verdicts.values())
    missing = [c for c in cases if c.line not in fixtures]
    lines = ["| class | cases |", "|---|---|"]
    lines += [f"| {k} | {counts.get(k, 0)} |" for k in classes]
    lines.append(f"| total | {len(verdicts)} |")
    unrun = [c for c in cases if c.line in fixtures and c.line not in verdicts]
    if unrun:
        lines.append(f"| recorded under DeepSpeed, not replayed in this run | {len(unrun)} |")
    if missing:
        lines.append(f"| not recorded under DeepSpeed | {len(missing)} |")
    return "\n".join(lines)


def details(verdicts, kinds: Iterable[str], cut: Optional[str] = None) -> str:
    """Per class, each distinct reason with its count; `cut`: a reason up to this text (a
    listed reason without what each case measured)."""
    out = []
    for kind in kinds:
        by_reason = collections.Counter(v.detail.split(cut)[0] if cut else v.detail
                                        for v in verdicts.values() if v.kind == kind)
        if by_reason:
            out.append(f"\n{kind}:")
            out += [f"  {n:4d}  {reason}" for reason, n in by_reason.most_common()]
    return "\n".join(out)


def print_report(cases, fixtures: Mapping[str, dict], verdicts, classes: Sequence[str], elapsed: float) -> str:
    """Print the table, the reasons of every class but "equal" and the run's size; returns the table."""
    table = summary(cases, fixtures, verdicts, classes)
    print(table)
    print(details(verdicts, [k for k in classes if k != "equal"]))
    print(f"\n{len(verdicts)} cases in {elapsed:.0f} s")
    return table


def divergences(verdicts) -> List[str]:
    """`line: detail` of every unlisted divergence."""
    return [f"{line}: {v.detail}" for line, v in verdicts.items() if v.kind == "divergence"]


def healed(verdicts, listed: Iterable[str], kind: str = "open divergence (listed)") -> List[str]:
    """The listed case lines that ran and are no longer classified `kind` (the list is stale)."""
    listed = set(listed)
    return [line for line, v in verdicts.items() if line in listed and v.kind != kind]


# -- docs ---------------------------------------------------------------------------------------------
def replace_block(text: str, name: str, block: str) -> str:
    """`text` with what stands between <!-- name:begin --> and <!-- name:end --> replaced by `block`."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{block}\n{end}{tail}"


def write_blocks(path: str, blocks: Dict[str, str]) -> None:
    """Replace each named block of the file at `path` (in the order given)."""
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    for name, block in blocks.items():
        text = replace_block(text, name, block)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)


def summary_block(table: str, reasons: str) -> str:
    """A run's table and reasons as the docs show them."""
    return f"{table}\n\n```text\n{reasons}\n```"


# -- what a replay runs --------------------------------------------------------------------------------
def replayed(cases: list, fixtures: Mapping[str, dict], keep: Iterable[str], drawn: int, every: bool) -> list:
    """The cases with a DeepSpeed record that a replay runs: all of them where `every`;
    otherwise those whose line is in `keep`, then `drawn` of the others, picked by a hash of
    their line (a new case does not reshuffle the others)."""
    cases = [c for c in cases if c.line in fixtures]
    if every:
        return cases
    keep = set(keep)
    others = sorted((c for c in cases if c.line not in keep),
                    key=lambda c: hashlib.sha256(c.line.encode()).hexdigest())[:drawn]
    return [c for c in cases if c.line in keep] + others
