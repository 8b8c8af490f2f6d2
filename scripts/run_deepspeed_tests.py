"""Run DeepSpeed's whole tests/unit tree against dslaunch's `deepspeed` compatibility package,
as DeepSpeed's CPU CI runs it, and write the table: per directory collected / passed / failed /
skipped / collection errors, the failures grouped by cause and the skips by reason.

    .venv/bin/python scripts/run_deepspeed_tests.py --deepspeed-src /path/to/DeepSpeed \\
        [--paths runtime/zero checkpoint/ ...] [--workers 4] [--out docs/deepspeed-unit-tests.md]

DeepSpeed's tests are not on PyPI: fetch a checkout by hand (git clone
https://github.com/deepspeedai/DeepSpeed). Nothing of it is copied into this repository.

How it runs (DeepSpeed's CPU CI: `cd tests; pytest --forked -n 4 unit/`, pytest.ini's default
marker selection): the checkout's tests/ folder is copied into a temporary directory
(DeepSpeed's conftest.py puts the folder above tests/ on sys.path, which must not hold
DeepSpeed's own package), the compatibility package is installed into a fresh target folder
there (`dslaunch install-deepspeed-compat --target`) with the test runner's plug-ins
(pytest-forked, pytest-xdist), and one pytest runs the chosen paths (the whole tree by default)
with that folder first on PYTHONPATH, CUDA hidden, DS_ACCELERATOR=cpu, and LOCAL_SIZE set
(--local-size, default 4): the CPU accelerator counts LOCAL_SIZE as its devices, as DeepSpeed's
does, so DeepSpeed's DistributedTest starts its 2- and 4-rank tests instead of skipping them.
Every test runs in a forked process under a per-test time limit (--test-timeout; DeepSpeed's
own DS_UNITTEST_TIMEOUT for its ranks is set 30 s shorter), so a hang is one failure. Two fixes
to DeepSpeed's harness go into the package folder (HARNESS_PATCH, a sitecustomize): a rank's
pytest.fail, or a pytest.raises that saw nothing, reaches DistributedTest as an AssertionError
with the same message, where DeepSpeed's pool worker dies of it and the test waits for the time
limit (under real DeepSpeed such tests pass); and a rank that never answers (waiting in a
collective for a rank that failed) fails its test with a TimeoutError and its pool is ended,
where DeepSpeed's harness calls pytest.exit and ends the whole run.

Counting. A file that fails to import here counts each of its tests as a failure, not one per
file: how many tests it holds is read from tests/data/deepspeed_unit_collection.json, pytest's
collection of the same checkout with DeepSpeed's own package importable
(scripts/make_ds_unit_collection.py), when the checkout's commit is the one recorded there (a
file it does not list holds no test DeepSpeed's CI selects, pytest.ini's markers deselecting them
all, so it counts none and is listed apart); at
another commit the file's test functions are counted from its syntax tree instead (each
`test_*` function or method of a `Test*` class, times the lengths of its literal
`pytest.mark.parametrize` lists), and the table says so. A file the reference collection
holds that this run never reported (under a path that ran) counts its reference tests as
failures too ("not collected here"). Passed is counted over passed + failed; skipped tests are
DeepSpeed's own skips (its CPU markers: GPU-only kernels, more ranks than LOCAL_SIZE, ...),
listed by reason.

Causes: a failure's first line (exception type and message), with memory addresses, temporary
paths and numbers blanked, so one missing name counts once however many tests hit it.

DeepSpeed's own failures: tests/data/deepspeed_unit_ds_cpu_outcomes.json records what real
DeepSpeed 0.19.8 answers on a CPU to the tests it was run on (scripts/make_ds_unit_cpu_failures.py);
a failed test of ours that DeepSpeed fails there too is listed with DeepSpeed's cause in a section
of its own and named in the headline, and still counted as a failure. A test with no recorded
answer is not marked.
"""
from __future__ import annotations

import argparse
import ast
import collections
import dataclasses
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# Packages DeepSpeed's tests and its CI's runner need (DeepSpeed's requirements-dev.txt),
# installed into the temporary target beside the compatibility package, without their
# dependencies; pytest at the versions DeepSpeed pins (its DistributedFixture does not resolve
# under pytest 8.4 and later), shadowing this environment's own.
TEST_DEPS = ["hjson", "py-cpuinfo", "pytest>=7.2.0,<8.4.0", "pytest-forked", "pytest-xdist", "execnet",
             "pytest-timeout", "mup"]

# Tests dslaunch fails on purpose (it behaves differently, and better): `<test id prefix> | reason`
# per line; listed with the reason in the table, and counted as failures.
REASONS_FILE = os.path.join(ROOT, "tests", "data", "deepspeed_unit_test_reasons.txt")
# Each file's test count under DeepSpeed's own package (scripts/make_ds_unit_collection.py).
COLLECTION_FILE = os.path.join(ROOT, "tests", "data", "deepspeed_unit_collection.json")
# What real DeepSpeed answers on a CPU to the tests it was run on (scripts/make_ds_unit_cpu_failures.py):
# a failure of ours that DeepSpeed has there too is marked so (and still counted as a failure).
DS_CPU_FILE = os.path.join(ROOT, "tests", "data", "deepspeed_unit_ds_cpu_outcomes.json")
# Every measured run's --json, kept (--keep) so docs/deepspeed-unit-tests.md can be rendered
# again on any machine: `--render-json tests/data/deepspeed_unit_runs` merges them in time order.
RUNS_DIR = os.path.join(ROOT, "tests", "data", "deepspeed_unit_runs")


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


def load_ds_cpu(path: Optional[str]) -> Dict[str, Dict[str, str]]:
    """test id -> {"outcome", "cause"} under DeepSpeed on a CPU; {} where nothing is recorded."""
    if not path or not os.path.exists(path):
        return {}
    with open(path) as fh:
        return json.load(fh)["tests"]


def deepspeed_fails_too(results: List["FileResult"], ds_cpu: Dict[str, Dict[str, str]]) -> List[tuple]:
    """(test, DeepSpeed's cause) for every failed test of ours that DeepSpeed fails on a CPU too."""
    return [(t, ds_cpu[t]["cause"]) for r in results for t in r.failed_ids
            if ds_cpu.get(t, {}).get("outcome") == "failed"]


