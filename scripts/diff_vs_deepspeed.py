"""A differential test against DeepSpeed 0.19.8, generated rather than hand-picked.

    # record DeepSpeed's answers (its own Python; CPU accelerator), as fixtures under tests/data/ds_diff/
    .venv/bin/python scripts/diff_vs_deepspeed.py --record [--ds-python /work/ds-venv/bin/python] [--missing]
    # run our side of every recorded case and classify it against DeepSpeed's
    .venv/bin/python scripts/diff_vs_deepspeed.py [--cases 'LINE' ...] [--save-ours FILE] [--write-docs]
    # classify what a --save-ours run kept, under the rules as they are now
    .venv/bin/python scripts/diff_vs_deepspeed.py --from-ours FILE [--write-docs]
    # the cases the seed draws, one line each
    .venv/bin/python scripts/diff_vs_deepspeed.py --list

The cases come from scripts/diff_cases.py: COUNT cases drawn from SEED by its grammar, plus
EXTRA_CASES (a new case is one line there). Each runs scripts/diff_runner.py's training
script, the same code on both sides (`import deepspeed` or `import dslaunch.runtime as
deepspeed`), and is classified (diff_cases.classify):

  equal                       both train, and the losses of every micro-step, the evaluation
                              loss, the step counters and the final weights agree within the
                              dtype's tolerance (diff_cases.TOLERANCES, each with its reason)
  refused by both             both raise (ours in one line)
  refused here only (listed)  DeepSpeed trains it, we refuse in one line with a reason that
                              docs/configuration.md lists: a gap
  refused by DeepSpeed only   DeepSpeed raises, we train (DeepSpeed's errors are recorded)
  divergence                  anything else: a bug

Cases run in persistent worker processes, one group of `world` ranks per world size (and
tensor-parallel layout): each rank starts its process group once, then builds a fresh engine
per case and tears it down, so a case costs its training, not a start-up. A case that saves
and resumes on another world size runs its first part in one group and its resumed part in
the other. A worker that stops answering (a hang, a crash) loses its group, which is
started again, and the case records what happened.

DeepSpeed's side: its CPU accelerator says fp16 is unsupported unless mkldnn supports it
on the CPU (AVX512-FP16/AMX); the recorder answers that it is, so DeepSpeed's fp16 path (loss
scaler, fp16 optimizers) runs on CPUs that lack those instructions too. transformers comes
from this environment (appended to DeepSpeed's sys.path), so both sides build the same
Hugging Face models.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import selectors
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from typing import Dict, Iterable, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from diff_cases import (CLASSES, COUNT, DEEPSPEED_WRONG, OPEN, SEED, Case, Verdict, classify, equivalent,  # noqa: E402
                        generate)
from diff_report import (details, divergences, error_answer, print_report, recorded_versions,  # noqa: E402
                         summary_block, write_blocks)

FIXTURES = os.path.join(ROOT, "tests", "data", "ds_diff")
RESULTS = os.path.join(FIXTURES, "deepspeed.json")
WEIGHTS = os.path.join(FIXTURES, "deepspeed_weights.pt")
CONFIG_DOC = os.path.join(ROOT, "docs", "configuration.md")
SUMMARY_DOC = os.path.join(ROOT, "docs", "deepspeed-differential.md")
DS_PYTHON = "/work/ds-venv/bin/python"
CASE_TIMEOUT = 300.0  # seconds without an answer from a rank before its group is taken for hung
READY_TIMEOUT = 600.0  # seconds for a group to start (DeepSpeed's ops are built before: build_ops)
DS_OPS = ("ShareMemCommBuilder", "FusedAdamBuilder", "CPUAdamBuilder", "CPUAdagradBuilder", "CPULionBuilder")


def worker_env(side: str) -> Dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false",
               PYTHONWARNINGS="ignore", TRANSFORMERS_VERBOSITY="error")
    if side == "deepspeed":
        # a private extension cache: a build killed in the shared default cache leaves a lock
        # that every later start waits on
        env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(tempfile.gettempdir(), "ds-diff-ext"))
        env["DIFF_EXTRA_SITE"] = sysconfig.get_paths()["purelib"]
    return env


def build_ops(ds_python: str) -> None:
    """Build (or load) every CPU op DeepSpeed's side uses, once, in one process and without a
    time limit, before any group starts: never a build interrupted by a case's timeout."""
    code = ("import deepspeed.ops.op_builder.cpu as b\n"
            f"for name in {DS_OPS!r}:\n    getattr(b, name)().load()\n")
    subprocess.run([ds_python, "-c", code], check=True, env=worker_env("deepspeed"), cwd=ROOT)


