"""Make tests/data/deepspeed_unit_ds_cpu_outcomes.json: what real DeepSpeed 0.19.8 answers, on
a CPU, to chosen tests of its own tests/unit tree (passed, failed with which cause, skipped), so
that scripts/run_deepspeed_tests.py can mark a failure of ours that DeepSpeed has on the CPU too
(it still counts as a failure).

    /work/ds-venv/bin/python scripts/make_ds_unit_cpu_failures.py --deepspeed-src /work/ds-src \\
        unit/v1/zero/test_zero_user_backward.py::TestZeroUserBackwardBasic ...

runs pytest (without --forked: see run_pytest) in a copy of the checkout's tests/ folder with DeepSpeed's own package (this
interpreter's), DS_ACCELERATOR=cpu, CUDA hidden and LOCAL_SIZE=2, as DeepSpeed's CPU runs do,
and merges the outcomes into the table: a test run again replaces its earlier entry, the others
stay. `--junit FILE` records an earlier run's junit report of the same invocation instead of
running. Causes are blanked as run_deepspeed_tests.py blanks its own, so the two compare.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from typing import Dict, List, Optional

import run_deepspeed_tests as run  # its sibling here: the same blanking of causes

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "tests", "data", "deepspeed_unit_ds_cpu_outcomes.json")


def outcomes_of(junit: str) -> Dict[str, Dict[str, str]]:
    """test id (junit classname::name, the id run_deepspeed_tests.py lists) -> outcome and cause."""
    out: Dict[str, Dict[str, str]] = {}
    for case in ET.parse(junit).iter("testcase"):
        if not case.get("classname"):  # a collection error: no test of DeepSpeed's own ran
            continue
        test = f"{case.get('classname')}::{case.get('name', '')}"
        failure, error, skipped = case.find("failure"), case.find("error"), case.find("skipped")
        node = failure if failure is not None else error
        if node is not None:
            out[test] = {"outcome": "failed", "cause": run.cause_of(run._message(node))}
        elif skipped is not None:
            out[test] = {"outcome": "skipped", "cause": run.cause_of(skipped.get("message") or "")}
        else:
            out[test] = {"outcome": "passed", "cause": ""}
    return out


def run_pytest(src: str, tests: List[str], workdir: str, timeout: int) -> str:
    """pytest over `tests` in a copy of the checkout's tests/ folder, as run_deepspeed_tests.py
    runs them (DeepSpeed's conftest.py puts the folder above tests/ first on sys.path: in the
    checkout that is DeepSpeed's source tree, not the installed package); the junit report's path."""
    copy = os.path.join(workdir, "tests")
    shutil.copytree(os.path.join(src, "tests"), copy, symlinks=True)
    junit = os.path.join(workdir, "ds.xml")
    env = dict(os.environ, DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="", LOCAL_SIZE="2")
    # without --forked: under the pytest DeepSpeed's environment holds, every forked test exits
    # with status 3 before its ranks report (DeepSpeed's DistributedTest starts its own processes)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", f"--junitxml={junit}", *tests]
    subprocess.run(cmd, cwd=copy, env=env, timeout=timeout)
    return junit


def merge(path: str, outcomes: Dict[str, Dict[str, str]], version: str, commit: str) -> dict:
    table = {"deepspeed": version, "commit": commit, "local_size": 2, "tests": {}}
    if os.path.exists(path):
        with open(path) as fh:
            table = json.load(fh)
        if (table.get("deepspeed"), table.get("commit")) != (version, commit):
            raise SystemExit(f"make_ds_unit_cpu_failures: {path} records DeepSpeed {table.get('deepspeed')} at "
                             f"{table.get('commit')}, not {version} at {commit}: move it aside to start over")
    table["tests"].update(outcomes)
    table["tests"] = dict(sorted(table["tests"].items()))
    return table


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--deepspeed-src", required=True, help="the DeepSpeed checkout run_deepspeed_tests.py runs")
    ap.add_argument("--junit", default=None, help="record this junit report (of the same tests) instead of running")
    ap.add_argument("--timeout", type=int, default=3 * 3600, help="seconds for the whole pytest run")
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--commit", default=None, help="the checkout's DeepSpeed commit, for a checkout without its "
                                                   "git history (as run_deepspeed_tests.py's --commit)")
    ap.add_argument("tests", nargs="*", help="pytest node ids under the checkout's tests/ folder (unit/...)")
    args = ap.parse_args(argv)
    import deepspeed  # DeepSpeed's own package: this script runs under its interpreter
    commit = args.commit or subprocess.run(["git", "-C", args.deepspeed_src, "rev-parse", "HEAD"],
                                           capture_output=True, text=True).stdout.strip() or "unknown"
    merge(args.out, {}, deepspeed.__version__, commit)  # a table of another commit refuses before the run, not after
    if args.junit:
        outcomes = outcomes_of(args.junit)
    else:
        if not args.tests:
            print("make_ds_unit_cpu_failures: name the tests to run (or --junit FILE)", file=sys.stderr)
            return 2
        with tempfile.TemporaryDirectory() as tmp:
            outcomes = outcomes_of(run_pytest(args.deepspeed_src, args.tests, tmp, args.timeout))
    table = merge(args.out, outcomes, deepspeed.__version__, commit)
    with open(args.out, "w") as fh:
        json.dump(table, fh, indent=1)
        fh.write("\n")
    failed = sum(1 for o in outcomes.values() if o["outcome"] == "failed")
    print(f"recorded {len(outcomes)} tests ({failed} failed under DeepSpeed on CPU) into {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
