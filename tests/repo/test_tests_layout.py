"""The layout of tests/ (docs/architecture.md, "A new test"): folders by area, no __init__.py,
so pytest imports every test file by its bare name with its own folder on sys.path, and the
rank processes dist_harness starts add that folder alone. Hence a test file's name is unique in
tests/, and a test file imports another test file only from its own folder (from another
folder it would import only when a full run happened to collect that folder first)."""
import ast
import collections

import repo_paths


def _test_files():
    return [p for p in sorted(repo_paths.TESTS.rglob("test_*.py")) if repo_paths.DATA not in p.parents]


def test_every_test_file_name_is_unique():
    by_name = collections.defaultdict(list)
    for path in _test_files():
        by_name[path.name].append(str(path.relative_to(repo_paths.TESTS)))
    assert {n: p for n, p in by_name.items() if len(p) > 1} == {}


def test_a_test_file_imports_test_files_only_from_its_own_folder():
    where = {p.stem: p.parent for p in _test_files()}
    wrong = []
    for path in _test_files():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            for name in names:
                if name in where and where[name] != path.parent:
                    wrong.append(f"{path.relative_to(repo_paths.TESTS)}:{node.lineno} imports {name}")
    assert wrong == []
