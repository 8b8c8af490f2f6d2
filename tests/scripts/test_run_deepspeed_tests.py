"""scripts/run_deepspeed_tests.py's table, from a junit report written here (no DeepSpeed
checkout needed): per-file and per-directory counts, a file that fails to import counting its
reference tests, causes, skip reasons, the tests failed on purpose and the reasons file."""
import json
import sys
import types

import pytest

from script_modules import load_script
import repo_paths

ROOT = repo_paths.ROOT
JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="" name="unit.runtime.test_gone" time="0"><error message="collection failure">
E   ModuleNotFoundError: No module named 'deepspeed.gone'</error></testcase>
<testcase classname="unit.runtime.test_a.TestA" name="test_ok" file="unit/runtime/test_a.py" time="1"/>
<testcase classname="unit.runtime.test_a.TestA" name="test_skip" file="unit/runtime/test_a.py" time="0">
<skipped message="unit/common.py:273: Skipping test because not enough GPUs are available: 8 required, 4 available"/>
</testcase>
<testcase classname="unit.runtime.test_a.TestA" name="test_bad[1]" file="unit/runtime/test_a.py" time="1">
<failure message="AssertionError: 0x7f00 != 3">trace</failure></testcase>
<testcase classname="unit.runtime.test_a.TestA" name="test_bad[2]" file="unit/runtime/test_a.py" time="1">
<failure message="AssertionError: 0x7f11 != 4">trace</failure></testcase>
<testcase classname="unit.ops.adam.test_x" name="test_y" time="1"/>
</testsuite></testsuites>"""
REFERENCE = {"runtime/test_gone.py": 7, "runtime/test_a.py": 4, "ops/adam/test_x.py": 1, "ops/adam/test_z.py": 3,
             "comm/test_c.py": 2}


def _script():
    return load_script("run_deepspeed_tests")


def _args(**kw):
    return type("A", (), dict({"out": None, "json": None, "readme": None}, **kw))


def test_table_counts_causes_skips_and_the_failures_on_purpose(tmp_path):
    s = _script()
    (tmp_path / "r.xml").write_text(JUNIT)
    results = s.parse_junit(str(tmp_path / "r.xml"), reference=REFERENCE)
    gone, a, x = results["runtime/test_gone.py"], results["runtime/test_a.py"], results["ops/adam/test_x.py"]
    # a file that fails to import counts every test the reference collection found in it
    assert (gone.collected, gone.failed, gone.collection_errors) == (7, 7, 7)
    assert (a.collected, a.passed, a.failed, a.skipped) == (4, 1, 2, 1)
    assert (x.collected, x.passed) == (1, 1)  # no file attribute: the dotted class name gives the file
    # numbers and addresses blanked: one cause however many tests hit it
    assert a.causes == {"AssertionError: 0x… != N": 2}
    assert gone.causes == {"ModuleNotFoundError: No module named 'deepspeed.gone'": 7}
    assert a.skips == {"Skipping test because not enough GPUs are available: N required, N available": 1}
    # a file of the reference under a path that ran, never reported: its tests fail as not collected
    s.complete(results, REFERENCE, ["runtime", "ops"], timed_out=False)
    assert results["ops/adam/test_z.py"].failed == 3 and "comm/test_c.py" not in results
    assert results["ops/adam/test_z.py"].causes == {"not collected here": 3}
    out = sorted(results.values(), key=lambda r: r.path)
    reasons = {"unit.runtime.test_gone": "not provided, because", "unit.runtime.test_a.TestA::test_bad": "differs"}
    text = s.render(out, "abc123", "python", reasons, "the reference", "LOCAL_SIZE=4")
    assert "commit `abc123`" in text and "**2 of 14 passed (14.3%)**" in text
    assert "12 failed (7 of them in 1 files that fail to import)" in text and "9 of the failures are on purpose" in text
    assert "| `runtime/` | 11 | 1 | 9 | 1 | 7 | 0 | 10% |" in text
    assert "| `ops/adam/` | 4 | 1 | 3 | 0 | 0 | 0 | 25% |" in text
    assert "| **total** | 15 | 2 | 12 | 1 | 7 | 0 | 14% |" in text
    assert "| `unit.runtime.test_gone` | 7 | not provided, because |" in text
    assert "| `unit.runtime.test_a.TestA::test_bad[2]` | 1 | differs |" in text
    assert "| 1 | Skipping test because not enough GPUs are available: N required, N available |" in text
    # the JSON round trip renders the same table; the README row states the whole-tree figure
    readme = tmp_path / "README.md"
    readme.write_text("| a | b |\n| DeepSpeed names scripts import | x |\n| c | d |\n")
    s.write_table(out, "abc123", "the reference", "LOCAL_SIZE=4",
                  _args(out=str(tmp_path / "t.md"), json=str(tmp_path / "t.json"), readme=str(readme)), reasons)
    s.write_table(out, "abc123", "the reference", "LOCAL_SIZE=4", _args(readme=str(readme)), reasons)
    rows = readme.read_text().split("\n")
    assert len(rows) == 5 and rows[2].startswith("| DeepSpeed's own unit tests")
    assert "2 of 14 pass (14.3%) over the whole tree" in rows[2]
    again = s.from_json([str(tmp_path / "t.json")])
    assert s.render(*again[:2], "python", reasons, *again[2:]) == (tmp_path / "t.md").read_text() == text
    # a later run of the same file replaces the earlier one
    rerun = s.FileResult("runtime/test_gone.py", collected=7, passed=7)
    s.write_table([rerun], "abc123", "the reference", "", _args(json=str(tmp_path / "u.json")), reasons)
    merged = s.from_json([str(tmp_path / "t.json"), str(tmp_path / "u.json")])[0]
    assert {m.path: m.passed for m in merged}["runtime/test_gone.py"] == 7 and len(merged) == 4
    # a later collection (nothing run) keeps what an earlier run measured of a file that still
    # imports, and replaces the entry of a file that failed to import then
    sampled = s.FileResult("runtime/test_a.py", collected=11, passed=1, failed=1, not_run=9)
    was_broken = s.FileResult("runtime/test_b.py", collected=3, failed=3, collection_errors=3)
    collected = [s.FileResult("runtime/test_a.py", collected=11, not_run=11),
                 s.FileResult("runtime/test_b.py", collected=3, not_run=3)]
    s.write_table([sampled, was_broken], "abc123", "r", "", _args(json=str(tmp_path / "v.json")), reasons)
    s.write_table(collected, "abc123", "r", "", _args(json=str(tmp_path / "w.json")), reasons)
    merged = {m.path: m for m in s.from_json([str(tmp_path / "v.json"), str(tmp_path / "w.json")])[0]}
    assert (merged["runtime/test_a.py"].passed, merged["runtime/test_a.py"].not_run) == (1, 9)
    assert (merged["runtime/test_b.py"].failed, merged["runtime/test_b.py"].not_run) == (0, 3)
    # a folder of kept runs (--keep) stands for its JSON files in name order: the later run wins
    runs = tmp_path / "runs"
    runs.mkdir()
    for name, run in (("2026-01-02T00-00-00Z.json", "w.json"), ("2026-01-01T00-00-00Z.json", "v.json")):
        (runs / name).write_text((tmp_path / run).read_text())
    (runs / "notes.txt").write_text("not a run")
    assert s.json_files([str(runs)]) == [str(runs / "2026-01-01T00-00-00Z.json"),
                                         str(runs / "2026-01-02T00-00-00Z.json")]
    assert s.from_json([str(runs)]) == s.from_json([str(tmp_path / "v.json"), str(tmp_path / "w.json")])


def test_sample_counts_import_failures_exactly_and_estimates_the_rest(tmp_path):
    s = _script()
    items = [f"unit/runtime/test_a.py::TestA::test_{i}" for i in range(8)] + ["unit/ops/adam/test_x.py::test_y"]
    results = s.sample_results(items, {"unit/runtime/test_gone.py": "ModuleNotFoundError: No module named 'x'",
                                       "unit/inference/test_inf.py": "ImportError: no InferenceBuilder"},
                               REFERENCE, None)
    assert results["runtime/test_gone.py"].failed == 7 and results["runtime/test_a.py"].not_run == 8
    # a file DeepSpeed's own collection lists no test of (all deselected by pytest.ini's markers) counts none
    inf = results["inference/test_inf.py"]
    assert (inf.collected, inf.failed, inf.deselected_import_error) == (0, 0, "ImportError: no InferenceBuilder")
    assert results["runtime/test_gone.py"].failed_ids == ["unit.runtime.test_gone"]  # as the reasons name it
    junit = tmp_path / "s.xml"
    junit.write_text("""<testsuites><testsuite>
