"""The documentation cannot rot.

- The site builds with `mkdocs build --strict`: a broken link or anchor, or a page missing
  from mkdocs.yml's nav, fails (and a test proves the build does fail on each).
- Every relative link in README.md resolves to a file, and an anchor to a heading of it.
- Every fenced example marked runnable in README.md and docs/ runs on the CPU with the
  exit status it declares, and prints the output the page shows. The marker convention is
  docs/writing-docs.md's; `examples()` parses it and `output_matches()` checks output.
"""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import pytest
import repo_paths

ROOT = repo_paths.ROOT
DOCS = ROOT / "docs"
BIN = pathlib.Path(sys.executable).parent

MARK = re.compile(r"^<!--\s*runnable(?::\s*(?P<opts>.*?))?\s*-->\s*$")
OUTPUT_MARK = re.compile(r"^<!--\s*output\s*-->\s*$")
FENCE = re.compile(r"^(?P<fence>`{3,})(?P<info>[^`]*)$")
LANGS = {"python", "bash"}


@dataclass
class Example:
    page: str
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    file: Optional[str] = None  # write to this file instead of running
    exit: int = 0
    expected: List[str] = field(default_factory=list)  # the <!-- output --> block's non-blank lines

    def where(self) -> str:
        return f"{self.page}:{self.line}"


def _fence_at(lines: List[str], i: int):
    """(lang, code, index after the closing fence) for a fenced block opening at lines[i]."""
    m = FENCE.match(lines[i])
    if not m:
        return None
    close = m.group("fence")
    for j in range(i + 1, len(lines)):
        if lines[j].strip() == close:
            return m.group("info").strip(), "\n".join(lines[i + 1:j]) + "\n", j + 1
    raise ValueError(f"line {i + 1}: fence never closed")


def _next_nonblank(lines: List[str], i: int) -> int:
    while i < len(lines) and not lines[i].strip():
        i += 1
    return i


def examples(text: str, page: str) -> List[Example]:
    """The runnable examples of one markdown page, in page order."""
    lines = text.split("\n")
    found: List[Example] = []
    i = 0
    while i < len(lines):
        m = MARK.match(lines[i])
        if not m:
            i += 1
            continue
        opts: Dict[str, str] = {}
        for part in (m.group("opts") or "").split():
            key, sep, value = part.partition("=")
            if not sep or key not in ("file", "exit"):
                raise ValueError(f"{page}:{i + 1}: unknown runnable option {part!r} (file=NAME, exit=N)")
            opts[key] = value
        block = _fence_at(lines, i + 1) if i + 1 < len(lines) else None
        if block is None or block[0] not in LANGS:
            raise ValueError(f"{page}:{i + 1}: a runnable marker must be followed by a ```python or ```bash block")
        lang, code, after = block
        ex = Example(page, i + 2, lang, code, file=opts.get("file"), exit=int(opts.get("exit", 0)))
        k = _next_nonblank(lines, after)
        if k < len(lines) and OUTPUT_MARK.match(lines[k]):
            out = _fence_at(lines, k + 1) if k + 1 < len(lines) else None
            if out is None:
                raise ValueError(f"{page}:{k + 1}: an output marker must be followed by a fenced block")
            ex.expected = [ln.rstrip() for ln in out[1].split("\n") if ln.strip()]
            after = out[2]
        if ex.file and ex.expected:
            raise ValueError(f"{page}:{i + 1}: a file= block is not run, so it cannot show output")
        found.append(ex)
        i = after
    return found


def output_matches(expected: List[str], printed: str) -> Optional[str]:
    """None when every expected line is a printed line, in order ('...' matches any text);
    otherwise the first expected line that was not found."""
    got = [ln.rstrip() for ln in printed.splitlines()]
    pos = 0
    for want in expected:
        pattern = re.compile(".*".join(re.escape(part) for part in want.split("...")) + r"\Z")
        while pos < len(got) and not pattern.match(got[pos]):
            pos += 1
        if pos == len(got):
            return want
        pos += 1
    return None


def _pages() -> List[pathlib.Path]:
    return [ROOT / "README.md"] + sorted(DOCS.glob("*.md"))


def _run_env() -> Dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


