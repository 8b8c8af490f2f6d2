"""scripts/ds_unit_cpu_sample.py's pure parts: reading DeepSpeed's collection tree, the id
forms, folding dslaunch's report in, and DeepSpeed's whole-tree estimate counted as ours is."""
import json

from script_modules import load_script

COLLECTION = """\x1b[1mcollecting ... \x1b[0mcollected 5 items / 1 error / 1 deselected / 3 selected
<Dir tests>
  <Package unit>
    <Dir runtime>
      <Module test_a.py>
        <Class TestA>
          <Function test_ok>
            A docstring line
          <Function test_bad[1]>
      <Module test_b.py>
        <Function test_plain>
\x1b[31m_____ ERROR collecting unit/runtime/test_gone.py _____\x1b[0m
ImportError while importing test module '/x/tests/unit/runtime/test_gone.py'.
E   ModuleNotFoundError: No module named 'transformers'
"""
JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="unit.runtime.test_a.TestA" name="test_ok" time="1"/>
<testcase classname="unit.runtime.test_a.TestA" name="test_bad[1]" time="1">
<failure message="AssertionError: 0x7f00 != 3">trace</failure></testcase>
</testsuite></testsuites>"""


def test_collection_tree_gives_ids_and_import_failures():
    s = load_script("ds_unit_cpu_sample")
    ids, errors = s.parse_collection(COLLECTION)
    assert ids == ["unit/runtime/test_a.py::TestA::test_ok", "unit/runtime/test_a.py::TestA::test_bad[1]",
                   "unit/runtime/test_b.py::test_plain"]
    assert errors == {"unit/runtime/test_gone.py": "ModuleNotFoundError: No module named 'transformers'"}
    files = ["unit/runtime/test_a.py", "unit/runtime/test_b.py"]
    for test_id in ids:  # junit's classname::name and back
        assert s._path_id(s._dotted(test_id), files) == test_id
    assert s._dotted(ids[0]) == "unit.runtime.test_a.TestA::test_ok"


def test_estimate_counts_import_failures_and_the_report_pairs_both_sides(tmp_path):
    s = load_script("ds_unit_cpu_sample")
    table = {"deepspeed": "0.19.8", "local_size": 4, "seed": 1, "collected": 10,
             "import_errors": {"unit/runtime/test_gone.py": "ModuleNotFoundError: x"},
             "tests": {"unit.runtime.test_a.TestA::test_ok": {"deepspeed": {"outcome": "passed", "cause": ""}},
                       "unit.runtime.test_a.TestA::test_bad[1]": {"deepspeed": {"outcome": "passed", "cause": ""}},
                       "unit.runtime.test_b::test_plain": {"deepspeed": {"outcome": "failed", "cause": "E"}},
                       "unit.runtime.test_b::test_skip": {"deepspeed": {"outcome": "skipped", "cause": "S"}}}}
    est, lo, hi, errors = s.deepspeed_estimate(table, {"runtime/test_gone.py": 5})
    # sampled: 2 passed, 1 failed, 1 skipped of 4, standing for 10 tests that collect (7.5 run, 5 pass),
    # plus 5 import failures: 5 / 12.5
    assert errors == 5 and abs(est - 0.4) < 1e-9 and lo < est < hi
    (tmp_path / "ours.xml").write_text(JUNIT)
    (tmp_path / "run.json").write_text(json.dumps({"results": [
        {"path": "runtime/test_b.py", "collection_errors": 3, "causes": {"ImportError: gone": 3}}]}))
    # not in the report: failures, with the import error of their file where the run recorded one
    assert s.add_dslaunch(table, str(tmp_path / "ours.xml"), str(tmp_path / "run.json")) == 2
    assert table["tests"]["unit.runtime.test_b::test_plain"]["dslaunch"] == {"outcome": "failed",
                                                                              "cause": "ImportError: gone"}
    text = "\n".join(s.report(table, {"runtime/test_gone.py": 5}))
    assert "DeepSpeed itself passes an estimated 40.0% of the tree here" in text
    assert "dslaunch on the same 4 tests: 1 passed, 3 failed, 0 skipped." in text
    assert "| passed | 1 | 1 | 0 |" in text and "| skipped | 0 | 1 | 0 |" in text
    assert "| `unit.runtime.test_a.TestA::test_bad[1]` | AssertionError: 0x… != N |" in text
    s.save(table, str(tmp_path / "t.json"))
    assert s.load(str(tmp_path / "t.json")) == json.loads((tmp_path / "t.json").read_text())


def test_the_page_states_deepspeeds_own_share_beside_ours():
    run = load_script("run_deepspeed_tests")
    results = [run.FileResult(path="runtime/test_a.py", collected=2, passed=1, failed=1)]
    text = run.render(results, "abc", "py", deepspeed_itself=("DeepSpeed itself: 40%.", ["the section"]))
    head, rest = text.split("## DeepSpeed itself on this machine")
    assert "**1 of 2 passed (50.0%)**" in head and "DeepSpeed itself: 40%." in head
    assert rest.lstrip().startswith("the section")
    assert "## DeepSpeed itself" not in run.render(results, "abc", "py")


def test_recorded_sample_is_well_formed_and_paired():
    s = load_script("ds_unit_cpu_sample")
    run = load_script("run_deepspeed_tests")
    table = s.load()
    assert table["deepspeed"] == "0.19.8" and len(table["tests"]) >= 100
    with open(run.COLLECTION_FILE) as fh:
        assert table["commit"] == json.load(fh)["commit"]  # the page's commit: rendered beside its figure
    for test, entry in table["tests"].items():
        assert test.startswith("unit.") and "::" in test, test
        for side in ("deepspeed", "dslaunch"):
            assert entry[side]["outcome"] in ("passed", "failed", "skipped"), (test, side)
    est, lo, hi, _ = s.deepspeed_estimate(table, s._reference_counts())
    assert 0 < lo <= est <= hi < 1