<testcase classname="unit.runtime.test_a.TestA" name="test_0" file="unit/runtime/test_a.py"/>
<testcase classname="unit.runtime.test_a.TestA" name="test_1" file="unit/runtime/test_a.py"/>
<testcase classname="unit.runtime.test_a.TestA" name="test_2" file="unit/runtime/test_a.py"><failure message="x"/>
</testcase><testcase classname="unit.runtime.test_a.TestA" name="test_3" file="unit/runtime/test_a.py">
<skipped message="no"/></testcase></testsuite></testsuites>""")
    s.fold_sample(results, str(junit))
    a = results["runtime/test_a.py"]
    assert (a.collected, a.passed, a.failed, a.skipped, a.not_run) == (8, 2, 1, 1, 4)
    total = s.totals(list(results.values()))
    # 9 tests collect, 7 fail to import; of 4 sampled, 2 pass and 1 skips: 4.5 of 9 pass, 6.75 + 7 run
    est, lo, hi = s.estimate(total)
    assert est == pytest.approx(4.5 / 13.75) and lo < est < hi
    text = s.render(sorted(results.values(), key=lambda r: r.path), "abc", "py", {}, "", "")
    assert "Whole tree: 16 tests; 7 of them are in 1 files that fail to import" in text
    assert "A uniform random sample of 4 of the 9 tests that collect ran: 2 passed, 1 failed, 1 skipped" in text
    assert "| `runtime/` | 15 | 2 | 8 | 1 | 7 | 4 | 20% |" in text and "`inference/`" not in text.split("## Files")[0]
    assert "| `inference/test_inf.py` | ImportError: no InferenceBuilder |" in text
    # a file run in full counts exactly; the sample stands for the other files' tests only
    full = s.FileResult("ops/adam/test_x.py", collected=1, failed=1)
    mixed = [r for r in results.values() if r.path != "ops/adam/test_x.py"] + [full]
    # test_a: 8 tests, 2 of 4 sampled pass and 1 skips (4 pass, 6 run); test_x: 1 run, failed; 7 errors
    est, lo, hi = s.estimate(mixed)
    assert est == pytest.approx(4 / (6 + 1 + 7)) and lo < est < hi
    text = s.render(sorted(mixed, key=lambda r: r.path), "abc", "py", {}, "", "")
    assert ("All 1 tests of 1 files ran: 0 passed, 1 failed, 0 skipped; of the other 8 tests that collect, a random "
            "sample of 4 ran: 2 passed, 1 failed, 1 skipped") in text
    # the collection alone (--sample 0) states the import failures and runs nothing
    alone = s.sample_results(items, {"unit/runtime/test_gone.py": "E"}, REFERENCE, None)
    assert "none of the 9 tests that collect ran" in s.render(list(alone.values()), "abc", "py", {}, "", "")


def test_syntax_tree_count_expands_literal_parametrize():
    s = _script()
    src = '''
import pytest
def helper(): pass
def test_plain(): pass
@pytest.mark.parametrize("a", [1, 2, 3])
@pytest.mark.parametrize("b,c", [(1, 2), (3, 4)])
def test_grid(a, b, c): pass
@pytest.mark.parametrize("d", [1, 2])
class TestK:
    def test_one(self): pass
    @pytest.mark.parametrize("e", (1, 2, 3))
    def test_two(self, e): pass
    def helper(self): pass
class Other:
    def test_not_collected(self): pass
'''
    assert s.count_tests_in_source(src) == 1 + 6 + 2 + 6


def test_reference_is_used_only_at_its_commit(tmp_path):
    s = _script()
    ref = tmp_path / "c.json"
    ref.write_text(json.dumps({"commit": "edaa72212abc", "deepspeed": "0.19.6", "files": {"a/test_b.py": 3}}))
    files, how = s.load_reference(str(ref), "edaa72212abc")
    assert files == {"a/test_b.py": 3} and "same commit" in how
    files, how = s.load_reference(str(ref), "0123456")
    assert files is None and "syntax tree" in how


def test_recorded_collection_covers_the_tree():
    data = json.loads((ROOT / "tests/data/deepspeed_unit_collection.json").read_text())
    assert data["tests"] == sum(data["files"].values()) > 3000 and not data["collection_errors"]


def test_kept_runs_render_against_the_recorded_commit():
    # every kept run (--keep) reads back, all of them ran DeepSpeed's recorded commit, and each
    # file's counts add up
    s = _script()
    data = json.loads((ROOT / "tests/data/deepspeed_unit_collection.json").read_text())
    results, commit, _, _ = s.from_json([s.RUNS_DIR])
    assert results and commit == data["commit"]
    for r in results:
        assert r.passed + r.failed + r.skipped + r.not_run == r.collected, r


def test_command_is_deepspeeds_ci_invocation():
    cmd = _script().pytest_command("py", ["."], "j.xml", 4, 600)
    assert cmd[:4] == ["py", "-m", "pytest", "unit/"] and "--forked" in cmd and cmd[-2:] == ["-n", "4"]
    assert "--timeout=600" in cmd and "--continue-on-collection-errors" in cmd


def test_reasons_file_parses_and_bad_lines_name_themselves(tmp_path):
    s = _script()
    assert all(why for why in s.load_reasons(s.REASONS_FILE).values())
    bad = tmp_path / "reasons.txt"
    bad.write_text("# comment\nunit.x.test_y without a reason\n")
    with pytest.raises(SystemExit, match=r"reasons.txt:2: expected `<test id prefix> \| reason`"):
        s.load_reasons(str(bad))


def test_usage_errors(capsys, tmp_path):
    assert _script().main([]) == 2
    assert "--deepspeed-src DIR (or --render-json) is required" in capsys.readouterr().err
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    assert _script().main(["--deepspeed-src", str(tmp_path), "--paths", "nowhere"]) == 2
    assert "--paths nowhere: not in" in capsys.readouterr().err


def test_collection_pass_and_sampled_run_on_a_small_tree(tmp_path):
    """collect_tree and run_tree against a tree of two files (one fails to import), with this
    environment's pytest; then the sample folded in."""
    s = _script()
    unit = tmp_path / "tests" / "unit"
    unit.mkdir(parents=True)
    (unit / "test_ok.py").write_text("import pytest\n@pytest.mark.parametrize('x', [1, 2, 3])\n"
                                     "def test_x(x):\n    assert x != 3\n")
    (unit / "test_broken.py").write_text("import deepspeed_no_such_module\ndef test_y():\n    pass\n")
    env = dict(__import__("os").environ)
    items, errors = s.collect_tree(sys.executable, str(tmp_path / "tests"), ["."], env, str(tmp_path), 300)
    assert sorted(items) == [f"unit/test_ok.py::test_x[{i}]" for i in (1, 2, 3)]
    assert errors == {"unit/test_broken.py": "ModuleNotFoundError: No module named 'deepspeed_no_such_module'"}
    results = s.sample_results(items, errors, None, lambda rel: 1)
    # --ids: the listed tests that collect (one in a file that fails to import cannot be run)
    wanted = ["test_ok.py::test_x[2]", "test_broken.py::test_y"]
    assert s.files_of(wanted) == ["test_broken.py", "test_ok.py"]
    assert s.choose(items, None, 0, wanted) == ["unit/test_ok.py::test_x[2]"]
    assert sorted(s.choose(items, 2, 7)) == sorted(s.choose(items, 2, 7)) and len(s.choose(items, 2, 7)) == 2
    cmd = s.pytest_command(sys.executable, items[:2], "x.xml", 0, 60)
    assert cmd[3:5] == items[:2]
    # run_tree adds --forked (DeepSpeed's CI): not installed in this environment, so run pytest directly
    import subprocess
    junit = tmp_path / "j.xml"
    subprocess.run([sys.executable, "-m", "pytest", *items, "-p", "no:cacheprovider", "--junitxml", str(junit),
                    "-o", "junit_family=xunit1", "-q"], cwd=tmp_path / "tests", env=env, capture_output=True,
                   timeout=300)
    s.fold_sample(results, str(junit))
    ok, broken = results["test_ok.py"], results["test_broken.py"]
    assert (ok.collected, ok.passed, ok.failed, ok.not_run) == (3, 2, 1, 0)
    assert (broken.failed, broken.collection_errors, broken.failed_ids) == (1, 1, ["unit.test_broken"])