def _run_page(page: pathlib.Path, workdir: pathlib.Path) -> None:
    for name in ("scripts", "hostfiles"):
        (workdir / name).symlink_to(ROOT / name)
    env = _run_env()
    for n, ex in enumerate(examples(page.read_text(), page.name)):
        if ex.file:
            (workdir / ex.file).write_text(ex.code)
            continue
        if ex.lang == "python":
            script = workdir / f"_example_{n}.py"
            script.write_text(ex.code)
            cmd = [sys.executable, str(script)]
        else:
            cmd = ["bash", "-e", "-c", ex.code]
        proc = subprocess.run(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=300)
        assert proc.returncode == ex.exit, \
            f"{ex.where()}: exit {proc.returncode}, the page says {ex.exit}; it printed:\n{proc.stdout[-4000:]}"
        missing = output_matches(ex.expected, proc.stdout)
        assert missing is None, \
            f"{ex.where()}: the page shows the line\n  {missing}\nwhich the run did not print (in order):\n{proc.stdout[-4000:]}"


PAGES_WITH_EXAMPLES = [p for p in _pages() if examples(p.read_text(), p.name)]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("page", PAGES_WITH_EXAMPLES, ids=[p.name for p in PAGES_WITH_EXAMPLES])
def test_runnable_examples(page, tmp_path):
    _run_page(page, tmp_path)


def test_marker_parsing_and_output_check():
    text = "\n".join([
        "<!-- runnable: file=train.py -->", "```python", "print('x')", "```", "",
        "<!-- runnable: exit=2 -->", "```bash", "dslaunch --num_gpus 0 train.py", "```", "",
        "<!-- output -->", "```text", "dslaunch: error: ...", "", "```",
        "```python", "not marked", "```",
    ])
    first, second = examples(text, "t.md")
    assert (first.file, first.lang, first.code, first.expected) == ("train.py", "python", "print('x')\n", [])
    assert (second.exit, second.lang, second.line, second.expected) == (2, "bash", 7, ["dslaunch: error: ..."])
    assert output_matches(["a ... c", "d"], "x\na b c\ny\nd\n") is None
    assert output_matches(["d", "a ... c"], "a b c\nd\n") == "a ... c"  # order counts
    assert output_matches(["a b"], "a b c\n") == "a b"  # whole lines, not substrings
    with pytest.raises(ValueError, match="unknown runnable option"):
        examples("<!-- runnable: fast -->\n```bash\ntrue\n```\n", "t.md")
    with pytest.raises(ValueError, match="must be followed"):
        examples("<!-- runnable -->\n```text\nhi\n```\n", "t.md")


def test_docs_pages_have_runnable_examples():
    """The pages that promise runnable examples keep them (a marker typo would drop them silently)."""
    names = {p.name for p in PAGES_WITH_EXAMPLES}
    assert {"README.md", "index.md", "zero.md", "writing-docs.md", "troubleshooting.md", "launching.md"} <= names, names


def _nav_pages() -> List[str]:
    import yaml

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    return [page for entry in nav for page in entry.values()]


def test_the_home_page_and_the_readme_list_every_page():
    pages = [p for p in _nav_pages() if p != "index.md"]
    assert sorted(pages + ["index.md"]) == sorted(p.name for p in DOCS.glob("*.md"))
    home = (DOCS / "index.md").read_text()
    readme_docs = (ROOT / "README.md").read_text().split("## Documentation", 1)[1]
    for page in pages:
        assert f"]({page})" in home, f"docs/index.md does not list {page}"
        assert f"](docs/{page})" in readme_docs, f"README's Documentation list does not name {page}"
    assert "## Quick start" in home


def test_the_scale_plot_is_shown_where_its_figures_are():
    text = (DOCS / "benchmarks.md").read_text()
    assert "](images/bench_scale.png)" in text and (DOCS / "images" / "bench_scale.png").is_file()
    assert "--plot docs/images/bench_scale.png" in text


# What user pages must not speak of: the project's own bookkeeping. A figure says what was
# measured, where and with which command; DeepSpeed's commit is where its tests came from.
BOOKKEEPING = {
    "an issue number": re.compile(r"\bissues?\s*#?\d+", re.I),
    "a goal or target": re.compile(r"\bgoals?\b|\bwe aim\b|(?<![-\w])targets?\b(?!_)", re.I),
    "other jobs on the machine": re.compile(r"other (jobs|agents|helpers|test suites?|test runs?|engineers)|"
                                            r"build machine|engineers' jobs", re.I),
    "a round of work": re.compile(r"\b(this|last|earlier|previous) round\b", re.I),
    "a commit hash": re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b"),
}
DEEPSPEED_COMMIT = {"edaa722126", "edaa7221267243c7be7fb49c5d5f5c4fb97b4641"}