@dataclass
class FileResult:
    """One test file's results (path relative to tests/unit/)."""
    path: str
    collected: int = 0
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    collection_errors: int = 0  # tests of this file counted as failed because it failed to import
    not_run: int = 0  # collected here, outside a --sample
    timed_out: bool = False
    # fails to import, but DeepSpeed's CI deselects every test it holds: its exception, no test counted
    deselected_import_error: str = ""
    causes: Dict[str, int] = field(default_factory=dict)
    skips: Dict[str, int] = field(default_factory=dict)
    failed_ids: List[str] = field(default_factory=list)


_BLANKS = [(re.compile(r"0x[0-9a-fA-F]+"), "0x…"), (re.compile(r"/tmp/[^\s'\"]+"), "/tmp/…"),
           (re.compile(r"\b\d+(\.\d+)?\b"), "N")]


def cause_of(message: str) -> str:
    line = (message or "").strip().splitlines()[0] if (message or "").strip() else "(no message)"
    for pattern, repl in _BLANKS:
        line = pattern.sub(repl, line)
    return line[:200]


def _file_of(case: ET.Element) -> str:
    """The test's file relative to unit/: junit's file attribute (xunit1), else its dotted
    classname up to the last `test_*` part (a collection error's name is the module)."""
    path = case.get("file") or ""
    if not path:
        dotted = case.get("classname") or case.get("name") or ""
        parts = dotted.split(".")
        last = max((i for i, p in enumerate(parts) if p.startswith("test")), default=len(parts) - 1)
        path = "/".join(parts[:last + 1]) + ".py"
    path = path.replace(os.sep, "/")
    return path[len("unit/"):] if path.startswith("unit/") else path


def _message(node: ET.Element) -> str:
    message = node.get("message") or ""
    if (not message or message in ("collection failure", "failed on setup", "failed on teardown")
            or message.startswith("multiprocessing.pool.RemoteTraceback")):
        # pytest's own summary line, or the wrapper a rank's exception arrives in from
        # DeepSpeed's DistributedTest pool: the exception is the last `E   ` line of the report
        raised = [ln[1:].strip() for ln in (node.text or "").splitlines() if ln.startswith("E ")]
        message = raised[-1] if raised else message or (node.text or "")
    return message


def import_failure(r: FileResult, cause: str, test_id: str, reference: Optional[Dict[str, int]], count_file) -> None:
    """A file that fails to import: each test it holds counts as a failure. With a reference
    collection of the same commit, a file it does not list holds no test DeepSpeed's CI selects
    (pytest.ini's markers deselect them all: inference, nightly, ...), so it counts none and is
    listed apart; without one, its tests are counted from its syntax tree (at least one)."""
    if reference is not None:
        n = reference.get(r.path, 0)
    else:
        n = (count_file(r.path) if count_file else 0) or 1
    if not n:
        r.deselected_import_error = cause
        return
    r.collected += n
    r.failed += n
    r.collection_errors += n
    r.failed_ids.append(test_id)
    r.causes[cause] = r.causes.get(cause, 0) + n


def parse_junit(path: str, results: Optional[Dict[str, FileResult]] = None,
                reference: Optional[Dict[str, int]] = None,
                count_file=None) -> Dict[str, FileResult]:
    """Fold a junit report into per-file results. A collection error (no test name, or a class
    name of "") counts the file's tests as import_failure does."""
    results = {} if results is None else results
    for case in ET.parse(path).iter("testcase"):
        rel = _file_of(case)
        r = results.setdefault(rel, FileResult(rel))
        failure, error, skipped = case.find("failure"), case.find("error"), case.find("skipped")
        is_collection = not case.get("classname")
        if is_collection and (failure is not None or error is not None):
            node = failure if failure is not None else error
            import_failure(r, cause_of(_message(node)), case.get("name", ""), reference, count_file)
            continue
        r.collected += 1
        if failure is not None or error is not None:
            node = failure if failure is not None else error
            r.failed += 1
            r.failed_ids.append(f"{case.get('classname')}::{case.get('name', '')}")
            cause = cause_of(_message(node))
            r.causes[cause] = r.causes.get(cause, 0) + 1
        elif skipped is not None:
            r.skipped += 1
            why = cause_of(re.sub(r"^[^:]*\.py:\d+: ", "", skipped.get("message") or ""))
            r.skips[why] = r.skips.get(why, 0) + 1
        else:
            r.passed += 1
    return results


# -- counting a file's tests from its syntax tree (the fallback at an unrecorded commit) ----------

def _literal_len(node: ast.AST) -> int:
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return len(node.elts)
    return 1


def _param_factor(decorators: Iterable[ast.AST]) -> int:
    factor = 1
    for dec in decorators:
        if isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute) and dec.func.attr == "parametrize":
            values = dec.args[1] if len(dec.args) > 1 else next(
                (k.value for k in dec.keywords if k.arg == "argvalues"), None)
            factor *= _literal_len(values) if values is not None else 1
    return factor


def count_tests_in_source(source: str) -> int:
    """test_* functions and Test* classes' test_* methods, each times its literal parametrizations."""
    tree = ast.parse(source)
    total = 0
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            total += _param_factor(node.decorator_list)
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            outer = _param_factor(node.decorator_list)
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name.startswith("test"):
                    total += outer * _param_factor(item.decorator_list)
    return total


def load_reference(path: str, commit: str) -> Tuple[Optional[Dict[str, int]], str]:
    """The recorded per-file counts when they were collected at `commit`, and how files are counted."""
    if os.path.exists(path):
        with open(path) as fh:
            data = json.load(fh)
        recorded = data.get("commit", "")
        if recorded and commit and (recorded.startswith(commit) or commit.startswith(recorded)):
            return data["files"], ("pytest's collection of the same commit with the checkout's own deepspeed "
                                   "package importable (tests/data/deepspeed_unit_collection.json)")
    return None, ("the file's syntax tree (test functions and methods times their literal parametrize lists), "
                  "as no collection under DeepSpeed's own package is recorded for this commit")


# -- running -----------------------------------------------------------------------------------