# a stand-in for DeepSpeed's unit.common with the shape of its DistributedExec: ranks in a
# forkserver pool, the result awaited for exec_timeout, pytest.exit when it never comes, the pool
# closed and joined in a finally
HARNESS_COMMON = """
import multiprocessing as mp
import time

import pytest


class DistributedExec:
    exec_timeout = 3
    reuse_dist_env = False
    _pool_cache = {}

    def __init__(self, mode):
        self.mode = mode

    def _dist_run(self, local_rank):
        if self.mode == "fail" and local_rank == 0:
            pytest.fail("DID NOT RAISE <class RuntimeError>")
        if self.mode == "hang" and local_rank == 1:
            time.sleep(3600)  # waits in a collective for a rank that is gone, say
        return ""

    def _dist_destroy(self):
        return None

    def _close_pool(self, pool, num_procs, force=False):
        if force or not self.reuse_dist_env:
            pool.starmap(self._dist_destroy, [() for _ in range(num_procs)])
            pool.close()
            pool.join()

    def launch(self, num_procs):
        pool = mp.get_context("forkserver").Pool(num_procs)
        pending = pool.starmap_async(self._dist_run, [(rank,) for rank in range(num_procs)])
        try:
            return pending.get(self.exec_timeout)
        except mp.TimeoutError:
            pytest.exit("Test hanged, exiting", returncode=1)
        finally:
            self._close_pool(pool, num_procs)
"""