# -- inside a rank -------------------------------------------------------------------------------
def worker(side: str, rank: int, world: int, port: int) -> None:
    """Answer one JSON line on the original stdout per job line on stdin."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # what the libraries print goes to the log, not into the answers
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist

    if side == "deepspeed":
        extra = os.environ.get("DIFF_EXTRA_SITE")
        if extra:
            sys.path.append(extra)  # after DeepSpeed's own packages: its torch stays first
        import deepspeed as rt
        from deepspeed.accelerator import get_accelerator

        type(get_accelerator()).is_fp16_supported = lambda self: True
    else:
        import dslaunch.runtime as rt
    import diff_runner

    rt.init_distributed("gloo")
    answers.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        job = json.loads(line)
        if job.get("stop"):
            break
        if job.get("sync"):
            try:
                if world > 1:
                    dist.monitored_barrier(group=dist.group.WORLD, timeout=datetime.timedelta(seconds=120))
                answer = {"ok": True}
            except Exception as exc:  # noqa: BLE001 (the driver restarts the group)
                answer = error_answer(exc)
        else:
            try:
                result = diff_runner.run_case(rt, Case.parse(job["case"]), job["phase"], job["ckpt"])
                answer = result if rank == 0 else {"ok": True}
            except Exception as exc:  # noqa: BLE001 (a refusal is an answer)
                answer = error_answer(exc)
        gc.collect()
        answers.write(json.dumps(answer) + "\n")
    answers.close()


# -- the driver ----------------------------------------------------------------------------------
class Group:
    """`world` worker processes of one side, answering jobs in turn."""

    def __init__(self, python: str, side: str, world: int, log_dir: str):
        from bench_ranks import free_port

        self.world = world
        env = worker_env(side)
        port = free_port()
        self.logs = [os.path.join(log_dir, f"{side}-w{world}-r{r}-{port}.log") for r in range(world)]
        self.procs = []
        for r in range(world):
            with open(self.logs[r], "w") as log:
                self.procs.append(subprocess.Popen(
                    [python, os.path.abspath(__file__), "--worker", side, str(r), str(world), str(port)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, cwd=ROOT, env=env))
        self.pending = [b""] * world
        self.ready = self._wait(READY_TIMEOUT) is not None

    def _wait(self, timeout: float) -> Optional[List[dict]]:
        """Every rank's next answer, or None when one dies or stays silent for `timeout` seconds."""
        answers: List[Optional[dict]] = [None] * self.world
        sel = selectors.DefaultSelector()
        for r, p in enumerate(self.procs):
            sel.register(p.stdout, selectors.EVENT_READ, r)
        deadline = time.monotonic() + timeout
        try:
            while any(a is None for a in answers):
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                for key, _ in sel.select(timeout=min(left, 5.0)):
                    r = key.data
                    chunk = os.read(key.fileobj.fileno(), 1 << 20)
                    if not chunk:
                        return None  # the rank exited
                    self.pending[r] += chunk
                    if b"\n" in self.pending[r]:
                        line, _, rest = self.pending[r].partition(b"\n")
                        self.pending[r] = rest
                        answers[r] = json.loads(line)
                        sel.unregister(key.fileobj)
        finally:
            sel.close()
        return answers  # type: ignore[return-value]

    def ask(self, job: dict, timeout: float) -> Optional[List[dict]]:
        """Every rank's answer, or None when one dies or stays silent for `timeout` seconds."""
        if not self.ready:
            return None
        data = (json.dumps(job) + "\n").encode()
        try:
            for p in self.procs:
                p.stdin.write(data)
                p.stdin.flush()
        except (BrokenPipeError, OSError):
            return None
        return self._wait(timeout)

    def log_tail(self, rank: int = 0, lines: int = 3) -> str:
        try:
            with open(self.logs[rank], errors="replace") as fh:
                text = [ln.strip() for ln in fh.read().splitlines() if ln.strip()]
            return " | ".join(text[-lines:])
        except OSError:
            return ""

    def close(self) -> None:
        for p in self.procs:
            try:
                p.stdin.write(b'{"stop": true}\n')
                p.stdin.close()
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + 30
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()


