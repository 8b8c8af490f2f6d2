"""Run the failure-attribution scenario many times and count how often the launcher got it right.

    python scripts/attribution_soak.py [--runs 50] [--cases zero0,zero1,zero2,zero3,pipe] [--busy N]

Each run: `dslaunch --num_gpus 2` on tests/workers/raise_in_collective.py CASE, where rank 0
raises while rank 1 waits in a collective. Right means: rank 0 named as the failure, its
traceback shown, nothing of rank 1's follow-on gloo error on the console (the test suite's
own check, tests/launcher/test_launch_attribution.attributed_to_rank_0). --busy N starts N busy-loop
processes for the duration, to run it under load. Prints one line per case: right/runs.
Exit status 1 if any run was wrong (its stderr is printed).
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "launcher")]  # its helpers, and the test itself

from test_launch_attribution import attributed_to_rank_0, run_case  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--cases", default="zero0,zero1,zero2,zero3,pipe")
    ap.add_argument("--busy", type=int, default=0, help="busy-loop processes to run alongside")
    args = ap.parse_args()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    wrong = 0
    try:
        for case in args.cases.split(","):
            right, started = 0, time.monotonic()
            for i in range(args.runs):
                with tempfile.TemporaryDirectory(prefix="dslaunch-soak-") as d:
                    r = run_case(case, Path(d))
                if attributed_to_rank_0(r):
                    right += 1
                else:
                    wrong += 1
                    print(f"{case} run {i + 1}: wrong\n{r.stderr}", flush=True)
            print(f"{case}: rank 0 named {right}/{args.runs} "
                  f"({time.monotonic() - started:.0f}s, load {os.getloadavg()[0]:.1f})", flush=True)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