HARNESS_CHILD = """
import sys

from unit.common import DistributedExec

if __name__ == "__main__":
    try:
        DistributedExec(sys.argv[1]).launch(2)
        print("RESULT none")
    except BaseException as exc:  # noqa: BLE001 (what reaches the test is the result)
        print(f"RESULT {type(exc).__module__}.{type(exc).__name__}: {exc}")
"""


@pytest.mark.parametrize("mode, want", [
    ("fail", "builtins.AssertionError: pytest.fail in a rank: DID NOT RAISE <class RuntimeError>"),
    ("hang", "builtins.TimeoutError: Test hanged, exiting: a rank did not finish within DS_UNITTEST_TIMEOUT "
             "(DeepSpeed's harness would end the whole run here)"),
])
def test_deepspeeds_harness_fails_the_test_instead_of_hanging_or_ending_the_run(tmp_path, mode, want):
    """Under the runner's sitecustomize (every process that imports unit.common, the pool's
    forkserver children included): a rank's pytest.fail (a BaseException, which kills DeepSpeed's
    pool worker and loses its result) comes back as an AssertionError; a rank that never answers
    fails the test with a TimeoutError and its pool is ended, where joining it would wait forever."""
    import os
    import subprocess

    (tmp_path / "unit").mkdir()
    (tmp_path / "unit" / "__init__.py").write_text("")
    (tmp_path / "unit" / "common.py").write_text(HARNESS_COMMON)
    (tmp_path / "sitecustomize.py").write_text(_script().HARNESS_PATCH)
    (tmp_path / "child.py").write_text(HARNESS_CHILD)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "child.py", mode], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=180)
    result = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert result == [f"RESULT {want}"], (out.stdout, out.stderr[-2000:])


