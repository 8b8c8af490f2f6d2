"""Run chosen files of DeepSpeed's own unit tests against dslaunch's `deepspeed`
compatibility package, and write the table: per file collected / passed / failed / skipped,
and the failures grouped by cause.

    .venv/bin/python scripts/run_deepspeed_tests.py --deepspeed-src /path/to/DeepSpeed \\
        [--files runtime/test_ds_config_dict.py checkpoint/ ...] [--out docs/deepspeed-unit-tests.md]

DeepSpeed's tests are not on PyPI: fetch a checkout by hand (git clone
https://github.com/deepspeedai/DeepSpeed). Nothing of it is copied into this repository.

Isolation: only the checkout's tests/ folder is copied into a temporary directory (DeepSpeed's
conftest.py puts the folder above tests/ on sys.path, which must not hold DeepSpeed's own
package), the compatibility package is installed into a fresh target folder there
(`dslaunch install-deepspeed-compat --target`), and pytest runs each chosen path in its own
process with that folder first on PYTHONPATH, CUDA hidden and DeepSpeed's CPU accelerator
asked for (DS_ACCELERATOR=cpu). A real DeepSpeed in this environment would be refused by the
installer, so the package under test is always ours.

Causes: a failure's first line (exception type and message), with memory addresses, temporary
paths and numbers blanked, so one missing name counts once however many tests hit it.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# Packages DeepSpeed's tests import themselves (DeepSpeed's own requirements), installed into
# the temporary target beside the compatibility package, without their dependencies; pytest at
# the versions DeepSpeed's requirements-dev.txt pins (its DistributedFixture does not resolve
# under pytest 8.4 and later), shadowing this environment's own.
TEST_DEPS = ["hjson", "py-cpuinfo", "pytest>=7.2.0,<8.4.0"]

# The files for features dslaunch has (issue #23 §4), under tests/unit/. DeepSpeed keeps its MoE
# tests under v1/moe/ since 0.19; test_moe.py there is the one for the MoE layer dslaunch has.
DEFAULT_FILES = [
    "runtime/test_ds_config_dict.py", "runtime/test_ds_config_model.py", "runtime/test_lr_schedulers.py",
    "runtime/half_precision/", "runtime/zero/test_zero_tensor_fragment.py", "checkpoint/", "runtime/pipe/",
    "launcher/", "ops/adam/test_cpu_adam.py", "ops/lion/", "ops/adagrad/", "monitor/", "profiling/", "comm/",
    "utils/", "elasticity/", "v1/moe/test_moe.py", "sequence_parallelism/",
]
# Tests dslaunch fails on purpose (it behaves differently, and better): `<test id prefix> | reason`
# per line; listed with the reason in the table.
REASONS_FILE = os.path.join(ROOT, "tests", "data", "deepspeed_unit_test_reasons.txt")


def load_reasons(path: str) -> Dict[str, str]:
    reasons: Dict[str, str] = {}
    if not os.path.exists(path):
        return reasons
    with open(path) as fh:
        for n, line in enumerate(fh, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            test, sep, why = (part.strip() for part in line.partition("|"))
            if not sep or not test or not why:
                raise SystemExit(f"run_deepspeed_tests: {path}:{n}: expected `<test id prefix> | reason`")
            reasons[test] = why
    return reasons


@dataclass
class FileResult:
    path: str
    collected: int = 0
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    collection_errors: int = 0
    timed_out: bool = False
    causes: Dict[str, int] = field(default_factory=dict)
    failed_ids: List[str] = field(default_factory=list)


_BLANKS = [(re.compile(r"0x[0-9a-fA-F]+"), "0x…"), (re.compile(r"/tmp/[^\s'\"]+"), "/tmp/…"),
           (re.compile(r"\b\d+(\.\d+)?\b"), "N")]


def cause_of(message: str) -> str:
    line = (message or "").strip().splitlines()[0] if (message or "").strip() else "(no message)"
    for pattern, repl in _BLANKS:
        line = pattern.sub(repl, line)
    return line[:200]


def parse_junit(path: str, result: FileResult) -> None:
    tree = ET.parse(path)
    for case in tree.iter("testcase"):
        result.collected += 1
        failure = case.find("failure")
        error = case.find("error")
        skipped = case.find("skipped")
        if failure is not None or error is not None:
            node = failure if failure is not None else error
            result.failed += 1
            # a collection error has no class: its name is the module
            result.failed_ids.append(f"{case.get('classname')}::{case.get('name', '')}" if case.get("classname")
                                     else case.get("name", ""))
            if not case.get("name") or case.get("classname", "") == "":
                result.collection_errors += 1
            message = node.get("message") or ""
            if not message or message in ("collection failure", "failed on setup"):
                # pytest's own summary line; the exception is the last `E   ` line of the report
                raised = [ln[1:].strip() for ln in (node.text or "").splitlines() if ln.startswith("E ")]
                message = raised[-1] if raised else message or (node.text or "")
            cause = cause_of(message)
            result.causes[cause] = result.causes.get(cause, 0) + 1
        elif skipped is not None:
            result.skipped += 1
        else:
            result.passed += 1


def run_one(python: str, tests_dir: str, rel: str, env: Dict[str, str], timeout: int, workdir: str) -> FileResult:
    result = FileResult(rel)
    target = os.path.join(tests_dir, "unit", rel)
    if not os.path.exists(target):
        result.causes[f"not in this checkout: tests/unit/{rel}"] = 1
        return result
    junit = os.path.join(workdir, re.sub(r"[^A-Za-z0-9]+", "_", rel) + ".xml")
    # a file of a folder that fails to collect counts as one failure; the folder's others still run
    cmd = [python, "-m", "pytest", target, "-p", "no:cacheprovider", "-q", "--continue-on-collection-errors",
           "--junitxml", junit,
           "-o", "junit_family=xunit2", "--timeout=600"]
    proc = subprocess.Popen(cmd, cwd=tests_dir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        # Interrupted, pytest still writes the report of the tests that ran; tests it never
        # reached are not counted (the table marks the path as timed out).
        result.timed_out = True
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if os.path.exists(junit):
        parse_junit(junit, result)
    elif not result.timed_out:
        result.causes["pytest wrote no report"] = 1
    return result


def on_purpose(results: List[FileResult], reasons: Dict[str, str]) -> List[tuple]:
    """(test, reason) for every failed test a reasons line names (by prefix)."""
    out = []
    for r in results:
        for test in r.failed_ids:
            why = next((reasons[p] for p in sorted(reasons, key=len, reverse=True) if test.startswith(p)), None)
            if why:
                out.append((test, why))
    return out


def render(results: List[FileResult], commit: str, python: str, reasons: Optional[Dict[str, str]] = None) -> str:
    total = FileResult("total")
    for r in results:
        for f in ("collected", "passed", "failed", "skipped", "collection_errors"):
            setattr(total, f, getattr(total, f) + getattr(r, f))
    ran = total.passed + total.failed
    purposed = on_purpose(results, reasons or {})
    lines = [
        "# DeepSpeed's unit tests against the compatibility package",
        "",
        f"DeepSpeed commit `{commit}`, run by `scripts/run_deepspeed_tests.py` on CPU "
        f"(Python {sys.version.split()[0]}). Passed is counted over the tests that ran (passed + failed); "
        "skipped tests are DeepSpeed's own skips (GPU-only kernels, and on a CPU with one NUMA node every test "
        "that needs more than one rank, as in DeepSpeed's own CPU CI). A path marked timed out was interrupted: "
        "only the tests it reached are counted.",
        "",
        (f"**{total.passed} of {ran} passed ({100.0 * total.passed / ran:.0f}%)**, {total.skipped} skipped, "
         f"{total.collection_errors} collection errors; {len(purposed)} of the failures are on purpose (below)."
         if ran else "Nothing ran."),
        "",
        "Reproduce with `python scripts/run_deepspeed_tests.py --deepspeed-src DIR` (a DeepSpeed checkout, fetched "
        "by hand: DeepSpeed's tests are not on PyPI, and none is copied into this repository).",
        "",
        "| file | collected | passed | failed | skipped |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        note = (" (not reached: the budget was spent)" if r.timed_out and not r.collected
                else " (timed out)" if r.timed_out else "")
        lines.append(f"| `{r.path}`{note} | {r.collected} | {r.passed} | {r.failed} | {r.skipped} |")
    if purposed:
        lines += ["", "## Failed on purpose", "", "| test | why dslaunch differs |", "|---|---|"]
        lines += [f"| `{t}` | {why.replace('|', '/')} |" for t, why in purposed]
    causes: Dict[str, int] = collections.Counter()
    for r in results:
        causes.update(r.causes)
    lines += ["", "## Failures by cause", "", "| tests | cause |", "|---|---|"]
    for cause, n in causes.most_common():
        lines.append(f"| {n} | {cause.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--deepspeed-src", help="a DeepSpeed checkout (its tests/unit is used)")
    ap.add_argument("--render-json", nargs="+", default=None, metavar="JSON",
                    help="run nothing: write the table of earlier runs' --json files (same commit), in order; a "
                         "later file's result for a path replaces an earlier one's")
    ap.add_argument("--files", nargs="*", default=DEFAULT_FILES, help="paths under tests/unit/")
    ap.add_argument("--out", default=None, help="write the markdown table here (default: print it)")
    ap.add_argument("--json", default=None, help="also write the results as JSON here")
    ap.add_argument("--readme", default=None, help="also write the totals into this README's comparison table")
    ap.add_argument("--commit", default=None, help="the checkout's commit, where it is not a git work tree")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per path")
    ap.add_argument("--budget", type=int, default=None, help="seconds for all paths together (a path gets the "
                                                             "smaller of --timeout and what is left)")
    ap.add_argument("--reasons", default=REASONS_FILE, help="the tests failed on purpose, with the reasons")
    args = ap.parse_args(argv)
    reasons = load_reasons(args.reasons)
    deadline = time.monotonic() + args.budget if args.budget else None
    if args.render_json:
        return write_table(*from_json(args.render_json), args, reasons)
    if not args.deepspeed_src:
        print("run_deepspeed_tests: --deepspeed-src DIR (or --render-json) is required", file=sys.stderr)
        return 2
    unit = os.path.join(args.deepspeed_src, "tests", "unit")
    if not os.path.isdir(unit):
        print(f"run_deepspeed_tests: {args.deepspeed_src}: no tests/unit folder (a DeepSpeed checkout?)",
              file=sys.stderr)
        return 2
    commit = args.commit or subprocess.run(["git", "-C", args.deepspeed_src, "rev-parse", "HEAD"],
                                           capture_output=True, text=True).stdout.strip() or "unknown"
    with tempfile.TemporaryDirectory(prefix="ds-unit-") as tmp:
        tests_dir = os.path.join(tmp, "tests")
        shutil.copytree(os.path.join(args.deepspeed_src, "tests"), tests_dir, symlinks=True)
        site = os.path.join(tmp, "site")
        dslaunch = os.path.join(os.path.dirname(sys.executable), "dslaunch")
        res = subprocess.run([sys.executable, "-m", "dslaunch.launcher", "install-deepspeed-compat", "--target",
                              site] if not os.path.exists(dslaunch) else
                             [dslaunch, "install-deepspeed-compat", "--target", site],
                             capture_output=True, text=True)
        if res.returncode != 0:
            print(f"run_deepspeed_tests: installing the compatibility package failed:\n{res.stderr[-2000:]}",
                  file=sys.stderr)
            return 1
        res = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", site, *TEST_DEPS],
                             capture_output=True, text=True)
        if res.returncode != 0:
            print(f"run_deepspeed_tests: installing {TEST_DEPS} failed:\n{res.stderr[-2000:]}", file=sys.stderr)
            return 1
        env = dict(os.environ, PYTHONPATH=site, CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu",
                   OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        results = []
        for rel in args.files:
            left = args.timeout if deadline is None else min(args.timeout, int(deadline - time.monotonic()))
            if left <= 0:
                r = FileResult(rel, timed_out=True)
                r.causes["not run: the --budget was spent"] = 1
            else:
                r = run_one(sys.executable, tests_dir, rel, env, left, tmp)
            print(f"{rel}: collected {r.collected}, passed {r.passed}, failed {r.failed}, skipped {r.skipped}"
                  + (" (timed out)" if r.timed_out else ""), flush=True)
            results.append(r)
    return write_table(results, commit, args, reasons)


def from_json(paths: List[str]) -> "tuple[List[FileResult], str]":
    results: Dict[str, FileResult] = {}  # a later run of a path replaces an earlier one, in its place
    commits = set()
    for path in paths:
        with open(path) as fh:
            data = json.load(fh)
        commits.add(data["commit"])
        for r in data["results"]:
            results[r["path"]] = FileResult(**r)
    if len(commits) != 1:
        raise SystemExit(f"run_deepspeed_tests: the JSON files ran against different commits: {sorted(commits)}")
    return list(results.values()), commits.pop()


README_ROW = "| DeepSpeed's own unit tests"


def readme_row(results: List[FileResult], commit: str) -> str:
    passed, ran = sum(r.passed for r in results), sum(r.passed + r.failed for r in results)
    skipped = sum(r.skipped for r in results)
    share = f"{100.0 * passed / ran:.0f}%" if ran else "-"
    return (f"{README_ROW} ([`scripts/run_deepspeed_tests.py`](docs/deepspeed-unit-tests.md)) | "
            f"{passed} of {ran} that ran pass ({share}), {skipped} skipped as in DeepSpeed's CPU CI, over the "
            f"files for the features dslaunch has, run against the compatibility package on CPU | its `tests/unit` at "
            f"commit `{commit[:10]}` | | |")


def update_readme(path: str, row: str) -> None:
    """Replace the README's unit-test row (or add it under the API row)."""
    with open(path) as fh:
        lines = fh.read().split("\n")
    at = [i for i, line in enumerate(lines) if line.startswith(README_ROW)]
    if at:
        lines[at[0]] = row
    else:
        api = [i for i, line in enumerate(lines) if line.startswith("| DeepSpeed's API as scripts import it")]
        if not api:
            raise SystemExit(f"run_deepspeed_tests: {path}: no row to replace or to follow")
        lines.insert(api[0] + 1, row)
    with open(path, "w") as fh:
        fh.write("\n".join(lines))


def write_table(results: List[FileResult], commit: str, args, reasons: Dict[str, str]) -> int:
    if getattr(args, "readme", None):
        update_readme(args.readme, readme_row(results, commit))
    text = render(results, commit, sys.executable, reasons)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
    else:
        print(text)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"commit": commit, "results": [asdict(r) for r in results]}, fh, indent=1)
    return 0

if __name__ == "__main__":
    sys.exit(main())