def pytest_command(python: str, paths: List[str], junit: str, workers: int, test_timeout: int) -> List[str]:
    """`paths` under unit/, or test ids (`unit/...::...`) as pytest names them."""
    cmd = [python, "-m", "pytest", *[p if p.startswith("unit/") else os.path.join("unit", p)
                                     if p not in (".", "") else "unit/" for p in paths],
           "-p", "no:cacheprovider", "-p", "no:randomly", "--continue-on-collection-errors", "--forked",
           "--junitxml", junit, "-o", "junit_family=xunit1", f"--timeout={test_timeout}", "-q"]
    if workers > 0:
        cmd += ["-n", str(workers)]
    return cmd


COLLECT_PLUGIN = '''
import json, os

_errors = {}

def pytest_collectreport(report):
    if report.failed:
        text = str(report.longrepr)
        raised = [ln[1:].strip() for ln in text.splitlines() if ln.startswith("E ")]
        lines = text.strip().splitlines()
        _errors[report.nodeid] = raised[-1] if raised else (lines[-1] if lines else "collection failed")

def pytest_collection_finish(session):
    with open(os.environ["DS_COLLECTION_OUT"], "w") as fh:
        json.dump({"items": [item.nodeid for item in session.items], "errors": _errors}, fh)
'''


def collect_tree(python: str, tests_dir: str, paths: List[str], env: Dict[str, str], workdir: str,
                 timeout: int) -> Tuple[List[str], Dict[str, str]]:
    """pytest's collection of `paths` here: the test ids, and each file that failed to import
    with its exception line."""
    plugin_dir = os.path.join(workdir, "plugin")
    os.makedirs(plugin_dir, exist_ok=True)
    with open(os.path.join(plugin_dir, "ds_unit_collect.py"), "w") as fh:
        fh.write(COLLECT_PLUGIN)
    out = os.path.join(workdir, "collection.json")
    cenv = dict(env, DS_COLLECTION_OUT=out, PYTHONPATH=os.pathsep.join([plugin_dir, env.get("PYTHONPATH", "")]))
    cmd = [python, "-m", "pytest", *[os.path.join("unit", p) if p not in (".", "") else "unit/" for p in paths],
           "--collect-only", "-p", "no:cacheprovider", "-p", "no:randomly", "--continue-on-collection-errors",
           "-p", "ds_unit_collect"]
    subprocess.run(cmd, cwd=tests_dir, env=cenv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   timeout=timeout)
    with open(out) as fh:
        data = json.load(fh)
    return data["items"], data["errors"]


def sample_results(items: List[str], errors: Dict[str, str], reference: Optional[Dict[str, int]],
                   count_file) -> Dict[str, FileResult]:
    """Per-file results of a collection alone: every collected test not run, every file that
    failed to import counted as failures of its reference tests."""
    results: Dict[str, FileResult] = {}
    for nodeid in items:
        rel = nodeid.split("::")[0]
        rel = rel[len("unit/"):] if rel.startswith("unit/") else rel
        r = results.setdefault(rel, FileResult(rel))
        r.collected += 1
        r.not_run += 1
    for nodeid, message in errors.items():
        rel = nodeid[len("unit/"):] if nodeid.startswith("unit/") else nodeid
        r = results.setdefault(rel, FileResult(rel))
        import_failure(r, cause_of(message), module_id(rel), reference, count_file)
    return results


def files_of(ids: List[str]) -> List[str]:
    """The files (relative to tests/unit/) of test ids given relative to tests/unit/."""
    return sorted({i.split("::")[0] for i in ids})


def choose(items: List[str], sample: Optional[int], seed: int, wanted: Optional[List[str]] = None) -> List[str]:
    """The collected tests to run: those listed in `wanted` (ids relative to tests/unit/) that
    collected, or a uniform random sample of `sample`, in random order, so that a run cut short
    by --timeout leaves a uniform sample of what it reached."""
    if wanted is not None:
        listed = {"unit/" + w for w in wanted}
        return [i for i in items if i in listed]
    return random.Random(seed).sample(items, min(sample, len(items)))


def fold_sample(results: Dict[str, FileResult], junit: str) -> None:
    """The sample's junit report into collection-only results: each reported test leaves not_run."""
    ran = parse_junit(junit)
    for rel, r in ran.items():
        base = results.setdefault(rel, FileResult(rel))
        moved = r.passed + r.failed + r.skipped
        base.not_run = max(0, base.not_run - moved)
        base.collected = max(base.collected, moved)
        for f in ("passed", "failed", "skipped"):
            setattr(base, f, getattr(base, f) + getattr(r, f))
        base.failed_ids += r.failed_ids
        for src, dst in ((r.causes, base.causes), (r.skips, base.skips)):
            for k, v in src.items():
                dst[k] = dst.get(k, 0) + v


def run_tree(python: str, tests_dir: str, paths: List[str], env: Dict[str, str], workers: int, test_timeout: int,
             timeout: int, workdir: str, log: Optional[str]) -> Tuple[Optional[str], bool]:
    """Run pytest once over `paths`; (the junit report, or None, and whether the run was cut short)."""
    junit = os.path.join(workdir, "unit.xml")
    cmd = pytest_command(python, paths, junit, workers, test_timeout)
    out = open(log, "w") if log else subprocess.DEVNULL
    # pytest and every rank it forks run in a process group of their own, ended with this run
    # however it ends (its time limit, Ctrl-C, or a SIGTERM to this script)
    previous = signal.signal(signal.SIGTERM, _terminated)
    proc = None
    try:
        proc = subprocess.Popen(cmd, cwd=tests_dir, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # Interrupted, pytest still writes the report of the tests that ran; those it never
            # reached count as not reached.
            timed_out = True
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=180)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    finally:
        signal.signal(signal.SIGTERM, previous)
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if proc is not None:
            try:  # ranks left behind by a killed pytest
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if log:
            out.close()
    return (junit if os.path.exists(junit) else None), timed_out