def test_deepspeeds_rank_limit_falls_short_of_the_test_limit():
    s = _script()
    assert s.harness_timeout(300) == 270 and s.harness_timeout(40) == 20 and s.harness_timeout(1) == 1


DS_JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="unit.runtime.test_a.TestA" name="test_ok" time="1"/>
<testcase classname="unit.runtime.test_a.TestA" name="test_bad[1]" time="1"><failure message="">
E   ValueError: DistributedDataParallel device_ids [1] only work with GPU modules</failure></testcase>
<testcase classname="unit.runtime.test_a.TestA" name="test_skip" time="0">
<skipped message="unit/common.py:273: not enough GPUs: 8 required"/></testcase>
</testsuite></testsuites>"""


def test_failures_deepspeed_has_on_a_cpu_too_are_marked_and_still_counted(tmp_path):
    s = _script()
    make = load_script("make_ds_unit_cpu_failures")
    (tmp_path / "ds.xml").write_text(DS_JUNIT)
    ds = make.outcomes_of(str(tmp_path / "ds.xml"))
    assert ds["unit.runtime.test_a.TestA::test_ok"] == {"outcome": "passed", "cause": ""}
    assert ds["unit.runtime.test_a.TestA::test_bad[1]"] == {
        "outcome": "failed", "cause": "ValueError: DistributedDataParallel device_ids [N] only work with GPU modules"}
    assert ds["unit.runtime.test_a.TestA::test_skip"]["outcome"] == "skipped"
    # a rerun replaces its own entries and keeps the others; another DeepSpeed is refused
    table = make.merge(str(tmp_path / "none.json"), ds, "0.19.8", "abc")
    (tmp_path / "t.json").write_text(json.dumps(table))
    again = make.merge(str(tmp_path / "t.json"), {"unit.x::y": {"outcome": "passed", "cause": ""}}, "0.19.8", "abc")
    assert len(again["tests"]) == 4
    with pytest.raises(SystemExit, match="0.19.8 at abc, not 0.20.0"):
        make.merge(str(tmp_path / "t.json"), {}, "0.20.0", "abc")
    # ours: both test_bad[1] (DeepSpeed fails it too) and test_bad[2] (DeepSpeed's answer unrecorded) fail
    (tmp_path / "r.xml").write_text(JUNIT)
    results = sorted(s.parse_junit(str(tmp_path / "r.xml"), reference=REFERENCE).values(), key=lambda r: r.path)
    (tmp_path / "o.json").write_text(json.dumps(again))
    text = s.render(results, "abc", "py", {}, "", "", s.load_ds_cpu(str(tmp_path / "o.json")))
    assert "**2 of 11 passed (18.2%)**, 9 failed" in text  # still counted as a failure
    assert "1 of the failures fail under DeepSpeed 0.19.8 on a CPU too (below; DeepSpeed's answer is recorded " \
           "for 1 of the failed tests)" in text
    assert ("| `unit.runtime.test_a.TestA::test_bad[1]` | ValueError: DistributedDataParallel device_ids [N] only "
            "work with GPU modules |") in text
    assert "test_bad[2]` |" not in text.split("## Failures DeepSpeed has on a CPU too")[1].split("## ")[0]
    assert "Failures DeepSpeed has" not in s.render(results, "abc", "py", {}, "", "", {})


def test_recorded_deepspeed_cpu_outcomes_are_well_formed():
    s = _script()
    with open(s.DS_CPU_FILE) as fh:
        table = json.load(fh)
    assert table["deepspeed"] == "0.19.8" and table["tests"]
    for test, o in table["tests"].items():
        assert test.startswith("unit.") and "::" in test, test
        assert o["outcome"] in ("passed", "failed", "skipped") and bool(o["cause"]) == (o["outcome"] != "passed")


def test_a_table_of_another_deepspeed_refuses_before_the_run_not_after(tmp_path, monkeypatch):
    """The run takes many minutes under real DeepSpeed: a table it could not be merged into
    stops it before it starts. --commit names a checkout without its git history."""
    make = load_script("make_ds_unit_cpu_failures")
    monkeypatch.setitem(sys.modules, "deepspeed", types.SimpleNamespace(__version__="0.19.8"))
    monkeypatch.setattr(make, "run_pytest", lambda *a: pytest.fail("ran DeepSpeed's tests"))
    out = tmp_path / "t.json"
    out.write_text(json.dumps({"deepspeed": "0.19.8", "commit": "abc", "local_size": 2, "tests": {}}))
    with pytest.raises(SystemExit, match="0.19.8 at abc, not 0.19.8 at unknown"):
        make.main(["--deepspeed-src", str(tmp_path), "--out", str(out), "unit/x.py"])
    (tmp_path / "ds.xml").write_text(DS_JUNIT)
    assert make.main(["--deepspeed-src", str(tmp_path), "--out", str(out), "--commit", "abc",
                      "--junit", str(tmp_path / "ds.xml")]) == 0
    assert len(json.loads(out.read_text())["tests"]) == 3
