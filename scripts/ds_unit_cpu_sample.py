"""Real DeepSpeed 0.19.8 on a uniform random sample of its own tests/unit tree, on this CPU
machine, beside dslaunch on the same tests: how much of the tree DeepSpeed itself passes here,
so the whole-tree figure of docs/deepspeed-unit-tests.md has its reference.

Three steps, each adding to tests/data/deepspeed_unit_ds_cpu_sample.json:

    # 1. DeepSpeed's side, under DeepSpeed's own interpreter (its venv):
    /work/ds-venv/bin/python scripts/ds_unit_cpu_sample.py run-deepspeed --deepspeed-src DIR \\
        --sample 150 --seed 20261130 [--local-size 4] [--junit FILE]
    # 2. dslaunch's side, the same test ids through run_deepspeed_tests.py, then its report folded in:
    .venv/bin/python scripts/ds_unit_cpu_sample.py ids --deepspeed-src DIR > ids.txt
    .venv/bin/python scripts/run_deepspeed_tests.py --deepspeed-src DIR --ids ids.txt \\
        --workers 1 --workdir W --json W/run.json
    .venv/bin/python scripts/ds_unit_cpu_sample.py add-dslaunch --junit W/unit.xml --run-json W/run.json
    # 3. the comparison (also rendered into docs/deepspeed-unit-tests.md by run_deepspeed_tests.py):
    .venv/bin/python scripts/ds_unit_cpu_sample.py report

DeepSpeed's interpreter needs what run_deepspeed_tests.py gives dslaunch's side (TEST_DEPS:
pytest<8.4, whose fixtures DeepSpeed's DistributedFixture needs; mup, installed with --no-deps,
as its own dependencies pull a CUDA torch) and the pinned transformers and accelerate, or
DeepSpeed fails tests for want of a package rather than of a feature.

Step 1 copies the checkout's tests/ folder, collects it with DeepSpeed's package the way its CPU
CI selects tests (pytest.ini's markers), draws the sample from the test ids that collect, and
runs them with DS_ACCELERATOR=cpu, CUDA hidden and LOCAL_SIZE as run_deepspeed_tests.py sets it
(without --forked: see make_ds_unit_cpu_failures.run_pytest). Files that fail to import under
DeepSpeed are recorded with their cause; the whole-tree estimate counts each of their tests as a
failure, as the page counts ours, their test counts read from the reference collection.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional, Tuple

import make_ds_unit_cpu_failures as ds_cpu  # siblings here
import run_deepspeed_tests as run

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "tests", "data", "deepspeed_unit_ds_cpu_sample.json")
_NODE = re.compile(r"^(\s*)<(Dir|Package|Module|Class|Function|UnitTestCase|TestCaseFunction) (.+)>$")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def parse_collection(text: str) -> Tuple[List[str], Dict[str, str]]:
    """pytest --collect-only's tree (what DeepSpeed's pytest.ini verbosity prints) -> the test
    ids that collect (unit/..py::Class::test) and the files that failed to import -> cause."""
    ids: List[str] = []
    stack: List[Tuple[str, str]] = []
    errors: Dict[str, str] = {}
    current_error: Optional[str] = None
    for raw in text.splitlines():
        line = _ANSI.sub("", raw)
        m = _NODE.match(line)
        if m:
            depth = len(m.group(1)) // 2
            stack = stack[:depth] + [(m.group(2), m.group(3))]
            if m.group(2) in ("Function", "TestCaseFunction"):
                path = "/".join(n for k, n in stack if k in ("Dir", "Package", "Module")).split("/", 1)[-1]
                names = [n for k, n in stack if k not in ("Dir", "Package", "Module")]
                ids.append("::".join([path] + names))
            continue
        e = re.search(r"ERROR collecting (\S+\.py)", line)
        if e:
            current_error = e.group(1)
            errors[current_error] = ""
        elif current_error and line.startswith("E   ") and not errors[current_error]:
            errors[current_error] = run.cause_of(line[4:])
    return ids, errors


def _env(local_size: int) -> Dict[str, str]:
    return dict(os.environ, DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="", LOCAL_SIZE=str(local_size),
                HF_HUB_OFFLINE="1")


def run_deepspeed(src: str, n: int, seed: int, local_size: int, junit: Optional[str], timeout: int) -> dict:
    import deepspeed  # DeepSpeed's own package: this step runs under its interpreter

    with tempfile.TemporaryDirectory() as tmp:
        copy = os.path.join(tmp, "tests")
        shutil.copytree(os.path.join(src, "tests"), copy, symlinks=True)
        collected = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only",
                                    "-q", "unit/"], cwd=copy, env=_env(local_size), capture_output=True, text=True,
                                   timeout=1800)
        ids, errors = parse_collection(collected.stdout)
        if not ids:
            raise SystemExit(f"ds_unit_cpu_sample: DeepSpeed's collection found no test:\n{collected.stdout[-2000:]}")
        sample = sorted(random.Random(seed).sample(ids, min(n, len(ids))))
        if junit is None:
            junit = os.path.join(tmp, "ds.xml")
            subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", f"--junitxml={junit}",
                            *sample], cwd=copy, env=_env(local_size), timeout=timeout)
        outcomes = ds_cpu.outcomes_of(junit)
    commit = subprocess.run(["git", "-C", src, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    tests = {}
    for test_id in sample:
        key = _dotted(test_id)
        tests[key] = {"deepspeed": outcomes.get(key, {"outcome": "failed", "cause": "not reported by pytest"})}
    return {"deepspeed": deepspeed.__version__, "commit": commit or "unknown", "local_size": local_size,
            "seed": seed, "collected": len(ids), "import_errors": errors, "tests": tests}


def _dotted(test_id: str) -> str:
    """unit/a/test_b.py::C::test[x] -> unit.a.test_b.C::test[x], junit's classname::name."""
    path, *names = test_id.split("::")
    dotted = path[:-3].replace("/", ".")
    return ".".join([dotted] + names[:-1]) + "::" + names[-1]


