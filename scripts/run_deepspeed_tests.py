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
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# Packages DeepSpeed's tests import themselves (DeepSpeed's own requirements), installed into
# the temporary target beside the compatibility package, without their dependencies.
TEST_DEPS = ["hjson", "py-cpuinfo"]

# The files for features dslaunch has (issue #23 §4), under tests/unit/.
DEFAULT_FILES = [
    "runtime/test_ds_config_dict.py", "runtime/test_ds_config_model.py", "runtime/test_lr_schedulers.py",
    "runtime/half_precision/", "runtime/zero/test_zero.py", "runtime/zero/test_zero_tensor_fragment.py",
    "checkpoint/", "runtime/pipe/", "launcher/", "ops/adam/test_cpu_adam.py", "ops/lion/", "ops/adagrad/",
    "monitor/", "profiling/", "comm/", "utils/", "elasticity/", "moe/", "sequence_parallelism/",
    "model_parallelism/",
]


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
    cmd = [python, "-m", "pytest", target, "-p", "no:cacheprovider", "-q", "--junitxml", junit,
           "-o", "junit_family=xunit2", "--timeout=600"]
    try:
        subprocess.run(cmd, cwd=tests_dir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       timeout=timeout)
    except subprocess.TimeoutExpired:
        result.timed_out = True
    if os.path.exists(junit):
        parse_junit(junit, result)
    elif not result.timed_out:
        result.causes["pytest wrote no report"] = 1
    return result


def render(results: List[FileResult], commit: str, python: str) -> str:
    total = FileResult("total")
    for r in results:
        for f in ("collected", "passed", "failed", "skipped", "collection_errors"):
            setattr(total, f, getattr(total, f) + getattr(r, f))
    ran = total.passed + total.failed
    lines = [
        "# DeepSpeed's unit tests against the compatibility package",
        "",
        f"DeepSpeed commit `{commit}`, run by `scripts/run_deepspeed_tests.py` on CPU "
        f"(Python {sys.version.split()[0]}). Passed is counted over the tests that ran (passed + failed); "
        "skipped tests are DeepSpeed's own skips (GPU-only kernels and the like).",
        "",
        f"**{total.passed} of {ran} passed ({100.0 * total.passed / ran:.0f}%)**, {total.skipped} skipped, "
        f"{total.collection_errors} collection errors." if ran else "Nothing ran.",
        "",
        "| file | collected | passed | failed | skipped |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        note = " (timed out)" if r.timed_out else ""
        lines.append(f"| `{r.path}`{note} | {r.collected} | {r.passed} | {r.failed} | {r.skipped} |")
    causes: Dict[str, int] = collections.Counter()
    for r in results:
        causes.update(r.causes)
    lines += ["", "## Failures by cause", "", "| tests | cause |", "|---|---|"]
    for cause, n in causes.most_common():
        lines.append(f"| {n} | {cause.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--deepspeed-src", required=True, help="a DeepSpeed checkout (its tests/unit is used)")
    ap.add_argument("--files", nargs="*", default=DEFAULT_FILES, help="paths under tests/unit/")
    ap.add_argument("--out", default=None, help="write the markdown table here (default: print it)")
    ap.add_argument("--json", default=None, help="also write the results as JSON here")
    ap.add_argument("--commit", default=None, help="the checkout's commit, where it is not a git work tree")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per path")
    args = ap.parse_args(argv)
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
            r = run_one(sys.executable, tests_dir, rel, env, args.timeout, tmp)
            print(f"{rel}: collected {r.collected}, passed {r.passed}, failed {r.failed}, skipped {r.skipped}"
                  + (" (timed out)" if r.timed_out else ""), flush=True)
            results.append(r)
    text = render(results, commit, sys.executable)
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
