"""scripts/run_deepspeed_tests.py's table, from a junit report written here (no DeepSpeed
checkout needed): counts, causes, the tests failed on purpose and the reasons file."""
from pathlib import Path

import pytest

from script_modules import load_script

ROOT = Path(__file__).resolve().parent.parent
JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="" name="unit.runtime.test_gone" time="0"><error message="collection failure">
E   ModuleNotFoundError: No module named 'deepspeed.gone'</error></testcase>
<testcase classname="unit.runtime.test_a.TestA" name="test_ok" time="1"/>
<testcase classname="unit.runtime.test_a.TestA" name="test_skip" time="0"><skipped message="needs 2 ranks"/></testcase>
<testcase classname="unit.runtime.test_a.TestA" name="test_bad[1]" time="1">
<failure message="AssertionError: 0x7f00 != 3">trace</failure></testcase>
<testcase classname="unit.runtime.test_a.TestA" name="test_bad[2]" time="1">
<failure message="AssertionError: 0x7f11 != 4">trace</failure></testcase>
</testsuite></testsuites>"""


def _script():
    return load_script("run_deepspeed_tests")


def test_table_counts_causes_and_the_failures_on_purpose(tmp_path):
    s = _script()
    (tmp_path / "r.xml").write_text(JUNIT)
    r = s.FileResult("runtime/")
    s.parse_junit(str(tmp_path / "r.xml"), r)
    assert (r.collected, r.passed, r.failed, r.skipped, r.collection_errors) == (5, 1, 3, 1, 1)
    # numbers and addresses blanked: one cause however many tests hit it
    assert r.causes == {"ModuleNotFoundError: No module named 'deepspeed.gone'": 1, "AssertionError: 0x… != N": 2}
    reasons = {"unit.runtime.test_gone": "not provided, because", "unit.runtime.test_a.TestA::test_bad": "differs"}
    text = s.render([r], "abc123", "python", reasons)
    assert "DeepSpeed commit `abc123`" in text and "**1 of 4 passed (25%)**" in text
    assert "| `runtime/` | 5 | 1 | 3 | 1 |" in text
    assert "| `unit.runtime.test_gone` | not provided, because |" in text
    assert "| `unit.runtime.test_a.TestA::test_bad[2]` | differs |" in text
    # the JSON round trip renders the same table
    readme = tmp_path / "README.md"
    readme.write_text("| a | b |\n| DeepSpeed's API as scripts import it | x |\n| c | d |\n")
    s.write_table([r], "abc123", type("A", (), {"out": str(tmp_path / "t.md"), "json": str(tmp_path / "t.json"),
                                                "readme": str(readme)}), reasons)
    s.write_table([r], "abc123", type("A", (), {"out": None, "json": None, "readme": str(readme)}), reasons)
    rows = readme.read_text().split("\n")
    assert len(rows) == 5 and rows[2].startswith("| DeepSpeed's own unit tests") and "1 of 4 that ran pass" in rows[2]
    again = s.from_json([str(tmp_path / "t.json")])
    assert s.render(*again, "python", reasons) == (tmp_path / "t.md").read_text() == text
    # a later run of the same path replaces the earlier one, in its place
    rerun = s.FileResult("runtime/", collected=2, passed=2)
    s.write_table([rerun, s.FileResult("other/")], "abc123",
                  type("A", (), {"out": None, "json": str(tmp_path / "u.json"), "readme": None}), reasons)
    merged, _ = s.from_json([str(tmp_path / "t.json"), str(tmp_path / "u.json")])
    assert [(m.path, m.passed) for m in merged] == [("runtime/", 2), ("other/", 0)]


def test_reasons_file_parses_and_bad_lines_name_themselves(tmp_path):
    s = _script()
    assert all(why for why in s.load_reasons(s.REASONS_FILE).values())
    bad = tmp_path / "reasons.txt"
    bad.write_text("# comment\nunit.x.test_y without a reason\n")
    with pytest.raises(SystemExit, match=r"reasons.txt:2: expected `<test id prefix> \| reason`"):
        s.load_reasons(str(bad))


def test_usage_error_without_a_checkout(capsys):
    assert _script().main([]) == 2
    assert "--deepspeed-src DIR (or --render-json) is required" in capsys.readouterr().err