def _merge(first: dict, second: dict) -> dict:
    """A case's result from its two parts (resumed on another world size)."""
    if "error" in first:
        return first
    if "error" in second:
        return second
    out = dict(second)
    out["losses"] = first["losses"] + second["losses"]
    out["eval"] = first.get("eval", []) + second.get("eval", [])
    return out


def run_side(python: str, side: str, cases: List[Case], timeout: float = CASE_TIMEOUT,
             progress=None) -> Dict[str, dict]:
    """{case line: result} of every case on one side (`python` with `side`'s engine)."""
    tmp = tempfile.mkdtemp(prefix=f"diff-{side}-")
    results: Dict[str, dict] = {}
    firsts: Dict[str, dict] = {}
    ckpts = {c.line: os.path.join(tmp, "ckpt", str(i)) for i, c in enumerate(cases)}
    try:
        for phase in (0, 1):
            todo = [c for c in cases if len(c.phases) > phase]
            if phase == 1:
                todo = [c for c in todo if "error" not in firsts.get(c.line, {"error": ""})]
            order = sorted(todo, key=lambda c: (c.phases[phase], c.layout))
            group, key = None, None
            for case in order:
                want = (case.phases[phase], case.layout)
                if group is not None and want != key:
                    group.close()
                    group = None
                if group is None:
                    group, key = Group(python, side, want[0], tmp), want
                answers = group.ask({"case": case.line, "phase": phase, "ckpt": ckpts[case.line]}, timeout)
                if answers is None:
                    result = {"error": f"Hang: no answer from every rank in {timeout:.0f} s or a rank died "
                                       f"({group.log_tail()})", "lines": 1}
                    group.kill()
                    group = None
                else:
                    errors = [a for a in answers if "error" in a]
                    result = errors[0] if errors else answers[0]
                    if errors and not all(a == errors[0] for a in answers):
                        # ranks that raised at different points, or not all: meet at a barrier, or start clean
                        synced = group.ask({"sync": True}, 180.0)
                        if synced is None or any("error" in a for a in synced):
                            group.kill()
                            group = None
                if phase == 0 and len(case.phases) > 1:
                    firsts[case.line] = result
                    if "error" in result:
                        results[case.line] = result
                else:
                    results[case.line] = _merge(firsts[case.line], result) if phase == 1 else result
                    shutil.rmtree(ckpts[case.line], ignore_errors=True)
                if progress is not None and case.line in results:
                    progress(case, results[case.line])
            if group is not None:
                group.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return results


# -- the fixtures --------------------------------------------------------------------------------
def load_fixtures() -> Dict[str, dict]:
    """{case line: DeepSpeed's result}, weights included."""
    import torch

    if not os.path.exists(RESULTS):
        return {}
    with open(RESULTS) as fh:
        results = json.load(fh)["results"]
    weights = torch.load(WEIGHTS, weights_only=True) if os.path.exists(WEIGHTS) else {}
    for line, res in results.items():
        if line in weights:
            res["weights"] = weights[line].tolist()
    return results