def _terminated(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def under(rel: str, paths: List[str]) -> bool:
    for p in paths:
        p = p.strip("/")
        if p in ("", ".") or rel == p or rel.startswith(p + "/"):
            return True
    return False


def complete(results: Dict[str, FileResult], reference: Optional[Dict[str, int]], paths: List[str],
             timed_out: bool) -> None:
    """Files of the reference collection under the run paths that reported nothing here."""
    for rel, n in (reference or {}).items():
        if rel in results or not under(rel, paths):
            continue
        r = results[rel] = FileResult(rel, collected=n, failed=n, timed_out=timed_out)
        r.causes["not reached: the run's time limit was spent" if timed_out else "not collected here"] = n
        r.failed_ids.append(module_id(rel))


def on_purpose(results: List[FileResult], reasons: Dict[str, str]) -> List[tuple]:
    """(test, reason, tests) for every failed test or failed file a reasons line names (by prefix)."""
    out = []
    for r in results:
        for test in r.failed_ids:
            why = next((reasons[p] for p in sorted(reasons, key=len, reverse=True) if test.startswith(p)), None)
            if why:
                n = r.collection_errors if "::" not in test and r.collection_errors else 1
                out.append((test, why, n))
    return out


COUNTS = ("collected", "passed", "failed", "skipped", "collection_errors", "not_run")


def module_id(rel: str) -> str:
    """A file's dotted name as junit names a module that fails to collect (unit.runtime.test_x)."""
    return "unit." + (rel[:-3] if rel.endswith(".py") else rel).replace("/", ".")


def directory_of(rel: str) -> str:
    return rel.rsplit("/", 1)[0] if "/" in rel else "."


def by_directory(results: List[FileResult]) -> List[FileResult]:
    dirs: Dict[str, FileResult] = {}
    for r in sorted(results, key=lambda r: r.path):
        d = dirs.setdefault(directory_of(r.path), FileResult(directory_of(r.path)))
        for f in COUNTS:
            setattr(d, f, getattr(d, f) + getattr(r, f))
        d.timed_out = d.timed_out or r.timed_out
    return [dirs[k] for k in sorted(dirs)]


def totals(results: List[FileResult]) -> FileResult:
    total = FileResult("total")
    for r in results:
        for f in COUNTS:
            setattr(total, f, getattr(total, f) + getattr(r, f))
    return total


def wilson(k: int, n: int, z: float = 1.96) -> Tuple[float, float]:
    """The 95% Wilson interval of a proportion k/n."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass
class Strata:
    """The tree split for the estimate: files that fail to import (exact: each test a failure),
    files every test of which ran (exact), and the other files that collect, of which a random
    sample ran and stands for all of their tests."""
    errors: int = 0
    exact_files: int = 0
    exact_passed: int = 0
    exact_failed: int = 0
    exact_skipped: int = 0
    rest_tests: int = 0  # tests of the sampled files that collect
    sampled_passed: int = 0
    sampled_failed: int = 0
    sampled_skipped: int = 0

    @property
    def sampled(self) -> int:
        return self.sampled_passed + self.sampled_failed + self.sampled_skipped


def strata(results) -> Strata:
    """`results`: the per-file results, or one whole-tree total (all of it one sampled stratum)."""
    st = Strata()
    for r in ([results] if isinstance(results, FileResult) else results):
        st.errors += r.collection_errors
        collectable = r.collected - r.collection_errors
        ran_failed = r.failed - r.collection_errors
        if collectable > 0 and not r.not_run and r.path != "total":
            st.exact_files += 1
            st.exact_passed += r.passed
            st.exact_failed += ran_failed
            st.exact_skipped += r.skipped
        elif collectable > 0:
            st.rest_tests += collectable
            st.sampled_passed += r.passed
            st.sampled_failed += ran_failed
            st.sampled_skipped += r.skipped
    return st


def estimate(results) -> Tuple[float, float, float]:
    """The whole tree's share passed of the tests that run: (estimate, low, high). Files that fail
    to import and files run in full count exactly; each sampled test stands for its share of the
    other files' tests (the interval is the sample's)."""
    st = strata(results)
    n = st.sampled

    def share(pass_fraction: float) -> float:
        skip_fraction = st.sampled_skipped / n if n else 0.0
        passed = st.exact_passed + pass_fraction * st.rest_tests
        ran = st.exact_passed + st.exact_failed + (1 - skip_fraction) * st.rest_tests + st.errors
        return passed / ran if ran else 0.0

    lo, hi = wilson(st.sampled_passed, n)
    return share(st.sampled_passed / n if n else 0.0), share(lo), share(hi)


def headline(total: FileResult, import_failed: int, results: Optional[List[FileResult]] = None) -> str:
    ran = total.passed + total.failed
    if not ran and not total.not_run:
        return "Nothing ran."
    if total.not_run:
        sampled = total.passed + total.failed - total.collection_errors + total.skipped
        if not sampled:  # --sample 0: the collection alone, which counts the import failures exactly
            return (f"**Whole tree: {total.collected} tests; {total.collection_errors} of them are in "
                    f"{import_failed} files that fail to import (each counted as a failure); none of the "
                    f"{total.collected - total.collection_errors} tests that collect ran**")
        st = strata(results if results is not None else total)
        est, lo, hi = estimate(results if results is not None else total)
        head = (f"**Whole tree: {total.collected} tests; {total.collection_errors} of them are in {import_failed} "
                f"files that fail to import (each counted as a failure). ")
        tail = (f"Estimated share of the whole tree that passes, of the tests that run: {100 * est:.1f}% (95% "
                f"interval {100 * lo:.1f}-{100 * hi:.1f}%)**")
        if not st.exact_files:
            return (head + f"A uniform random sample of {sampled} of the {total.collected - total.collection_errors} "
                    f"tests that collect ran: {total.passed} passed, {total.failed - total.collection_errors} "
                    f"failed, {total.skipped} skipped. " + tail)
        exact = st.exact_passed + st.exact_failed + st.exact_skipped
        return (head + f"All {exact} tests of {st.exact_files} files ran: {st.exact_passed} passed, "
                f"{st.exact_failed} failed, {st.exact_skipped} skipped; of the other {st.rest_tests} tests that "
                f"collect, a random sample of {st.sampled} ran: {st.sampled_passed} passed, {st.sampled_failed} "
                f"failed, {st.sampled_skipped} skipped, each standing for its share of those. " + tail)
    return (f"**{total.passed} of {ran} passed ({100.0 * total.passed / ran:.1f}%)**, {total.failed} failed "
            f"({total.collection_errors} of them in {import_failed} files that fail to import), {total.skipped} "
            "skipped")


def render(results: List[FileResult], commit: str, python: str, reasons: Optional[Dict[str, str]] = None,
           counting: str = "", settings: str = "", ds_cpu: Optional[Dict[str, Dict[str, str]]] = None,
           deepspeed_itself: Optional[tuple] = None) -> str:
    """The page. `deepspeed_itself`: real DeepSpeed's own share of the tree on the same machine
    (scripts/ds_unit_cpu_sample.py), a headline sentence and a section."""
    total = totals(results)
    ran = total.passed + total.failed
    purposed = on_purpose(results, reasons or {})
    theirs = deepspeed_fails_too(results, ds_cpu or {})
    known = sum(1 for r in results for t in r.failed_ids if t in (ds_cpu or {}))
    import_failed = sum(1 for r in results if r.collection_errors)
    lines = [
        "# DeepSpeed's unit tests against the compatibility package",
        "",
        f"DeepSpeed's `tests/unit` tree at commit `{commit}`, run by `scripts/run_deepspeed_tests.py` on CPU "
        f"(Python {sys.version.split()[0]}) the way DeepSpeed's CPU CI runs it (`pytest --forked -n 4 unit/`, "
        "pytest.ini's default marker selection)" + (f"; {settings}" if settings else "") + ". "
        "Two fixes to DeepSpeed's harness: a rank's pytest.fail (or a pytest.raises that saw nothing) reaches "
        "DistributedTest as an AssertionError with the same message, where DeepSpeed's pool worker dies of it and "
        "the test hangs until its time limit (under real DeepSpeed such tests pass); and a rank that never answers "
        "fails its test with a TimeoutError, where DeepSpeed's harness ends the whole run. "
        "Passed is counted over passed + failed. A file that fails to import counts every test it holds as a "
        f"failure (a collection error), counted by {counting or 'its reference collection'}. Skipped tests are "
        "DeepSpeed's own skips on a CPU (below, by reason). Every failure on purpose is counted as a failure "
        "and listed with its reason.",
        "",
        headline(total, import_failed, results) + (f"; {sum(n for _, _, n in purposed)} of the failures are on purpose "
                                          "(below)." if ran else "")
        + (f" {len(theirs)} of the failures fail under DeepSpeed 0.19.8 on a CPU too (below; DeepSpeed's answer "
           f"is recorded for {known} of the failed tests)." if theirs else "")
        + (f" {deepspeed_itself[0]}" if deepspeed_itself else ""),
        "",
        "Reproduce with `python scripts/run_deepspeed_tests.py --deepspeed-src DIR` for a full run of the tree "
        "(hours on a 2-core machine: about 2,000 tests that collect, most of them multi-rank), or add "
        "`--sample N --seed S` for the sampled estimate; DIR is a DeepSpeed checkout, fetched by hand (DeepSpeed's "
        "tests are not on PyPI, and none is copied into this repository). `--render-json` rebuilds this page from "
        "a run's `--json`, merging runs per file; `--keep` keeps a run's JSON in tests/data/deepspeed_unit_runs/, "
        "and `--render-json tests/data/deepspeed_unit_runs` merges every kept run in time order.",
        "",
        "| directory | collected | passed | failed | skipped | collection errors | not run (outside the sample) | "
        "passed of ran |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for d in by_directory([r for r in results if r.collected]) + [total]:
        note = " (timed out)" if d.timed_out else ""
        share = f"{100.0 * d.passed / (d.passed + d.failed):.0f}%" if d.passed + d.failed else "-"
        name = "**total**" if d is total else f"`{d.path}/`{note}"
        lines.append(f"| {name} | {d.collected} | {d.passed} | {d.failed} | {d.skipped} | "
                     f"{d.collection_errors} | {d.not_run} | {share} |")
    if deepspeed_itself:
        lines += ["", "## DeepSpeed itself on this machine", ""] + deepspeed_itself[1]
    if purposed:
        lines += ["", "## Failed on purpose", "", "| test | tests | why dslaunch differs |", "|---|---|---|"]
        lines += [f"| `{t}` | {n} | {why.replace('|', '/')} |" for t, why, n in purposed]
    if theirs:
        lines += ["", "## Failures DeepSpeed has on a CPU too", "",
                  "Real DeepSpeed 0.19.8 fails these tests on a CPU as well (its own package, DS_ACCELERATOR=cpu, "
                  "recorded by `scripts/make_ds_unit_cpu_failures.py` into "
                  "`tests/data/deepspeed_unit_ds_cpu_outcomes.json`); they still count as failures above.", "",
                  "| test | DeepSpeed's failure on a CPU |", "|---|---|"]
        lines += [f"| `{t}` | {cause.replace('|', '/')} |" for t, cause in theirs]
    causes: Dict[str, int] = collections.Counter()
    skips: Dict[str, int] = collections.Counter()
    for r in results:
        causes.update(r.causes)
        skips.update(r.skips)
    lines += ["", "## Failures by cause", "", "| tests | cause |", "|---|---|"]
    lines += [f"| {n} | {cause.replace('|', '/')} |" for cause, n in causes.most_common()]
    deselected = [r for r in results if r.deselected_import_error]
    if deselected:
        lines += ["", "## Files that fail to import, holding no test DeepSpeed's CPU CI selects", "",
                  f"{len(deselected)} files fail to import here whose tests pytest.ini's markers deselect (inference, "
                  "nightly, sequential, ...) in DeepSpeed's own collection, so they count no test.", "",
                  "| file | exception |", "|---|---|"]
        lines += [f"| `{r.path}` | {r.deselected_import_error.replace('|', '/')} |" for r in deselected]
    lines += ["", "## Skips by reason", "", "| tests | DeepSpeed's reason |", "|---|---|"]
    lines += [f"| {n} | {why.replace('|', '/')} |" for why, n in skips.most_common()]
    lines += ["", "## Per file", "", "| file | collected | passed | failed | skipped | collection errors |",
              "|---|---|---|---|---|---|"]
    for r in sorted((r for r in results if r.collected), key=lambda r: r.path):
        note = " (timed out)" if r.timed_out else ""
        lines.append(f"| `{r.path}`{note} | {r.collected} | {r.passed} | {r.failed} | {r.skipped} | "
                     f"{r.collection_errors} |")
    return "\n".join(line for line in lines) + "\n"


# DeepSpeed's DistributedTest runs each rank in a multiprocessing pool and re-raises whatever
# the test raised. pytest's outcomes (Failed, from pytest.fail or a pytest.raises that saw
# nothing) are BaseExceptions, which a pool worker does not catch: the worker dies, its result
# is lost, and the test waits for the harness's time limit, whose pytest.exit then ends the whole
# run. Under real DeepSpeed such a test passes, so its harness never meets this. Every process
# of the run (the pool's forkserver children included) imports this sitecustomize, which turns
# such an outcome into an ordinary exception with the same message after unit.common loads: the
# test fails at once with what it would have said, and the run goes on.
HARNESS_PATCH = '''"""Written by dslaunch's scripts/run_deepspeed_tests.py: a rank's pytest failure reaches
DeepSpeed's test harness as an ordinary exception (see HARNESS_PATCH there)."""
import sys