def test_user_pages_speak_of_what_was_measured_not_of_bookkeeping():
    found = []
    for page in _pages():
        for n, line in enumerate(page.read_text().splitlines(), 1):
            for what, pattern in BOOKKEEPING.items():
                for m in pattern.finditer(line):
                    if what == "a commit hash" and m.group(0) in DEEPSPEED_COMMIT:
                        continue
                    found.append(f"{page.name}:{n}: {what}: {m.group(0)!r}")
    assert found == [], "\n".join(found)


def test_readme_table_cells_hold_one_figure_and_a_link():
    longest = max((cell.strip() for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("|")
                   for cell in re.split(r"(?<!\\)\|", line)[1:-1]), key=len)
    assert len(longest) <= 160, longest


# -- the site

def _mkdocs(config: pathlib.Path, site: pathlib.Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], env=env, capture_output=True, text=True, timeout=300)


def test_mkdocs_build_strict(tmp_path):
    proc = _mkdocs(ROOT / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "site" / "troubleshooting" / "index.html").is_file()


@pytest.mark.parametrize("damage", ["broken link", "broken anchor", "page not in nav"])
def test_mkdocs_strict_build_fails_on_damage(tmp_path, damage):
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(DOCS, tmp_path / "docs")
    if damage == "page not in nav":
        (tmp_path / "docs" / "orphan.md").write_text("# Orphan\n")
    else:
        link = "[x](no-such-page.md)" if damage == "broken link" else "[x](zero.md#no-such-heading)"
        with open(tmp_path / "docs" / "index.md", "a") as fh:
            fh.write(f"\n{link}\n")
    proc = _mkdocs(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode != 0, f"{damage}: the strict build passed\n{proc.stderr[-2000:]}"


# -- README's links

def _slug(heading: str) -> str:
    """The anchor GitHub and MkDocs' toc give a heading (for the headings these pages use)."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(md: pathlib.Path) -> set:
    out, in_fence = set(), False
    for line in md.read_text().splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
        elif not in_fence and line.startswith("#"):
            out.add(_slug(line.lstrip("#")))
    return out


def test_readme_links_resolve():
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    relative = [link for link in links if not re.match(r"[a-z]+:", link)]
    assert any(link.startswith("docs/") for link in relative), "README links to no docs page"
    for link in relative:
        path, _, anchor = link.partition("#")
        target = (ROOT / path) if path else ROOT / "README.md"
        assert target.exists(), f"README links to {link}: {target} does not exist"
        if anchor:
            assert anchor in _anchors(target), f"README links to {link}: no such heading in {target.name}"


def test_readme_first_steps_work_as_typed():
    """What a new user reads before the first command: where `dslaunch` is after set-up, that
    scripts/test.sh installs system packages as root, and a quick start whose lines run the
    train.py shown below them as it is (it takes no arguments)."""
    text = (ROOT / "README.md").read_text()
    first = text[:text.index("## Quick start")]
    assert "source .venv/bin/activate" in first and ".venv/bin/dslaunch" in first
    assert "as root" in first
    for package in ("OpenSSH server", "pdsh", "Open MPI", "Slurm", "munge"):
        assert package in first, package
    quick = text.split("## Quick start", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    for line in quick.splitlines():
        command = line.split("#")[0].split()
        if "train.py" in command:
            assert command[-1] == "train.py", f"the quick start's train.py takes no arguments: {line}"


def test_no_stray_file_is_tracked_at_the_top():
    import subprocess

    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    top = {path for path in tracked.splitlines() if "/" not in path}
    assert top <= {".gitignore", "README.md", "mkdocs.yml", "pyproject.toml", "setup.py"}, top


def test_readme_stays_short_and_keeps_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    first = text[:text.index("\n## ")]
    commands = [ln.split("#")[0].strip() for ln in first.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()]
    assert commands == ["bash scripts/demo.sh", "bash scripts/test.sh"]
    assert "Python 3.10+" in first