def save_fixtures(results: Dict[str, dict], ds_python: str) -> None:
    import torch

    os.makedirs(FIXTURES, exist_ok=True)
    ds_version, torch_version = recorded_versions(ds_python, dict(os.environ, DS_ACCELERATOR="cpu"))
    slim, weights = {}, {}
    for line in sorted(results):
        res = dict(results[line])
        flat = res.pop("weights", None)
        if flat is not None:
            weights[line] = torch.tensor(flat, dtype=torch.float32)
        slim[line] = res
    with open(RESULTS, "w") as fh:
        json.dump({"deepspeed": ds_version, "torch": torch_version, "seed": SEED, "count": COUNT,
                   "results": slim}, fh, indent=0, sort_keys=True)
        fh.write("\n")
    torch.save(weights, WEIGHTS)


# -- what docs/configuration.md lists -------------------------------------------------------------
def listed_reasons(path: str = CONFIG_DOC) -> List[str]:
    """The reasons docs/configuration.md gives for a refusal: each refused key's text in the
    config-key table, and each reason of its list of refused combinations."""
    reasons = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            if len(cells) == 3 and (cells[1].startswith("refused") or cells[1] == "refused combination"):
                reasons.append(cells[2].replace("\\|", "|"))
    return [r for r in reasons if r]


def is_listed(message: str, reasons: Iterable[str]) -> bool:
    return any(reason in message for reason in reasons)


# -- the command line ---------------------------------------------------------------------------
def select(args) -> List[Case]:
    if args.cases:
        return [Case.parse(line) for line in args.cases]
    return generate()


def with_equivalents(cases: List[Case]) -> List[Case]:
    """The cases and, after them, each one's equivalent case (diff_cases.EQUIVALENTS) not among them."""
    seen = {c.line for c in cases}
    out = list(cases)
    for case in cases:
        twin, _ = equivalent(case)
        if twin is not None and twin.line not in seen:
            seen.add(twin.line)
            out.append(twin)
    return out


def judge(case: Case, fixtures: Dict[str, dict], ours: dict, reasons: List[str]):
    twin, rules = equivalent(case)
    verdict = classify(case, fixtures[case.line], ours, lambda m: is_listed(m, reasons),
                       twin=fixtures.get(twin.line) if twin is not None else None, rules=rules)
    if verdict.kind == "divergence" and case.line in OPEN:
        return Verdict("open divergence (listed)", f"{OPEN[case.line]} ({verdict.detail})")
    if verdict.kind == "divergence" and case.line in DEEPSPEED_WRONG:
        return Verdict("DeepSpeed wrong, no equivalent", DEEPSPEED_WRONG[case.line])
    return verdict


def record(args, cases: List[Case]) -> None:
    if not args.no_equivalents:
        cases = with_equivalents(cases)
    have = load_fixtures()
    if args.missing:
        cases = [c for c in cases if c.line not in have]
    if args.limit:
        cases = cases[:args.limit]
    print(f"recording {len(cases)} cases under {args.ds_python}", flush=True)
    done = dict(have)
    started = time.monotonic()
    count = [0]

    def progress(case, result):
        count[0] += 1
        done[case.line] = result
        what = result["error"] if "error" in result else f"losses {[round(x, 5) for x in result['losses']]}"
        print(f"[{count[0]}/{len(cases)} {time.monotonic() - started:.0f}s] {case.line}: {what}", flush=True)
        if count[0] % 10 == 0:
            save_fixtures(done, args.ds_python)

    build_ops(args.ds_python)
    run_side(args.ds_python, "deepspeed", cases, progress=progress)
    save_fixtures(done, args.ds_python)