def _path_id(dotted: str, files: List[str]) -> str:
    """The inverse of _dotted, given the tree's files (a class name cannot be told from a module's)."""
    head, name = dotted.split("::")
    for f in files:
        mod = f[:-3].replace("/", ".")
        if head == mod or head.startswith(mod + "."):
            rest = head[len(mod) + 1:]
            return "::".join([f] + ([rest] if rest else []) + [name])
    raise KeyError(dotted)


def load(path: str = OUT) -> Optional[dict]:
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        return json.load(fh)


def save(table: dict, path: str = OUT) -> None:
    with open(path, "w") as fh:
        json.dump(table, fh, indent=1, sort_keys=True)
        fh.write("\n")


def sample_ids(table: dict, files: List[str]) -> List[str]:
    """The sample's ids as run_deepspeed_tests.py --ids takes them (relative to unit/)."""
    return [_path_id(t, files).split("/", 1)[1] for t in sorted(table["tests"])]


def _tree_files(src: str) -> List[str]:
    """DeepSpeed's test files as unit/... paths, the longest first (so the longest module name
    matches an id first)."""
    found = ["unit/" + rel for rel in run.test_files(os.path.join(src, "tests", "unit"))]
    return sorted(found, key=len, reverse=True)


def add_dslaunch(table: dict, junit: str, run_json: Optional[str] = None) -> int:
    """dslaunch's outcome for each sampled test, from run_deepspeed_tests.py --ids's junit report;
    a test its report lacks fails, with its file's import error where the run's --json records
    one (pytest is not handed ids in such files). Returns how many the report lacked."""
    outcomes = ds_cpu.outcomes_of(junit)
    import_errors: Dict[str, str] = {}
    if run_json:
        with open(run_json) as fh:
            for r in json.load(fh)["results"]:
                if r["collection_errors"]:
                    import_errors["unit/" + r["path"]] = next(iter(r["causes"]), "the file fails to import")
    files = sorted(import_errors, key=len, reverse=True)
    missing = 0
    for key, entry in table["tests"].items():
        if key in outcomes:
            entry["dslaunch"] = outcomes[key]
            continue
        missing += 1
        try:
            cause = import_errors[_path_id(key, files).split("::")[0]]
        except KeyError:
            cause = "not reported by pytest"
        entry["dslaunch"] = {"outcome": "failed", "cause": cause}
    return missing


def _counts(table: dict, side: str) -> Dict[str, int]:
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for entry in table["tests"].values():
        if side in entry:
            counts[entry[side]["outcome"]] += 1
    return counts


def deepspeed_estimate(table: dict, reference_counts: Dict[str, int]) -> Tuple[float, float, float, int]:
    """DeepSpeed's whole-tree share passed of the tests that run, counted as the page counts ours:
    each test of a file that fails to import is a failure (its count from the reference
    collection), each sampled test stands for its share of the tests that collect. Returns the
    estimate, its 95% interval and the tests in files that fail to import."""
    errors = sum(reference_counts.get(f.split("/", 1)[-1], 0) for f in table["import_errors"])
    c = _counts(table, "deepspeed")
    n = sum(c.values())
    total = run.FileResult(path="total", collected=table["collected"] + errors, passed=c["passed"],
                           failed=c["failed"] + errors, skipped=c["skipped"], collection_errors=errors,
                           not_run=table["collected"] - n)
    est, lo, hi = run.estimate(total)
    return est, lo, hi, errors