def _patch(common):
    original = common.DistributedExec._dist_run

    def _dist_run(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        except Exception:
            raise
        except BaseException as exc:
            from _pytest.outcomes import OutcomeException  # pytest's own outcome types

            if isinstance(exc, OutcomeException):
                # an AssertionError, so the pool can carry it back (pickled by its built-in type)
                raise AssertionError(f"pytest.fail in a rank: {exc.msg or exc}") from None
            raise

    common.DistributedExec._dist_run = _dist_run

    close = common.DistributedExec._close_pool

    def _close_pool(self, pool, num_procs, force=False):
        # a task still pending means a rank never answered (it waits in a collective for a rank
        # that failed, say): joining the pool would wait forever, so its workers are ended
        if getattr(pool, "_cache", None):
            pool.terminate()
            cached = getattr(self, "_pool_cache", {})
            for key in [k for k, v in cached.items() if v is pool]:
                del cached[key]
            return None
        return close(self, pool, num_procs, force)

    common.DistributedExec._close_pool = _close_pool
    common.pytest = _HarnessPytest(common.pytest)


class _HarnessPytest:
    """pytest as unit.common sees it, except that the harness's pytest.exit on a rank that never
    answers fails that test (a TimeoutError) instead of ending the whole run."""

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        return getattr(self._module, name)

    def exit(self, reason="", returncode=None):
        raise TimeoutError(f"{reason}: a rank did not finish within DS_UNITTEST_TIMEOUT (DeepSpeed's harness "
                           f"would end the whole run here)")


class _AfterUnitCommon:
    """Patches unit.common right after it is imported, in whichever process imports it."""

    def find_spec(self, name, path=None, target=None):
        if name != "unit.common":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _AfterUnitCommon())
