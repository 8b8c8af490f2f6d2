"""Where things are, for every test whatever its folder: the test files live in folders by
area (tests/launcher/, tests/runtime/zero/, ...) at different depths, so none of them finds the
repository, tests/data or the worker scripts by counting parents of its own path.

tests/ is on sys.path under pytest (conftest.py lives there) and in every rank the multi-process
harness starts (it runs tests/dist_harness.py), so `import repo_paths` works from any test file.
"""
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
DATA = TESTS / "data"  # DeepSpeed's recorded answers, written by scripts/make_ds_*_fixtures.py
FIXTURES = TESTS / "fixtures"
WORKERS = TESTS / "workers"  # scripts the tests start as ranks or as the user's training script
SCRIPTS = ROOT / "scripts"