def report(table: dict, reference_counts: Dict[str, int]) -> List[str]:
    """Markdown lines: DeepSpeed's estimate, both sides on the same sampled tests, and where they differ."""
    est, lo, hi, errors = deepspeed_estimate(table, reference_counts)
    ds, ours = _counts(table, "deepspeed"), _counts(table, "dslaunch")
    n = len(table["tests"])
    lines = [f"Real DeepSpeed {table['deepspeed']} (its own package, DS_ACCELERATOR=cpu, LOCAL_SIZE="
             f"{table['local_size']}) on a uniform random sample of {n} of the {table['collected']} tests of the "
             f"tree that collect under it (`scripts/ds_unit_cpu_sample.py`, seed {table['seed']}), on the same "
             f"machine: {ds['passed']} passed, {ds['failed']} failed, {ds['skipped']} skipped. "
             f"{len(table['import_errors'])} files fail to import under it ({errors} tests, each counted as a "
             f"failure as ours are). **Counted the way the headline counts dslaunch, DeepSpeed itself passes an "
             f"estimated {100 * est:.1f}% of the tree here (95% interval {100 * lo:.1f}-{100 * hi:.1f}%).**", ""]
    if not any("dslaunch" in e for e in table["tests"].values()):
        return lines
    both = {"passed": {}, "failed": {}, "skipped": {}}
    for key, entry in table["tests"].items():
        both[entry["deepspeed"]["outcome"]].setdefault(entry["dslaunch"]["outcome"], []).append(key)
    lines += [f"dslaunch on the same {n} tests: {ours['passed']} passed, {ours['failed']} failed, "
              f"{ours['skipped']} skipped.", "",
              "| DeepSpeed \\ dslaunch | passed | failed | skipped |", "|---|---|---|---|"]
    for d in ("passed", "failed", "skipped"):
        lines.append(f"| {d} | " + " | ".join(str(len(both[d].get(o, []))) for o in ("passed", "failed", "skipped"))
                     + " |")
    gaps = sorted(both["passed"].get("failed", []))
    if gaps:
        lines += ["", "Passed by DeepSpeed, failed here:", "", "| test | dslaunch's failure |", "|---|---|"]
        lines += [f"| `{t}` | {table['tests'][t]['dslaunch']['cause'][:200]} |" for t in gaps]
    ahead = sorted(both["failed"].get("passed", []))
    if ahead:
        lines += ["", "Failed by DeepSpeed, passed here:", "", "| test | DeepSpeed's failure |", "|---|---|"]
        lines += [f"| `{t}` | {table['tests'][t]['deepspeed']['cause'][:200]} |" for t in ahead]
    return lines + [""]


def _reference_counts() -> Dict[str, int]:
    with open(run.COLLECTION_FILE) as fh:
        return json.load(fh)["files"]


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="step", required=True)
    r = sub.add_parser("run-deepspeed", help="collect, draw the sample and run it under DeepSpeed's own package")
    r.add_argument("--deepspeed-src", required=True)
    r.add_argument("--sample", type=int, required=True)
    r.add_argument("--seed", type=int, required=True)
    r.add_argument("--local-size", type=int, default=4)
    r.add_argument("--junit", default=None, help="record this junit report of the same sample instead of running")
    r.add_argument("--timeout", type=int, default=3 * 3600)
    i = sub.add_parser("ids", help="print the sample's ids for run_deepspeed_tests.py --ids")
    i.add_argument("--deepspeed-src", required=True)
    a = sub.add_parser("add-dslaunch", help="fold run_deepspeed_tests.py's junit report of the sample in")
    a.add_argument("--junit", required=True)
    a.add_argument("--run-json", default=None, help="the same run's --json: the files that fail to import")
    sub.add_parser("report", help="print the comparison")
    for p in (r, i, a):
        p.add_argument("--out", default=OUT)
    args = ap.parse_args(argv)
    if args.step == "run-deepspeed":
        table = run_deepspeed(args.deepspeed_src, args.sample, args.seed, args.local_size, args.junit, args.timeout)
        save(table, args.out)
        print("\n".join(report(table, _reference_counts())))
        return 0
    table = load(getattr(args, "out", OUT))
    if table is None:
        print("ds_unit_cpu_sample: no sample recorded yet: run the run-deepspeed step first", file=sys.stderr)
        return 2
    if args.step == "ids":
        print("\n".join(sample_ids(table, _tree_files(args.deepspeed_src))))
    elif args.step == "add-dslaunch":
        missing = add_dslaunch(table, args.junit, args.run_json)
        save(table, args.out)
        print(f"folded dslaunch's outcomes in ({missing} sampled tests not in the report, counted as failures)")
    else:
        print("\n".join(report(table, _reference_counts())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
