"""The compression branch of the differential test, against DeepSpeed 0.17.6 (the last release
with deepspeed.compression), generated rather than hand-picked:

    # record DeepSpeed 0.17.6's answers (its own venv, CPU accelerator) into tests/data/ds_diff_compression/
    .venv/bin/python scripts/diff_compression.py --record [--ds-python /work/ds17-venv/bin/python] [--missing]
    # run our side of every recorded case and classify it against DeepSpeed's
    .venv/bin/python scripts/diff_compression.py [--cases 'LINE' ...] [--verbose] [--write-docs]
    # the cases the seed draws, one line each
    .venv/bin/python scripts/diff_compression.py --list

A sibling of scripts/diff_vs_deepspeed.py rather than a mode of it: the reference is another
DeepSpeed (0.17.6, in its own venv) and a case is another script (init_compression,
deepspeed.initialize, training, redundancy_clean), one process at ZeRO 0-3. The cases come
from scripts/diff_compression_cases.py (COUNT drawn from SEED by its grammar, plus
EXTRA_CASES: a new case is one line there); scripts/diff_compression_runner.py runs one, the
same code on both sides. Each side runs its cases in one worker process (one gloo process
group, a fresh engine per case). Classes (diff_compression_cases.classify):

  equal                         losses of every step and the cleaned layers (shapes exactly,
                                which weights are zero exactly, values within the tolerance)
  refused by both               both raise (ours in one line)
  refused here only (listed)    DeepSpeed trains it; we refuse in one line, a gap listed in GAPS
  refused by DeepSpeed only     DeepSpeed raises, we train it
  different by design (listed)  we train other numbers on purpose (DESIGN, with the reason)
  open divergence (listed)      a divergence not resolved yet (OPEN, with what is known)
  divergence                    anything else: a bug
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from diff_compression_cases import CLASSES, COUNT, MEASURED, OPEN, SEED, CompCase, classify, generate  # noqa: E402
from diff_report import (details, divergences, error_answer, healed, print_report, recorded_versions,  # noqa: E402
                         summary_block, write_blocks)

FIXTURES = os.path.join(ROOT, "tests", "data", "ds_diff_compression")
RESULTS = os.path.join(FIXTURES, "deepspeed.pt")
SUMMARY_DOC = os.path.join(ROOT, "docs", "deepspeed-differential.md")
DS_PYTHON = "/work/ds17-venv/bin/python"
TIMEOUT = 1800.0  # seconds for one side's whole run


def worker_env(side: str) -> Dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore")
    if side == "deepspeed":
        env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(tempfile.gettempdir(), "ds17-ext"))
    return env


# -- inside the worker ------------------------------------------------------------------------------
def worker(side: str, jobs: str, out: str) -> None:
    """Run every case of `jobs` (JSON: [{"line", "scores"?}]) and torch.save {line: result} to `out`."""
    import torch

    torch.set_num_threads(1)
    from bench_ranks import free_port

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    if side == "deepspeed":
        import deepspeed as rt
        from deepspeed.compression import compress
    else:
        import dslaunch.runtime as rt
        from dslaunch.runtime import compression as compress
    import diff_compression_runner as runner

    rt.init_distributed("gloo")
    todo = torch.load(jobs, weights_only=False)
    results = {}
    for job in todo:
        line = job["line"]
        try:
            results[line] = runner.run_case(rt, compress, CompCase.parse(line), job.get("scores"))
        except Exception as exc:  # noqa: BLE001 (a refusal is an answer)
            results[line] = error_answer(exc)
        print(f"{side}: {line}: {results[line].get('error') or 'trained'}", file=sys.stderr, flush=True)
    torch.save(results, out)


def run_side(python: str, side: str, jobs: List[dict], timeout: float = TIMEOUT) -> Dict[str, dict]:
    """{line: result} of every job on one side, in one worker process."""
    import torch

    with tempfile.TemporaryDirectory(prefix=f"diffcomp-{side}-") as tmp:
        jobs_file, out = os.path.join(tmp, "jobs.pt"), os.path.join(tmp, "out.pt")
        torch.save(jobs, jobs_file)
        log = os.path.join(tmp, "log")
        with open(log, "w") as fh:
            proc = subprocess.run([python, os.path.abspath(__file__), "--worker", side, jobs_file, out],
                                  stdout=fh, stderr=subprocess.STDOUT, env=worker_env(side), cwd=ROOT,
                                  timeout=timeout)
        if proc.returncode or not os.path.exists(out):
            with open(log, errors="replace") as fh:
                tail = fh.read()[-3000:]
            raise RuntimeError(f"the {side} worker stopped (exit {proc.returncode}):\n{tail}")
        return torch.load(out, weights_only=False)


# -- the fixtures ------------------------------------------------------------------------------------
def load_fixtures() -> Dict[str, dict]:
    import torch

    if not os.path.exists(RESULTS):
        return {}
    return torch.load(RESULTS, weights_only=True)["results"]


def save_fixtures(results: Dict[str, dict], ds_python: str) -> None:
    import torch

    os.makedirs(FIXTURES, exist_ok=True)
    ds_version, torch_version = recorded_versions(ds_python, worker_env("deepspeed"))
    torch.save({"deepspeed": ds_version, "torch": torch_version, "seed": SEED, "count": COUNT,
                "results": dict(sorted(results.items()))}, RESULTS)


def to_plain(result: dict) -> dict:
    """A result as classify reads it: lists of floats rather than tensors."""
    if "error" in result:
        return result
    return {"losses": list(result["losses"]), "shapes": result["shapes"],
            "weights": {k: v.tolist() for k, v in result["weights"].items()}}


# -- the command line --------------------------------------------------------------------------------
def record(args, cases: List[CompCase]) -> None:
    have = load_fixtures()
    if args.missing:
        cases = [c for c in cases if c.line not in have]
    print(f"recording {len(cases)} cases under {args.ds_python}", flush=True)
    started = time.monotonic()
    results = run_side(args.ds_python, "deepspeed", [{"line": c.line} for c in cases])
    have.update(results)
    save_fixtures(have, args.ds_python)
    print(f"recorded {len(results)} cases in {time.monotonic() - started:.0f} s", flush=True)


def compare(cases: List[CompCase], fixtures: Dict[str, dict], python: str = sys.executable):
    """Run our side of every case DeepSpeed's fixtures hold: ({line: ours}, {line: Verdict})."""
    todo = [c for c in cases if c.line in fixtures]
    jobs = [{"line": c.line, "scores": fixtures[c.line].get("scores")} for c in todo]
    ours = run_side(python, "dslaunch", jobs)
    verdicts = {c.line: classify(c, to_plain(fixtures[c.line]), to_plain(ours[c.line])) for c in todo}
    return ours, verdicts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--record", action="store_true", help="run DeepSpeed 0.17.6's side and write the fixtures")
    ap.add_argument("--ds-python", default=DS_PYTHON, help="a Python with deepspeed 0.17.6 (for --record)")
    ap.add_argument("--missing", action="store_true", help="with --record: only cases not recorded yet")
    ap.add_argument("--cases", nargs="*", help="case lines to run (default: every generated case)")
    ap.add_argument("--list", action="store_true", help="print the generated cases, one line each")
    ap.add_argument("--verbose", action="store_true", help="print every case's class")
    ap.add_argument("--write-docs", action="store_true", help="write the summary into docs/deepspeed-differential.md")
    args = ap.parse_args(argv)
    cases = [CompCase.parse(line) for line in args.cases] if args.cases else generate()
    if args.list:
        print("\n".join(c.line for c in cases))
        return 0
    if args.record:
        record(args, cases)
        return 0
    fixtures = load_fixtures()
    started = time.monotonic()
    _, verdicts = compare(cases, fixtures)
    elapsed = time.monotonic() - started
    if args.verbose:
        for line, v in verdicts.items():
            print(f"{v.kind:28s} {line}  {v.detail}")
    table = print_report(cases, fixtures, verdicts, CLASSES, elapsed)
    if args.write_docs:
        write_docs(table, verdicts)
    return 1 if divergences(verdicts) or healed(verdicts, OPEN) else 0


def write_docs(table: str, verdicts) -> None:
    """The docs' form: a listed reason without what each case measured."""
    reasons = details(verdicts, [k for k in CLASSES if k != "equal"], cut=MEASURED).strip()
    write_blocks(SUMMARY_DOC, {"diffcomp-summary": summary_block(table, reasons)})


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        sys.exit(main())