def compare(cases: List[Case], fixtures: Dict[str, dict], python: str = sys.executable,
            progress=None) -> Tuple[Dict[str, dict], Dict[str, "object"]]:
    """Run our side of every case DeepSpeed's fixtures hold; ({line: ours}, {line: Verdict})."""
    todo = [c for c in cases if c.line in fixtures]
    ours = run_side(python, "dslaunch", todo, progress=progress)
    reasons = listed_reasons()
    verdicts = {c.line: judge(c, fixtures, ours[c.line], reasons) for c in todo}
    return ours, verdicts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--record", action="store_true", help="run DeepSpeed's side and write the fixtures")
    ap.add_argument("--ds-python", default=DS_PYTHON, help="a Python with deepspeed 0.19.8 (for --record)")
    ap.add_argument("--missing", action="store_true", help="with --record: only cases not recorded yet")
    ap.add_argument("--limit", type=int, default=0, help="with --record: at most this many cases")
    ap.add_argument("--no-equivalents", action="store_true", help="with --record: not the equivalent cases")
    ap.add_argument("--cases", nargs="*", help="case lines to run (default: every generated case)")
    ap.add_argument("--list", action="store_true", help="print the generated cases, one line each")
    ap.add_argument("--run", choices=["deepspeed", "dslaunch"], help="only run the cases on one side and print "
                    "each result (nothing is compared or written)")
    ap.add_argument("--save-ours", help="append our result of each case to this file (JSON lines)")
    ap.add_argument("--from-ours", help="classify the results a --save-ours run wrote instead of running our side")
    ap.add_argument("--verbose", action="store_true", help="print every case's class as it is compared")
    ap.add_argument("--write-docs", action="store_true", help=f"write the summary into {os.path.relpath(SUMMARY_DOC, ROOT)}")
    args = ap.parse_args(argv)
    cases = select(args)
    if args.list:
        print("\n".join(c.line for c in cases))
        return 0
    if args.record:
        record(args, cases)
        return 0
    if args.run:
        python = args.ds_python if args.run == "deepspeed" else sys.executable
        if args.run == "deepspeed":
            build_ops(python)
        run_side(python, args.run, cases, progress=lambda c, r: print(
            f"{c.line}: {json.dumps({k: v for k, v in r.items() if k not in ('weights', 'weight_names')})}",
            flush=True))
        return 0
    fixtures = load_fixtures()
    started = time.monotonic()
    reasons = listed_reasons()

    def progress(case, result):
        if args.save_ours:
            with open(args.save_ours, "a") as fh:
                fh.write(json.dumps({"line": case.line, "result": result}) + "\n")
        if args.verbose:
            v = judge(case, fixtures, result, reasons)
            print(f"[{time.monotonic() - started:.0f}s] {v.kind:28s} {case.line}  {v.detail}", flush=True)

    if args.from_ours:
        # classify results a --save-ours run kept (the rules and tolerances as they are now)
        ours = {}
        with open(args.from_ours) as fh:
            for row in map(json.loads, fh):
                ours[row["line"]] = row["result"]
        verdicts = {c.line: judge(c, fixtures, ours[c.line], reasons) for c in cases
                    if c.line in fixtures and c.line in ours}
    else:
        _, verdicts = compare(cases, fixtures, progress=progress)
    elapsed = time.monotonic() - started
    table = print_report(cases, fixtures, verdicts, CLASSES, elapsed)
    if args.write_docs:
        write_docs(table, verdicts, elapsed)
    return 1 if divergences(verdicts) else 0


def tolerance_table() -> str:
    from diff_cases import TOLERANCES

    rows = ["| dtype | rtol | atol | why |", "|---|---|---|---|"]
    rows += [f"| {d} | {t.rtol:g} | {t.atol:g} | {t.why} |" for d, t in TOLERANCES.items()]
    return "\n".join(rows)


def equivalents_table() -> str:
    """docs' table of diff_cases.EQUIVALENTS: for which cases which change, and why."""
    from diff_cases import EQUIVALENTS

    rows = ["| change made for DeepSpeed's side | DeepSpeed's own answer | why |", "|---|---|---|"]
    for rule in EQUIVALENTS:
        change = ", ".join(f"`{k}={v}`" for k, v in rule.change.items())
        rows.append(f"| {change} | {'wrong' if rule.wrong else 'refused'} | {rule.why} |")
    return "\n".join(rows)


def write_docs(table: str, verdicts, elapsed: float) -> None:
    reasons = details(verdicts, [k for k in CLASSES if k != "equal"]).strip()
    write_blocks(SUMMARY_DOC, {"diff-tolerances": tolerance_table(), "diff-equivalents": equivalents_table(),
                               "diff-summary": summary_block(table, reasons)})


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    else:
        sys.exit(main())