'''


def harness_timeout(test_timeout: int) -> int:
    """DeepSpeed's own limit for its ranks (DS_UNITTEST_TIMEOUT): short of the per-test limit, so
    a test whose rank never answers fails through the harness (HARNESS_PATCH) and the run goes
    on, before pytest-timeout would stop the worker that runs it."""
    return max(test_timeout - 30, test_timeout // 2, 1)


def install_site(site: str) -> Optional[str]:
    """The compatibility package and the test plug-ins into `site`; an error message, or None."""
    dslaunch = os.path.join(os.path.dirname(sys.executable), "dslaunch")
    res = subprocess.run([dslaunch, "install-deepspeed-compat", "--target", site] if os.path.exists(dslaunch) else
                         [sys.executable, "-m", "dslaunch.launcher", "install-deepspeed-compat", "--target", site],
                         capture_output=True, text=True)
    if res.returncode != 0:
        return f"installing the compatibility package failed:\n{res.stderr[-2000:]}"
    res = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", site, *TEST_DEPS],
                         capture_output=True, text=True)
    if res.returncode != 0:
        return f"installing {TEST_DEPS} failed:\n{res.stderr[-2000:]}"
    with open(os.path.join(site, "sitecustomize.py"), "w") as fh:
        fh.write(HARNESS_PATCH)
    return None


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--deepspeed-src", help="a DeepSpeed checkout (its tests/unit is used)")
    ap.add_argument("--render-json", nargs="+", default=None, metavar="JSON",
                    help="run nothing: write the table of earlier runs' --json files (same commit), in order; a "
                         "later file's result for a test file replaces an earlier one's, unless it ran none of that "
                         "file's tests while the file imports; a folder stands for its *.json files in name order "
                         "(--keep's names sort by time)")
    ap.add_argument("--paths", nargs="*", default=["."], help="paths under tests/unit/, or test ids in them (file.py::Class::test; default: the whole tree)")
    ap.add_argument("--workers", type=int, default=4, help="pytest-xdist workers (-n; DeepSpeed's CI uses 4; 0: none)")
    ap.add_argument("--local-size", type=int, default=4, help="LOCAL_SIZE: the CPU devices the accelerator reports, "
                                                              "so the most ranks a test may start")
    ap.add_argument("--test-timeout", type=int, default=600, help="seconds per test (a hang is one failure)")
    ap.add_argument("--timeout", type=int, default=6 * 3600, help="seconds for the whole run")
    ap.add_argument("--sample", type=int, default=None, metavar="N",
                    help="collect the whole of --paths, then run a uniform random sample of N of the tests that "
                         "collect (files that fail to import still count all their tests); the table estimates the "
                         "whole tree's share from it")
    ap.add_argument("--seed", type=int, default=0, help="the --sample's random seed")
    ap.add_argument("--ids", default=None, metavar="FILE",
                    help="in place of a random sample: the test ids in FILE (one per line, relative to tests/unit/); "
                         "their files are collected and the listed tests that collect run (scripts/ds_unit_cpu_sample.py "
                         "runs DeepSpeed's sample so; an id in a file that fails to import cannot be handed to pytest)")
    ap.add_argument("--out", default=None, help="write the markdown table here (default: print it)")
    ap.add_argument("--json", default=None, help="also write the results as JSON here")
    ap.add_argument("--keep", action="store_true", help=f"also keep the results as JSON in "
                    f"{os.path.relpath(RUNS_DIR, ROOT)}/, named by the time the run ended (UTC), for --render-json")
    ap.add_argument("--log", default=None, help="write pytest's output here")
    ap.add_argument("--workdir", default=None, help="keep the tests' copy and the installed package here between "
                                                    "runs (default: a temporary folder, removed)")
    ap.add_argument("--readme", default=None, help="also write the totals into this README's comparison table")
    ap.add_argument("--commit", default=None, help="the checkout's commit, where it is not a git work tree")
    ap.add_argument("--settings", default=None, help="with --render-json: the run's settings as the table states "
                                                     "them, in place of those recorded in the JSON")
    ap.add_argument("--reasons", default=REASONS_FILE, help="the tests failed on purpose, with the reasons")
    ap.add_argument("--ds-cpu", default=DS_CPU_FILE,
                    help="DeepSpeed's own outcomes on a CPU (scripts/make_ds_unit_cpu_failures.py), to mark its failures")
    ap.add_argument("--collection", default=COLLECTION_FILE,
                    help="each file's test count under DeepSpeed's own package")
    args = ap.parse_args(argv)
    reasons = load_reasons(args.reasons)
    if args.render_json:
        results, commit, counting, settings = from_json(args.render_json)
        return write_table(results, commit, counting, args.settings or settings, args, reasons)
    if not args.deepspeed_src:
        print("run_deepspeed_tests: --deepspeed-src DIR (or --render-json) is required", file=sys.stderr)
        return 2
    unit = os.path.join(args.deepspeed_src, "tests", "unit")
    if not os.path.isdir(unit):
        print(f"run_deepspeed_tests: {args.deepspeed_src}: no tests/unit folder (a DeepSpeed checkout?)",
              file=sys.stderr)
        return 2
    for p in args.paths:
        if not os.path.exists(os.path.join(unit, p.split("::")[0])):  # a file or folder, or a test id in one
            print(f"run_deepspeed_tests: --paths {p}: not in {unit}", file=sys.stderr)
            return 2
    commit = args.commit or subprocess.run(["git", "-C", args.deepspeed_src, "rev-parse", "HEAD"],
                                           capture_output=True, text=True).stdout.strip() or "unknown"
    reference, counting = load_reference(args.collection, commit)

    def count_file(rel: str) -> int:
        try:
            with open(os.path.join(unit, rel)) as fh:
                return count_tests_in_source(fh.read())
        except (OSError, SyntaxError):
            return 1

    with tempfile.TemporaryDirectory(prefix="ds-unit-") as tmp:
        if args.workdir:  # kept between runs: the tests' copy is made once, the package reinstalled
            tmp = args.workdir
            os.makedirs(tmp, exist_ok=True)
        tests_dir = os.path.join(tmp, "tests")
        if not os.path.isdir(tests_dir):
            shutil.copytree(os.path.join(args.deepspeed_src, "tests"), tests_dir, symlinks=True)
        site = os.path.join(tmp, "site")
        shutil.rmtree(site, ignore_errors=True)
        err = install_site(site)
        if err:
            print(f"run_deepspeed_tests: {err}", file=sys.stderr)
            return 1
        # the caller's PYTHONPATH stays behind the package folder (a snapshot of dslaunch, say)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([site] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
                   CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu",
                   LOCAL_SIZE=str(args.local_size), DS_UNITTEST_TIMEOUT=str(harness_timeout(args.test_timeout)),
                   HF_HOME=os.path.join(tmp, "hf_home"), HF_HUB_OFFLINE="1",
                   OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        results: Dict[str, FileResult] = {}
        if args.sample is not None or args.ids:
            wanted = None
            if args.ids:
                with open(args.ids) as fh:
                    wanted = [line.strip() for line in fh if line.strip()]
            paths = files_of(wanted) if wanted else args.paths
            items, errors = collect_tree(sys.executable, tests_dir, paths, env, tmp, args.timeout)
            results = sample_results(items, errors, reference, count_file)
            chosen = choose(items, args.sample, args.seed, wanted)
            junit, timed_out = (run_tree(sys.executable, tests_dir, chosen, env, args.workers, args.test_timeout,
                                         args.timeout, tmp, args.log) if chosen else (None, False))
            if junit:
                fold_sample(results, junit)
        else:
            junit, timed_out = run_tree(sys.executable, tests_dir, args.paths, env, args.workers,
                                        args.test_timeout, args.timeout, tmp, args.log)
            if junit:
                parse_junit(junit, results, reference, count_file)
        if reference is None:  # at an unrecorded commit, the syntax tree says which files hold tests
            reference = {rel: count_file(rel) for rel in test_files(unit)}
            reference = {k: v for k, v in reference.items() if v}
        # in a sample, every file not collected here was never reported (the sample's time limit
        # leaves tests not run, not files unreached)
        complete(results, reference, args.paths, timed_out and args.sample is None)
    out = sorted(results.values(), key=lambda r: r.path)
    t = totals(out)
    print(f"collected {t.collected}, passed {t.passed}, failed {t.failed} ({t.collection_errors} in files that fail "
          f"to import), skipped {t.skipped}" + (" (timed out)" if timed_out else ""), flush=True)
    # the user docs name dslaunch's state by its date (a hash is bookkeeping; DeepSpeed's commit is named
    # because its tree is the input)
    day = subprocess.run(["git", "-C", ROOT, "log", "-1", "--format=%cs"], capture_output=True,
                         text=True).stdout.strip() or "unknown"
    settings = (f"dslaunch as of {day}, {os.cpu_count()} CPU cores, LOCAL_SIZE={args.local_size}, "
                f"{args.workers} pytest-xdist workers, {args.test_timeout} s per test")
    if args.paths != ["."]:
        settings = f"only {', '.join(args.paths)} under tests/unit; " + settings
    if args.sample is not None:
        settings += f"; a uniform random sample of {args.sample} of the tests that collect (seed {args.seed}) ran"
    elif args.ids:
        settings += f"; only the tests listed in {os.path.basename(args.ids)} ran"
    if args.keep:
        os.makedirs(RUNS_DIR, exist_ok=True)
        written = time.strftime("%Y-%m-%dT%H-%M-%SZ", time.gmtime())
        write_json(os.path.join(RUNS_DIR, f"{written}.json"), out, commit, counting, settings)
    return write_table(out, commit, counting, settings, args, reasons)


def merged_result(earlier: FileResult, later: FileResult) -> FileResult:
    """A later run of a file replaces an earlier one, except where the later one ran none of its
    tests while the file imports (a collection, or a sample that drew none of them): then what an
    earlier run measured of the importing file stands, over the later run's count of its tests."""
    later_ran = later.passed + later.failed + later.skipped
    earlier_ran = earlier.passed + earlier.failed + earlier.skipped
    if later_ran or later.collection_errors or earlier.collection_errors or not earlier_ran:
        return later
    return dataclasses.replace(earlier, collected=later.collected, not_run=max(0, later.collected - earlier_ran))


def json_files(paths: List[str]) -> List[str]:
    """The --render-json arguments with each folder replaced by its *.json files, in name order."""
    out = []
    for path in paths:
        if os.path.isdir(path):
            out += sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".json"))
        else:
            out.append(path)
    return out


def from_json(paths: List[str]) -> "tuple[List[FileResult], str, str, str]":
    results: Dict[str, FileResult] = {}  # a later run of a file replaces an earlier one
    commits, counting, settings = set(), "", ""
    for path in json_files(paths):
        with open(path) as fh:
            data = json.load(fh)
        commits.add(data["commit"])
        counting = data.get("counting", counting)
        settings = data.get("settings", settings)
        for r in data["results"]:
            later = FileResult(**r)
            earlier = results.get(later.path)
            results[later.path] = later if earlier is None else merged_result(earlier, later)
    if len(commits) != 1:
        raise SystemExit(f"run_deepspeed_tests: the JSON files ran against different commits: {sorted(commits)}")
    return sorted(results.values(), key=lambda r: r.path), commits.pop(), counting, settings


README_ROW = "| DeepSpeed's own unit tests"
API_ROW = "| DeepSpeed names scripts import"  # the row the unit-test row follows


def test_files(unit: str) -> List[str]:
    """Every test_*.py under the folder `unit`, relative to it, with / separators, sorted."""
    found = []
    for dirpath, _, files in os.walk(unit):
        for name in files:
            if name.startswith("test_") and name.endswith(".py"):
                found.append(os.path.relpath(os.path.join(dirpath, name), unit).replace(os.sep, "/"))
    return sorted(found)


def readme_row(results: List[FileResult], commit: str, itself=None) -> str:
    """The README's row; `itself` is deepspeed_itself(commit)'s answer, for DeepSpeed's column."""
    t = totals(results)
    ran = t.passed + t.failed
    head = f"{README_ROW} ([results](docs/deepspeed-unit-tests.md)) | "
    own = ""
    if itself:  # DeepSpeed's column: its own figure on the same machine, counted the same way
        est, lo, hi = itself[2]
        own = (f"itself, same machine and counting: an estimated {100 * est:.0f}% (95% interval "
               f"{100 * lo:.0f}-{100 * hi:.0f}%); ")
    tail = f" | {own}its `tests/unit` at commit `{commit[:10]}` | | |"
    if t.not_run and not t.passed + t.failed - t.collection_errors + t.skipped:
        return (f"{head}whole tree: {t.collection_errors} of {t.collected} tests in files that fail to import; "
                f"the rest not run{tail}")
    if t.not_run:
        est, lo, hi = estimate(results)
        return (f"{head}whole tree, multi-rank tests included: an estimated {100 * est:.0f}% pass (95% interval "
                f"{100 * lo:.0f}-{100 * hi:.0f}%, from a random sample); {t.collection_errors} of {t.collected} "
                f"tests are in files that fail to import{tail}")
    share = f"{100.0 * t.passed / ran:.1f}%" if ran else "-"
    return (f"{head}{t.passed} of {ran} pass ({share}) over the whole tree, multi-rank tests included (each test "
            f"of a file that fails to import a failure), {t.skipped} skipped by DeepSpeed's CPU markers{tail}")


def deepspeed_itself(commit: str) -> Optional[Tuple[str, List[str], Tuple[float, float, float]]]:
    """Real DeepSpeed's own estimate on this machine, where scripts/ds_unit_cpu_sample.py has
    recorded a sample of the same commit's tree: (headline sentence, section lines, the estimate
    and its interval)."""
    import ds_unit_cpu_sample as sample  # a sibling script, which imports this one

    table = sample.load()
    if table is None or table.get("commit") != commit:
        return None
    reference = sample._reference_counts()
    est, lo, hi, _ = sample.deepspeed_estimate(table, reference)
    return (f"Real DeepSpeed {table['deepspeed']} itself, counted the same way on the same machine, passes an "
            f"estimated {100 * est:.1f}% (95% interval {100 * lo:.1f}-{100 * hi:.1f}%; below).",
            sample.report(table, reference), (est, lo, hi))


def update_readme(path: str, row: str) -> None:
    """Replace the README's unit-test row (or add it under the API row)."""
    with open(path) as fh:
        lines = fh.read().split("\n")
    at = [i for i, line in enumerate(lines) if line.startswith(README_ROW)]
    if at:
        lines[at[0]] = row
    else:
        api = [i for i, line in enumerate(lines) if line.startswith(API_ROW)]
        if not api:
            raise SystemExit(f"run_deepspeed_tests: {path}: no row to replace or to follow")
        lines.insert(api[0] + 1, row)
    with open(path, "w") as fh:
        fh.write("\n".join(lines))


def write_table(results: List[FileResult], commit: str, counting: str, settings: str, args,
                reasons: Dict[str, str]) -> int:
    itself = deepspeed_itself(commit)
    if getattr(args, "readme", None):
        update_readme(args.readme, readme_row(results, commit, itself))
    text = render(results, commit, sys.executable, reasons, counting, settings,
                  load_ds_cpu(getattr(args, "ds_cpu", None)), itself)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
    else:
        print(text)
    if args.json:
        write_json(args.json, results, commit, counting, settings)
    return 0


def write_json(path: str, results: List[FileResult], commit: str, counting: str, settings: str) -> None:
    with open(path, "w") as fh:
        json.dump({"commit": commit, "counting": counting, "settings": settings,
                   "results": [asdict(r) for r in results]}, fh, indent=1)


if __name__ == "__main__":
    sys.exit(main())
