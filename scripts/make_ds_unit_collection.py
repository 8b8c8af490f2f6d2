"""Make tests/data/deepspeed_unit_collection.json: how many tests each file of DeepSpeed's
tests/unit holds, as pytest collects them with DeepSpeed's own package importable.

    PYTHONPATH=DIR /work/ds-venv/bin/python scripts/make_ds_unit_collection.py --deepspeed-src /path/to/DeepSpeed

with DeepSpeed's dependencies in the interpreter that runs this, and DIR holding pytest<8.4 and
the test-only packages of DeepSpeed's requirements-dev.txt that the tests import at module level
(transformers, mup). The collection runs inside the checkout's tests/ folder, as DeepSpeed's CPU
CI runs (its conftest puts the checkout root on sys.path, so the tests import the checkout's own
`deepspeed` source, and `accelerator` and `op_builder` beside it; the script checks that they
did: an unbuilt source reports version 0.0.0), with pytest.ini's default marker selection and
DS_ACCELERATOR=cpu; nothing is written into the checkout (no bytecode, no cache).

scripts/run_deepspeed_tests.py uses these counts for a file that fails to import against the
compatibility package: each of its tests counts as a failure, not one per file.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "tests", "data", "deepspeed_unit_collection.json")

PLUGIN = '''
import collections, json, os, sys

_errors = []

def pytest_collectreport(report):
    if report.failed:
        _errors.append(report.nodeid)

def pytest_collection_finish(session):
    counts = collections.Counter(item.nodeid.split("::")[0] for item in session.items)
    ds = sys.modules.get("deepspeed")  # the package the tests imported: the checkout's own source
    with open(os.environ["DS_COLLECTION_OUT"], "w") as fh:
        json.dump({"files": dict(sorted(counts.items())), "errors": sorted(_errors),
                   "deepspeed": getattr(ds, "__version__", None), "deepspeed_file": getattr(ds, "__file__", None)}, fh)
'''


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--deepspeed-src", required=True)
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args()
    tests = os.path.join(args.deepspeed_src, "tests")
    commit = subprocess.run(["git", "-C", args.deepspeed_src, "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "ds_collect_plugin.py"), "w") as fh:
            fh.write(PLUGIN)
        raw = os.path.join(tmp, "collection.json")
        env = dict(os.environ, DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="", PYTHONDONTWRITEBYTECODE="1",
                   DS_COLLECTION_OUT=raw,
                   PYTHONPATH=os.pathsep.join([tmp] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        subprocess.run([sys.executable, "-m", "pytest", "unit/", "--collect-only", "-q", "-p", "no:cacheprovider",
                        "-p", "no:randomly", "-p", "ds_collect_plugin"], cwd=tests, env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(raw) as fh:
            data = json.load(fh)
    files = {path[len("unit/"):]: n for path, n in data["files"].items()}
    checkout = os.path.realpath(args.deepspeed_src)
    if not os.path.realpath(data["deepspeed_file"] or "/").startswith(checkout + os.sep):
        print(f"make_ds_unit_collection: the tests imported deepspeed from {data['deepspeed_file']}, not from the "
              f"checkout {checkout}", file=sys.stderr)
        return 1
    with open(args.out, "w") as fh:
        json.dump({"commit": commit, "deepspeed": data["deepspeed"], "tests": sum(files.values()),
                   "collection_errors": [e[len("unit/"):] for e in data["errors"]], "files": files}, fh, indent=1)
        fh.write("\n")
    print(f"{sum(files.values())} tests in {len(files)} files; collection errors: {data['errors']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
